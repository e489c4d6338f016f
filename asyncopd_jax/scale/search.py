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

Each trial is the run's config with its stage's fields replaced (:func:`replaced`, checked
as a whole as ``--set`` overrides are); the chosen split's ``--set`` lines are written from
its config (:meth:`Split.overrides`), for the run's command line.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

from asyncopd_jax.config import MeshConfig, RunConfig, TeacherSource
from asyncopd_jax.models.config import DecoderConfig
from asyncopd_jax.pipeline.layout import SnapshotChannel
from asyncopd_jax.sampling import Engine, SamplingParams
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
    learner_state_bytes,
    make_plan,
    read_models,
    rollout_engine,
    sampler_work,
    teacher_weight_bytes,
)
from asyncopd_jax.scale.student_shapes import (
    published_student,
    received_weights,
    resident_bytes,
    sampler_weights,
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


def by_id(devices: Sequence) -> list:
    """A topology's devices in the order of their ids. A stage takes chips of consecutive ids:
    libtpu's compiler refuses some other sets (4 chips of a v5e-16 with ids 0, 1, 4, 5 — the
    first four it lists — in a collective: "Unexpected device_id 4 in replica group")."""
    return sorted(devices, key=lambda d: d.id)


def places(devices: Sequence, first: int, n: int) -> str:
    """``stages.<role>_devices`` for the chips of ids ``first … first + n − 1``: their places
    in ``devices`` (the order a run's device lists index)."""
    place = {d.id: i for i, d in enumerate(devices)}
    chosen = [place[first + k] for k in range(n)]
    low, high = min(chosen), max(chosen)
    if sorted(chosen) == list(range(low, high + 1)):  # the same chips as a range: read as one
        return f"{low}-{high}" if high > low else f"{low}"
    return ",".join(map(str, chosen))


# --- the configs tried --------------------------------------------------------------------


def replaced(
    cfg: RunConfig, *, learner_mesh: MeshConfig | None = None, sampling: SamplingParams | None = None, **stages: Any
) -> RunConfig:
    """``cfg`` with ``learner.mesh``, ``sampling`` and the ``stages`` fields named replaced,
    checked once as a whole (as ``--set`` overrides are)."""
    learner = cfg.learner if learner_mesh is None else dataclasses.replace(cfg.learner, mesh=learner_mesh)
    return dataclasses.replace(
        cfg,
        learner=learner,
        sampling=cfg.sampling if sampling is None else sampling,
        stages=dataclasses.replace(cfg.stages, **stages),
    )


def rollout_mesh(chips: int, models: Models) -> MeshConfig:
    """``stages.rollout_mesh`` of a sampler on ``chips`` chips (:func:`mesh_split`)."""
    data, tensor = mesh_split(chips, models.student.num_key_value_heads)
    return MeshConfig(data=data, tensor=tensor)


def scoring_mesh(chips: int, teachers: Sequence[DecoderConfig]) -> MeshConfig:
    """``stages.scoring_mesh`` of the teachers' stage on ``chips`` chips (:func:`scoring_mesh_split`)."""
    data, fsdp, tensor = scoring_mesh_split(chips, teachers)
    return MeshConfig(data=data, fsdp=fsdp, tensor=tensor)


def sampler_config(
    cfg: RunConfig,
    chips: int,
    slots: int,
    kv_pages: int,
    models: Models,
    learner_mesh: MeshConfig | None = None,
    **stages: Any,
) -> RunConfig:
    """``cfg`` with one sampler on ``chips`` chips: its mesh, the continuous engine's slots and
    pages; and ``learner_mesh`` and the ``stages`` fields named, as :func:`replaced` takes them."""
    sampling = dataclasses.replace(cfg.sampling, engine="continuous", slots=slots, kv_pages=kv_pages)
    mesh = rollout_mesh(chips, models)
    return replaced(cfg, learner_mesh=learner_mesh, sampling=sampling, rollouts=1, rollout_mesh=mesh, **stages)


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

    def placed(self, cfg: RunConfig, models: Models, devices: Sequence) -> RunConfig:
        """``cfg`` placed so on ``devices`` (a topology's, in its order)."""
        if self.processes:  # stage processes: the weights go through the snapshot store
            stages: dict[str, Any] = {"placement": "processes", **({"scoring_processes": 1} if self.scoring else {})}
        else:
            stages = {"placement": "threads", "snapshot_in_memory": True}
        stages["learner_devices"] = places(devices, 0, self.learner)
        stages["rollout_devices"] = places(devices, self.learner, self.rollout)
        if self.scoring:
            stages["scoring_devices"] = places(devices, self.learner + self.rollout, self.scoring)
            stages["scoring_mesh"] = scoring_mesh(self.scoring, [t for _, t, _ in models.teachers])
        learner_mesh = MeshConfig(data=1, fsdp=self.learner)
        return sampler_config(cfg, self.rollout, self.slots, self.kv_pages, models, learner_mesh, **stages)

    def overrides(self, placed: RunConfig) -> list[str]:
        """The ``--set`` lines that give a run's config what :meth:`placed` gave ``placed``,
        read from it: the lines print the config the search planned."""
        stages, learner, sampling = placed.stages, placed.learner.mesh, placed.sampling
        rollout, scoring = stages.rollout_mesh, stages.scoring_mesh
        sets = [f"stages.placement={stages.placement}"]
        if not self.processes:
            sets.append(f"stages.snapshot_in_memory={str(stages.snapshot_in_memory).lower()}")
        elif self.scoring:
            sets.append(f"stages.scoring_processes={stages.scoring_processes}")
        sets += [
            f"stages.rollouts={stages.rollouts}",
            f"stages.learner_devices='{stages.learner_devices}'",  # quoted: YAML reads a bare 0 as a number
            f"learner.mesh={{data: {learner.data}, fsdp: {learner.fsdp}}}",
            f"stages.rollout_devices='{stages.rollout_devices}'",
            f"stages.rollout_mesh={{data: {rollout.data}, tensor: {rollout.tensor}}}",
            f"sampling.engine={sampling.engine}",
            f"sampling.slots={sampling.slots}",
            f"sampling.kv_pages={sampling.kv_pages}",
        ]
        if self.scoring:
            sets += [
                f"stages.scoring_devices='{stages.scoring_devices}'",
                f"stages.scoring_mesh={{data: {scoring.data}, fsdp: {scoring.fsdp}, tensor: {scoring.tensor}}}",
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


def sampler_bytes(cfg: RunConfig, models: Models, devices: list, shapes: Shapes) -> DecodeBytes:
    """What a decode step of the sampler ``cfg`` places on ``devices`` reads per chip
    (:func:`~asyncopd_jax.scale.plan.decode_bytes`): the continuous engine models its steps from it."""
    held = decode_bytes(cfg, models.student, devices, shapes, models.vocab_limit)
    if held is None:
        raise ValueError(f"--balance samples with the continuous engine, not sampling.engine {cfg.sampling.engine}")
    return held


def sampler_fit(
    cfg: RunConfig, models: Models, devices: list, shapes: Shapes, answers: Answers, chip: Chip
) -> SamplerFit | None:
    """The most slots for a sampler on ``devices`` (module docstring), or None when not even
    one fits."""
    r_data, _ = mesh_split(len(devices), models.student.num_key_value_heads)
    base = sampler_config(cfg, len(devices), r_data, 0, models)
    page = cfg.sampling.page_size
    # the weights it decodes with, and what it keeps beside them to merge a LoRA student's versions
    received = bytes_per_device(sampler_weights(base, models.student, devices, models.vocab_limit))
    received += resident_bytes(base, models.student, devices, models.vocab_limit)
    held = sampler_bytes(base, models, devices, shapes)  # per chip: not the slots' count
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
    engine: Engine  # its engine, whose cost model the balance asks
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


# --- the search -----------------------------------------------------------------------------


@dataclasses.dataclass
class Search:
    """What every stage's trials share: the run's config, models, shapes and answers, the
    topology, and the chip counts dropped so far (``progress`` hears of each compile)."""

    cfg: RunConfig
    topology: Topology
    shapes: Shapes
    answers: Answers
    models: Models
    progress: Callable[[str], None]
    dropped: list[str] = dataclasses.field(default_factory=list)

    @property
    def chip(self) -> Chip:
        return self.topology.chip

    @functools.cached_property
    def devices(self) -> list:
        """The topology's chips by id: each stage is tried on the chips of ids 0 … n − 1."""
        return by_id(self.topology.devices)

    @property
    def teachers(self) -> list[tuple[TeacherSource, DecoderConfig, str]]:
        """The teachers scored on these chips (none where the run needs no teacher scores)."""
        return self.models.teachers if self.cfg.needs_teacher_scores else []

    @property
    def counts(self) -> list[int]:
        """The chip counts a stage is tried on: the others need a chip each."""
        return powers_of_two(len(self.topology.devices) - (2 if self.teachers else 1))

    @property
    def head(self) -> DecoderConfig:
        """The student at the vocabulary it samples."""
        student = self.models.student
        return dataclasses.replace(student, vocab_size=self.models.vocab_limit or student.vocab_size)

    def too_big(self, stage: str, count: int, held: float) -> bool:
        """Whether the inputs alone pass FIT of a chip (then nothing is compiled)."""
        if held <= FIT * self.chip.hbm_bytes:
            return False
        self.dropped.append(f"{stage} on {count} chips: its inputs alone are {held / self.chip.hbm_bytes:.0%} of HBM")
        self.progress(self.dropped[-1])
        return True

    def fits(self, f: StageFigures) -> bool:
        """Whether a stage compiled and its peak is within FIT of a chip."""
        peak = f"peak {f.peak_bytes / self.chip.hbm_bytes:.0%} of HBM"
        self.progress(f"{f.stage} on {f.devices} chips: {f.error or f'{peak}, {f.roofline_seconds(self.chip):.3f} s'}")
        if f.error or f.peak_bytes > FIT * self.chip.hbm_bytes:
            self.dropped.append(f"{f.stage} on {f.devices} chips: {f.error or peak}")
            return False
        return True


def learner_times(search: Search) -> dict[int, float]:
    """The learner's seconds per batch by the chip counts it fits on: FSDP over L chips,
    L dividing an optimizer step's rows, its step compiled at each count."""
    cfg, models = search.cfg, search.models
    rows = cfg.learner.batch_size // cfg.learner.mini_batches
    times: dict[int, float] = {}
    for count in search.counts:
        if rows % count:
            continue
        devices = search.devices[:count]
        mesh = MeshConfig(data=1, fsdp=count)
        trial = replaced(cfg, learner_mesh=mesh, learner_devices=places(search.topology.devices, 0, count))
        held = learner_state_bytes(trial, models.student, devices, models.vocab_limit)
        if search.too_big("learner step", count, held):
            continue
        f = compile_learner_step(trial, models.student, devices, search.shapes, models.vocab_limit)
        if search.fits(f):
            times[count] = cfg.learner.mini_batches * f.roofline_seconds(search.chip)
    return times


def scoring_times(search: Search) -> dict[int, float]:
    """The teachers' seconds per batch by the chip counts they fit on, each its share of the
    rows (:func:`scoring_mesh_split`, the rows over data and fsdp dividing the batch); {}
    with no teacher on these chips."""
    cfg, models, teachers = search.cfg, search.models, search.teachers
    configs = [t for _, t, _ in teachers]
    shares = models.scoring_shares(cfg) if teachers else {}
    times: dict[int, float] = {}
    for count in search.counts if teachers else []:
        data, fsdp, _ = scoring_mesh_split(count, configs)
        if cfg.learner.batch_size % (data * fsdp):
            continue
        devices = search.devices[:count]
        trial = replaced(cfg, scoring_mesh=scoring_mesh(count, configs), rollouts=1)
        weights = sum(teacher_weight_bytes(trial, *t[:2], devices, models.vocab_limit) for t in teachers)
        if search.too_big("teacher scoring", count, weights):
            continue
        seconds = 0.0
        for source, teacher, stage in teachers:
            f = compile_teacher_scoring(
                trial, teacher, devices, search.shapes, cfg.learner.batch_size, models.vocab_limit, source, stage
            )
            if not search.fits(f):
                break
            seconds += shares[source.name] * f.roofline_seconds(search.chip)
        else:
            times[count] = seconds
    return times


def sampler_figures(search: Search) -> dict[int, SamplerFigures]:
    """The sampler's figures by the chip counts it fits on (the most slots: :func:`sampler_fit`);
    its calls' seconds are the roofline's arithmetic, nothing compiled."""
    cfg, models, shapes, chip = search.cfg, search.models, search.shapes, search.chip
    samplers: dict[int, SamplerFigures] = {}
    for count in search.counts:
        devices = search.devices[:count]
        fit = sampler_fit(cfg, models, devices, shapes, search.answers, chip)
        if fit is None:
            search.dropped.append(
                f"sampler on {count} chips: not one slot's weights and cache fit {SAMPLER_FIT:.0%} of HBM"
            )
            continue
        trial = sampler_config(cfg, count, fit.slots, fit.kv_pages, models)
        received = received_weights(trial, models.student, devices, models.vocab_limit)
        # a whole set of slots' prompts, and the recompute of S whole sequences: compute-bound
        # calls, whose roofline is their textbook FLOPs
        work = sampler_work(search.head, fit.slots, shapes)
        prefill, recompute = (work[name] / (count * chip.peak_flops) for name in ("prefill", "recompute"))
        held = sampler_bytes(trial, models, devices, shapes)
        engine = rollout_engine(trial, models.student, shapes)
        samplers[count] = SamplerFigures(fit, trial, engine, received, prefill, recompute, held)
    return samplers


def splits(
    search: Search,
    learners: dict[int, float],
    scorers: dict[int, float],
    samplers: dict[int, SamplerFigures],
    chips_per_host: int,
    storage_bytes_per_s: float,
) -> list[Candidate]:
    """Every split of the chip counts found that the topology holds, no stage over two hosts,
    and its balance: a stage off the learner's host makes stage processes, whose weights
    go through storage (module docstring)."""
    cfg, chip, devices = search.cfg, search.chip, search.topology.devices
    channels = {
        False: SnapshotChannel(in_memory=True, directory="", format="", keep=0, temporary=False),
        True: SnapshotChannel(in_memory=False, directory="", format="safetensors", keep=0, temporary=False),
    }
    _, published = published_student(cfg, search.models.student, search.models.vocab_limit)
    found = []
    for l_chips, seconds in learners.items():
        for r_chips, sampler in samplers.items():
            for c_chips in scorers if search.teachers else [0]:
                spans = [(0, l_chips), (l_chips, r_chips), (l_chips + r_chips, c_chips)]
                if sum(c for _, c in spans) > len(devices):
                    continue
                hosts = [hosts_of(devices, first, c, chips_per_host) for first, c in spans if c]
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
                    sampler.engine,
                    search.head,
                    search.answers,
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
                scoring = scorers[c_chips] if search.teachers else None
                found.append(Candidate(split, seconds + swap.publish_seconds, cost, scoring, cfg.learner.batch_size))
    return found


def ranked(candidates: list[Candidate]) -> list[Candidate]:
    """Best first: the most samples per second, then the fewest chips."""
    return sorted(candidates, key=lambda c: (-c.samples_per_s, c.split.chips))


def plan_best(
    search: Search, candidates: list[Candidate], mean_response_tokens: float | None, storage_bytes_per_s: float
) -> tuple[Candidate, RunConfig, Plan]:
    """The first of ``candidates`` whose every stage fits when planned in full
    (:func:`~asyncopd_jax.scale.plan.make_plan`), its config and its plan."""
    chip, topology = search.chip, search.topology
    for candidate in candidates:
        search.progress(f"planning {candidate.split} in full")
        placed = candidate.split.placed(search.cfg, search.models, topology.devices)
        plan = make_plan(placed, topology, search.shapes, mean_response_tokens, storage_bytes_per_s)
        failed = [s for s in plan.stages if s.error or s.peak_bytes > FIT * chip.hbm_bytes]
        if not failed:
            return candidate, placed, plan
        search.dropped += [
            f"{s.stage} of split {candidate.split}: {s.error or f'peak {s.peak_bytes / chip.hbm_bytes:.0%} of HBM'}"
            for s in failed
        ]
    raise ValueError(f"--balance: no split of {topology.name} fits when planned in full ({'; '.join(search.dropped)})")


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
    n = len(topology.devices)
    if chips_per_host is not None and (chips_per_host < 1 or n % chips_per_host):
        raise ValueError(
            f"--chips-per-host {chips_per_host} is invalid; expected a divisor of {topology.name}'s {n} chips"
        )
    models = read_models(cfg, shapes)
    answers = Answers(shapes.prompt_tokens, shapes.response_tokens, mean_response_tokens or shapes.response_tokens)
    search = Search(cfg, topology, shapes, answers, models, progress)
    learners, scorers, samplers = learner_times(search), scoring_times(search), sampler_figures(search)
    candidates = ranked(splits(search, learners, scorers, samplers, chips_per_host or n, storage_bytes_per_s))
    if not candidates:
        raise ValueError(
            f"--balance: no split of {topology.name} fits every stage ({'; '.join(search.dropped) or 'none tried'})"
        )
    chosen, placed, plan = plan_best(search, candidates, mean_response_tokens, storage_bytes_per_s)
    notes = idle_reasons(chosen.split, plan, learners, scorers, samplers)
    return Balanced(candidates, chosen, chosen.split.overrides(placed), plan, search.dropped, notes)


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
