"""What ``asyncopd plan`` prints: a plan as a table of every stage's figures per chip and the
pipeline's balance (:func:`format_plan`), and a ``--balance`` search's outcome, the best
splits and the chosen one planned in full (:func:`format_balanced`)."""

from __future__ import annotations

from asyncopd_jax.scale.chips import GIB
from asyncopd_jax.scale.plan import Plan
from asyncopd_jax.scale.search import Balanced, busy_fractions


def balance_header(plan: Plan) -> list[str]:
    """What the balance lines assume (:mod:`asyncopd_jax.scale.balance`)."""
    answers, lines = plan.answers, []
    if answers is not None:
        expected = "every answer to the limit" if answers.mean == answers.limit else f"{answers.mean:g} expected"
        lines.append(f"answers: {expected} of {answers.limit} tokens, after {answers.prompt} prompt slots")
    if plan.swap is not None:
        lines.append(plan.swap.describe())
    return [
        *lines,
        "per rollout batch, at the roofline (asyncopd_jax/scale/balance.py; the sampler: prefill +",
        "decode + a weight swap's load and recompute): the slowest stage sets the pace, the others idle the rest",
    ]


def stage_detail(plan: Plan, name: str) -> str:
    """The parts of a balance line's time: the rollout's prefill / decode / swap, the learner's publish."""
    if name == "rollout" and plan.rollout is not None:
        r = plan.rollout
        return f"  (prefill {r.prefill:.2f} + decode {r.decode:.2f} + swap {r.swap:.2f})"
    if name == "learning" and plan.swap is not None:
        return f"  (publish {plan.swap.publish_seconds:.2f})"
    return ""


def format_plan(plan: Plan) -> str:
    """The plan as a table, one row per stage, per chip; then the pipeline's balance."""
    chip = plan.topology.chip
    lines = [
        f"topology {plan.topology.name}: {len(plan.topology.devices)} × {chip.name} "
        f"({chip.hbm_bytes / GIB:.2f} GiB, {chip.peak_flops / 1e12:.0f} TFLOP/s, "
        f"{chip.hbm_bytes_per_s / 1e9:.0f} GB/s), compiled by {plan.topology.compiler}",
        f"shapes: {plan.shapes.prompt_tokens} prompt + {plan.shapes.response_tokens} response tokens"
        + (f", {plan.shapes.layers} layers (reduced)" if plan.shapes.layers else ""),
        *(f"{name}: {source}" for name, source in plan.sources.items()),
        *plan.notes,
        "",
        "per chip and call; TFLOP: matmul FLOPs counted from the program (model: without",
        "recomputation; run: as configured; /book: model over 2 (6 with a backward pass) ·",
        "weights · tokens + attention; XLA: the compiler's own count, which takes a loop's body once)",
        "",
        f"{'stage':<16}{'chips':>6}{'rows':>6}{'args GiB':>10}{'temp GiB':>10}{'peak GiB':>10}{'of HBM':>8}"
        f"{'model':>8}{'run':>8}{'/book':>7}{'XLA':>8}{'roofline s':>12}{'MFU':>6}",
    ]
    for s in plan.stages:
        if s.error:
            lines.append(f"{s.stage:<16}{s.devices:>6}{s.rows:>6}  does not compile: {s.error}")
            continue
        book = f"{s.model_flops / s.textbook_flops:.2f}" if s.textbook_flops else "-"
        lines.append(
            f"{s.stage:<16}{s.devices:>6}{s.rows:>6}{s.argument_bytes / GIB:>10.2f}{s.temp_bytes / GIB:>10.2f}"
            f"{s.peak_bytes / GIB:>10.2f}{s.peak_bytes / chip.hbm_bytes:>8.0%}{s.model_flops / 1e12:>8.1f}"
            f"{s.executed_flops / 1e12:>8.1f}{book:>7}{s.flops / 1e12:>8.1f}{s.roofline_seconds(chip):>12.3f}"
            f"{s.mfu(chip):>6.0%}"
        )
    for s in plan.stages:
        if s.interconnect_bytes and not s.error:
            routed = s.interconnect_bytes < s.interconnect_worst_bytes
            lines.append(
                f"{s.stage}: the experts' all-to-alls send {s.interconnect_bytes / 1e9:.1f} GB per chip and call, "
                f"{s.interconnect_bytes / chip.copy_bytes_per_s:.3f} s over its links (in its roofline), "
                + (
                    f"at uniform routing (routed rows only); {s.interconnect_worst_bytes / 1e9:.1f} GB, "
                    f"{s.interconnect_worst_bytes / chip.copy_bytes_per_s:.3f} s, where one chip holds every "
                    "token's experts"
                    if routed
                    else "whatever the routing (padded chunks)"
                )
            )
    times = [t for t in plan.balance.values() if t == t]  # the stages that compile
    if times:
        slowest = max(times)
        lines += ["", *balance_header(plan)]
        for name, seconds in plan.balance.items():
            if seconds != seconds:
                lines.append(f"  {name:<10}  (does not compile)")
            else:
                lines.append(f"  {name:<10}{seconds:>9.2f} s  busy {seconds / slowest:>4.0%}{stage_detail(plan, name)}")
    return "\n".join(lines)


def format_balanced(found: Balanced) -> str:
    """The search's outcome: the best candidates, the chosen split's balance and overrides,
    then its full plan."""
    best = found.candidates[:8]
    lines = [
        f"--balance: {len(found.candidates)} splits fit (learner / sampler / teacher chips, sampler slots and pages);",
        "each stage's seconds per rollout batch at the roofline (asyncopd_jax/scale/search.py), best first:",
        "",
        f"{'learner':>8}{'sampler':>8}{'teacher':>8}{'slots':>7}{'pages':>8}{'learning':>10}{'rollout':>9}"
        f"{'scoring':>9}{'samples/s':>11}  weights",
    ]
    for c in best:
        s = c.split
        scoring = f"{c.scoring:>9.3f}" if c.scoring is not None else f"{'-':>9}"
        lines.append(
            f"{s.learner:>8}{s.rollout:>8}{s.scoring or '-':>8}{s.slots:>7}{s.kv_pages:>8}{c.learning:>10.3f}"
            f"{c.rollout.total:>9.3f}{scoring}{c.samples_per_s:>11.2f}  {'storage' if s.processes else 'memory'}"
        )
    plan = found.plan
    busy = ", ".join(f"{name} {share:.0%}" for name, share in busy_fractions(plan).items())
    rate = found.chosen.batch / max(plan.balance.values())
    lines += [
        "",
        f"chosen: {found.chosen.split}; planned in full: {rate:.2f} samples/s at the roofline; busy: {busy}",
        *(f"  {note}" for note in found.notes),
        *(f"not fitting: {d}" for d in found.dropped),
        "as --set overrides:",
        *(f"  --set {s}" for s in found.overrides),
        "",
        "A split whose stages share the learner's host runs them as threads, the weights handed over in memory;",
        "one with a stage on another host (--chips-per-host) runs stage processes, each version through storage",
        "(--storage-gbps); the stages on other hosts are started there (launch/README.md).",
        "",
        "the chosen split, planned in full:",
        "",
        format_plan(found.plan),
    ]
    return "\n".join(lines)
