"""``asyncopd plan --balance``: the split of a topology's chips among the learner, the
sampler and the teacher that samples fastest at the roofline, weight swaps included.

The candidates hold one sampler and one teacher and give each stage a power of two of
chips, ``L + R + C ≤ N``, by consecutive chip ids (learner, sampler, teacher):

* the learner on L chips, FSDP over them (``learner.mesh: {data: 1, fsdp: L}``; L divides
  the rows of an optimizer step);
* the sampler on R chips: the continuous engine, its heads split over as many of them as its
  key-value heads allow and its slots over the rest (``stages.rollout_mesh``); S slots, the
  most (a power of two, at most one batch's prompts) whose weights (as received and as
  computed in) and paged KV cache fit :data:`SAMPLER_FIT` of a chip, the pool sized for
  every slot's prompt and expected answer (at most its longest);
* the teacher on C chips, split as the sampler is, or a mixture of experts' experts over
  fsdp (expert parallelism; ``stages.scoring_mesh``: :func:`scoring_mesh_split`).

With every chip on one host (the default) the stages are threads of the learner's process
and each version is handed over in memory. Given ``chips_per_host``, a stage keeps to one
host, and a split with a stage off the learner's host runs stage processes
(``stages.placement: processes``): each version then goes through storage.

The learner and the teacher are compiled at every chip count tried (their figures depend on
their own chips only: each count is compiled once), and a count whose peak passes
:data:`FIT` of a chip's HBM is dropped. The sampler's times are the roofline's arithmetic
(:mod:`asyncopd_jax.scale.balance`) and its memory the bytes its shardings place, leaving
``FIT − SAMPLER_FIT`` for its temporaries. The best split (most samples/s; then the fewest
chips) is planned in full (:func:`~asyncopd_jax.scale.plan.make_plan`, which compiles the
sampler too); if a stage of that plan does not fit after all, the next best is.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from asyncopd_jax.config import RunConfig, with_overrides
from asyncopd_jax.models.config import DecoderConfig
from asyncopd_jax.models.decoder import abstract_decoder
from asyncopd_jax.pipeline.placement import SnapshotChannel
from asyncopd_jax.scale.balance import Answers, DecodeBytes, RolloutCost, rollout_seconds
from asyncopd_jax.scale.chips import Chip, Topology
from asyncopd_jax.scale.plan import (
    Models,
    Plan,
    Shapes,
    StageFigures,
    compile_learner_step,
    compile_teacher_scoring,
    decode_bytes,
    format_plan,
    learner_state_bytes,
    make_plan,
    read_models,
    sampler_weights,
    sampler_work,
    teacher_weight_bytes,
)
from asyncopd_jax.scale.swaps import DEFAULT_STORAGE_BYTES_PER_S, bytes_per_device, swap_figures

FIT = 0.9  # of a chip's HBM a stage's peak may reach: the rest is the runtime's and fragmentation's
SAMPLER_FIT = 0.75  # of a chip's HBM the sampler's weights and KV cache may take, before its temporaries


def hosts_of(devices: Sequence, first: int, n: int, chips_per_host: int) -> set[int]:
    """The hosts the chips of ids ``first … first + n − 1`` lie on: their places in
    ``devices`` (a topology's order, host after host) over ``chips_per_host``."""
    place = {d.id: i for i, d in enumerate(devices)}
    return {place[first + k] // chips_per_host for k in range(n)}


def powers_of_two(limit: int) -> list[int]:
    """1, 2, 4, … up to ``limit``."""
    return [2**i for i in range(int(math.log2(limit)) + 1)] if limit >= 1 else []


def mesh_split(chips: int, kv_heads: int) -> tuple[int, int]:
    """``(data, tensor)`` for a stage on ``chips`` chips: heads split over the most chips
    dividing both counts (each chip then holds whole key-value heads), rows over the rest."""
    tensor = math.gcd(chips, kv_heads)
    return chips // tensor, tensor


def scoring_mesh_split(chips: int, teachers: Sequence[DecoderConfig]) -> tuple[int, int, int]:
    """``(data, fsdp, tensor)`` for the teachers' stage on ``chips`` chips. A mixture of
    experts splits its experts over fsdp (expert parallelism, models/moe.py: each chip holds
    whole experts, its tokens sent to them), over the most chips dividing every teacher's
    expert count, with no tensor axis; dense teachers alone split their heads over tensor
    (:func:`mesh_split`). Rows over the rest."""
    experts = [t.num_experts for t in teachers if t.num_experts]
    if experts:
        fsdp = math.gcd(chips, *experts)
        return chips // fsdp, fsdp, 1
    data, tensor = mesh_split(chips, min(t.num_key_value_heads for t in teachers))
    return data, 1, tensor


def scoring_mesh_line(chips: int, teachers: Sequence[DecoderConfig]) -> str:
    """The ``--set`` line of :func:`scoring_mesh_split`."""
    data, fsdp, tensor = scoring_mesh_split(chips, teachers)
    return f"stages.scoring_mesh={{data: {data}, fsdp: {fsdp}, tensor: {tensor}}}"


def by_id(devices: Sequence) -> list:
    """A topology's devices in the order of their ids. A stage takes chips of consecutive ids:
    libtpu's compiler refuses some other sets (4 chips of a v5e-16 with ids 0, 1, 4, 5 — the
    first four it lists — in a collective: "Unexpected device_id 4 in replica group")."""
    return sorted(devices, key=lambda d: d.id)


def positions(devices: Sequence, first: int, n: int) -> str:
    """``stages.<role>_devices`` for the chips of ids ``first … first + n − 1``: their places
    in ``devices`` (the order a run's device lists index), quoted (YAML reads a bare 0 as a number)."""
    place = {d.id: i for i, d in enumerate(devices)}
    chosen = [place[first + k] for k in range(n)]
    low, high = min(chosen), max(chosen)
    if sorted(chosen) == list(range(low, high + 1)):  # the same chips as a range: read as one
        return f"'{low}-{high}'" if high > low else f"'{low}'"
    return "'" + ",".join(map(str, chosen)) + "'"


def sampler_overrides(chips: int, slots: int, kv_pages: int, models: Models) -> list[str]:
    """The sampler's ``--set`` lines: its mesh over ``chips``, the continuous engine's slots and pages."""
    data, tensor = mesh_split(chips, models.student.num_key_value_heads)
    return [
        f"stages.rollout_mesh={{data: {data}, tensor: {tensor}}}",
        "sampling.engine=continuous",
        f"sampling.slots={slots}",
        f"sampling.kv_pages={kv_pages}",
    ]


@dataclasses.dataclass(frozen=True)
class Split:
    """Chips per stage (consecutive: learner, sampler, teacher) and the sampler's slots and pages."""

    learner: int
    rollout: int
    scoring: int  # 0: no teacher on these chips (served, or none needed)
    slots: int
    kv_pages: int
    processes: bool = False  # a stage off the learner's host: stage processes, weights through storage

    @property
    def chips(self) -> int:
        return self.learner + self.rollout + self.scoring

    def overrides(self, models: Models, devices: Sequence) -> list[str]:
        """The ``--set`` lines that place a config so on ``devices`` (a topology's, in its order)."""
        if self.processes:  # stage processes: the weights go through the snapshot store
            placement = ["stages.placement=processes", *(["stages.scoring_processes=1"] if self.scoring else [])]
        else:
            placement = ["stages.placement=threads", "stages.snapshot_in_memory=true"]
        sets = [
            *placement,
            "stages.rollouts=1",
            f"stages.learner_devices={positions(devices, 0, self.learner)}",
            f"learner.mesh={{data: 1, fsdp: {self.learner}}}",
            f"stages.rollout_devices={positions(devices, self.learner, self.rollout)}",
            *sampler_overrides(self.rollout, self.slots, self.kv_pages, models),
        ]
        if self.scoring:
            sets += [
                f"stages.scoring_devices={positions(devices, self.learner + self.rollout, self.scoring)}",
                scoring_mesh_line(self.scoring, [t for _, t, _ in models.teachers]),
            ]
        return sets


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One split's balance: each stage's seconds per rollout batch at the roofline."""

    split: Split
    learning: float
    rollout: RolloutCost
    scoring: float | None  # None: no teacher on these chips
    batch: int

    @property
    def times(self) -> dict[str, float]:
        times = {"rollout": self.rollout.total, "learning": self.learning}
        if self.scoring is not None:
            times["scoring"] = self.scoring
        return times

    @property
    def samples_per_s(self) -> float:
        return self.batch / max(self.times.values())


@dataclasses.dataclass(frozen=True)
class SamplerFit:
    slots: int
    kv_pages: int
    chip_bytes: float  # weights as received and as computed in + the pool, per chip


def sampler_fit(
    cfg: RunConfig, models: Models, devices: list, shapes: Shapes, answers: Answers, chip: Chip
) -> SamplerFit | None:
    """The most slots for a sampler on ``devices`` (module docstring), or None when not even
    one fits."""
    r_data, _ = mesh_split(len(devices), models.student.num_key_value_heads)
    base = with_overrides(cfg, ["stages.rollouts=1", *sampler_overrides(len(devices), r_data, 0, models)])
    page = cfg.sampling.page_size
    received = bytes_per_device(sampler_weights(base, models.student, devices, models.vocab_limit))
    held = decode_bytes(base, models.student, devices, shapes, models.vocab_limit)  # per chip: not the slots' count
    longest = -(-(answers.prompt + answers.limit) // page)
    for slots in reversed(powers_of_two(cfg.learner.batch_size)):
        if slots % r_data:
            continue
        pages = min(-(-slots * int(math.ceil(answers.prompt + answers.mean)) // page), slots * longest)
        pages = max(pages, longest)
        chip_bytes = received + held.weights + (pages + 1) * page * held.kv_per_token
        if chip_bytes <= SAMPLER_FIT * chip.hbm_bytes:
            return SamplerFit(slots, pages, chip_bytes)
    return None


@dataclasses.dataclass(frozen=True)
class SamplerFigures:
    """A sampler's figures on one count of chips, found once and tried in every split."""

    fit: SamplerFit
    config: RunConfig  # the run's config with the sampler's mesh, slots and pages
    received: Any  # the weights as the sampler receives them: a pytree of ShapeDtypeStruct
    prefill: float  # seconds: a whole set of slots' prompts at the roofline
    recompute: float  # seconds: S whole sequences' recompute at the roofline
    held: DecodeBytes  # what one decode step reads per chip


@dataclasses.dataclass(frozen=True)
class Balanced:
    """What ``--balance`` found: the candidates that fit (best first), the chosen one's
    overrides and full plan, the chip counts dropped, and why a stage stays under half busy."""

    candidates: list[Candidate]
    chosen: Candidate
    overrides: list[str]
    plan: Plan
    dropped: list[str]
    notes: list[str]


def balance_split(
    cfg: RunConfig,
    topology: Topology,
    shapes: Shapes,
    mean_response_tokens: float | None = None,
    storage_bytes_per_s: float = DEFAULT_STORAGE_BYTES_PER_S,
    progress: Callable[[str], None] = lambda line: None,
    chips_per_host: int | None = None,
) -> Balanced:
    """Search the splits of ``topology`` for ``cfg`` (module docstring); ``progress`` hears of
    each compile as it ends (a search at real sizes takes minutes). ``chips_per_host``: the
    chips one host holds (None: all of them); a stage keeps to one host, and a split with a
    stage off the learner's host runs stage processes, its weights through storage."""
    if cfg.schedule.mode == "fixed_lag":
        raise ValueError("--balance: a fixed_lag schedule samples in the learner's own thread; there is no split")
    chip, n = topology.chip, len(topology.devices)
    if chips_per_host is not None and (chips_per_host < 1 or n % chips_per_host):
        raise ValueError(
            f"--chips-per-host {chips_per_host} is invalid; expected a divisor of {topology.name}'s {n} chips"
        )
    models = read_models(cfg, shapes)
    teachers = models.teachers if cfg.needs_teacher_scores else []
    devices = by_id(topology.devices)  # each stage is tried on the chips of ids 0 … n - 1
    answers = Answers(shapes.prompt_tokens, shapes.response_tokens, mean_response_tokens or shapes.response_tokens)
    rows = cfg.learner.batch_size // cfg.learner.mini_batches
    stages_needed = 3 if teachers else 2
    most = n - (stages_needed - 1)  # the others need a chip each
    dropped: list[str] = []

    def too_big(stage: str, count: int, held: float) -> bool:
        """Whether the inputs alone pass FIT of a chip (then nothing is compiled)."""
        if held <= FIT * chip.hbm_bytes:
            return False
        dropped.append(f"{stage} on {count} chips: its inputs alone are {held / chip.hbm_bytes:.0%} of HBM")
        progress(dropped[-1])
        return True

    def fits(f: StageFigures) -> bool:
        peak = f"peak {f.peak_bytes / chip.hbm_bytes:.0%} of HBM"
        progress(f"{f.stage} on {f.devices} chips: {f.error or f'{peak}, {f.roofline_seconds(chip):.3f} s'}")
        if f.error or f.peak_bytes > FIT * chip.hbm_bytes:
            dropped.append(f"{f.stage} on {f.devices} chips: {f.error or peak}")
            return False
        return True

    learners: dict[int, float] = {}
    for count in powers_of_two(most):
        if rows % count:
            continue
        sets = [
            f"learner.mesh={{data: 1, fsdp: {count}}}",
            f"stages.learner_devices={positions(topology.devices, 0, count)}",
        ]
        trial = with_overrides(cfg, sets)
        if too_big(
            "learner step", count, learner_state_bytes(trial, models.student, devices[:count], models.vocab_limit)
        ):
            continue
        f = compile_learner_step(trial, models.student, devices[:count], shapes, models.vocab_limit)
        if fits(f):
            learners[count] = cfg.learner.mini_batches * f.roofline_seconds(chip)

    scorers: dict[int, float] = {}
    if teachers:
        shares = models.scoring_shares(cfg)
        configs = [t for _, t, _ in teachers]
        for count in powers_of_two(most):
            data, fsdp, _ = scoring_mesh_split(count, configs)
            if cfg.learner.batch_size % (data * fsdp):
                continue
            trial = with_overrides(cfg, [scoring_mesh_line(count, configs), "stages.rollouts=1"])
            seconds = 0.0
            weights = sum(teacher_weight_bytes(trial, *t[:2], devices[:count], models.vocab_limit) for t in teachers)
            if too_big("teacher scoring", count, weights):
                continue
            for source, teacher, stage in teachers:
                f = compile_teacher_scoring(
                    trial, teacher, devices[:count], shapes, cfg.learner.batch_size, models.vocab_limit, source, stage
                )
                if not fits(f):
                    seconds = float("nan")
                    break
                seconds += shares[source.name] * f.roofline_seconds(chip)
            if seconds == seconds:
                scorers[count] = seconds

    head = dataclasses.replace(models.student, vocab_size=models.vocab_limit or models.student.vocab_size)
    _, published = abstract_decoder(models.student, cfg.student.dtype, models.vocab_limit)
    samplers: dict[int, SamplerFigures] = {}
    for count in powers_of_two(most):
        sampler_devices = devices[:count]
        fit = sampler_fit(cfg, models, sampler_devices, shapes, answers, chip)
        if fit is None:
            dropped.append(f"sampler on {count} chips: not one slot's weights and cache fit {SAMPLER_FIT:.0%} of HBM")
            continue
        trial = with_overrides(cfg, ["stages.rollouts=1", *sampler_overrides(count, fit.slots, fit.kv_pages, models)])
        received = sampler_weights(trial, models.student, sampler_devices, models.vocab_limit)
        # a whole set of slots' prompts, and the recompute of S whole sequences: compute-bound
        # calls, whose roofline is their textbook FLOPs
        work = sampler_work(head, fit.slots, shapes)
        prefill, recompute = (work[name] / (count * chip.peak_flops) for name in ("prefill", "recompute"))
        held = decode_bytes(trial, models.student, sampler_devices, shapes, models.vocab_limit)
        samplers[count] = SamplerFigures(fit, trial, received, prefill, recompute, held)

    channels = {
        False: SnapshotChannel(in_memory=True, directory="", format="", keep=0, temporary=False),
        True: SnapshotChannel(in_memory=False, directory="", format="safetensors", keep=0, temporary=False),
    }
    host_size = chips_per_host or n
    candidates = []
    for l_chips, seconds in learners.items():
        for r_chips, sampler in samplers.items():
            for c_chips in scorers if teachers else [0]:
                spans = [(0, l_chips), (l_chips, r_chips), (l_chips + r_chips, c_chips)]
                if sum(c for _, c in spans) > n:
                    continue
                hosts = [hosts_of(topology.devices, first, c, host_size) for first, c in spans if c]
                if any(len(h) > 1 for h in hosts):
                    continue  # a stage over two hosts: one process per host holds a stage
                processes = any(h != {0} for h in hosts)
                swap = swap_figures(
                    channels[processes],
                    published,
                    sampler.received,
                    learner_chips=l_chips,
                    samplers=1,
                    chip=chip,
                    storage_bytes_per_s=storage_bytes_per_s,
                )
                cost = rollout_seconds(
                    sampler.config,
                    head,
                    answers,
                    samplers=1,
                    rows=sampler.fit.slots,
                    chips=r_chips,
                    prefill=sampler.prefill,
                    decode=0.0,
                    recompute=sampler.recompute,
                    held=sampler.held,
                    swap=swap,
                    chip=chip,
                )
                split = Split(l_chips, r_chips, c_chips, sampler.fit.slots, sampler.fit.kv_pages, processes)
                scoring = scorers[c_chips] if teachers else None
                candidates.append(
                    Candidate(split, seconds + swap.publish_seconds, cost, scoring, cfg.learner.batch_size)
                )
    if not candidates:
        raise ValueError(
            f"--balance: no split of {topology.name} fits every stage ({'; '.join(dropped) or 'none tried'})"
        )
    candidates.sort(key=lambda c: (-c.samples_per_s, c.split.chips))
    for candidate in candidates:
        progress(f"planning {candidate.split} in full")
        sets = candidate.split.overrides(models, topology.devices)
        plan = make_plan(with_overrides(cfg, sets), topology, shapes, mean_response_tokens, storage_bytes_per_s)
        failed = [s for s in plan.stages if s.error or s.peak_bytes > FIT * chip.hbm_bytes]
        if not failed:
            return Balanced(
                candidates,
                candidate,
                sets,
                plan,
                dropped,
                idle_reasons(candidate.split, plan, learners, scorers, samplers),
            )
        dropped += [
            f"{s.stage} of split {candidate.split}: {s.error or f'peak {s.peak_bytes / chip.hbm_bytes:.0%} of HBM'}"
            for s in failed
        ]
    raise ValueError(f"--balance: no split of {topology.name} fits when planned in full ({'; '.join(dropped)})")


def busy_fractions(plan: Plan) -> dict[str, float]:
    """Each stage's time per batch over the slowest's, in ``plan``'s balance."""
    slowest = max(plan.balance.values())
    return {name: seconds / slowest for name, seconds in plan.balance.items()}


def idle_reasons(split: Split, plan: Plan, learners: dict, scorers: dict, samplers: dict) -> list[str]:
    """Why a stage of the chosen split is under half busy in its full plan: it holds the
    fewest chips it fits on, or giving it fewer samples slower (the search says so)."""
    notes = []
    counts = {
        "learning": (split.learner, learners),
        "scoring": (split.scoring, scorers),
        "rollout": (split.rollout, samplers),
    }
    for name, share in busy_fractions(plan).items():
        if share >= 0.5:
            continue
        chips, fitting = counts[name]
        fewest = min(fitting)
        if chips == fewest:
            why = "the fewest it fits on: no split gives it less"
        else:
            why = f"a split giving it {fewest} samples slower at the roofline (the table above)"
        notes.append(f"{name} is {share:.0%} busy on {chips} chip{'s' if chips > 1 else ''}, {why}")
    return notes


def format_balanced(found: Balanced) -> str:
    """The search's outcome: the best candidates, the chosen split's balance and overrides,
    then its full plan."""
    best = found.candidates[:8]
    lines = [
        f"--balance: {len(found.candidates)} splits fit (learner / sampler / teacher chips, sampler slots and pages);",
        "each stage's seconds per rollout batch at the roofline (asyncopd_jax/scale/split.py), best first:",
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
