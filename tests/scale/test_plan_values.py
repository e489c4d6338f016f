"""``asyncopd plan``'s arithmetic and wiring without compiling anything: a stage the compiler
refuses, the RL batch's advantages, the table a plan prints, and what ``make_plan`` hands
each stage's compile (the reduced depth, the vocabulary both models embed) and makes of
their figures.

Written for mutants of ``asyncopd_jax/scale/plan.py`` that survived the sampled mutation run
of 2026-11-26 (docs/log/mutation-history.md, "Sampled scores of the newer areas (2026-11-26)").
"""

from __future__ import annotations

import dataclasses
import json
import types

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from asyncopd_jax import configs
from asyncopd_jax.config import load_config
from asyncopd_jax.learner.optimizer import make_optimizer
from asyncopd_jax.learner.step import create_train_state
from asyncopd_jax.models.attention import resolve_implementation
from asyncopd_jax.models.decoder import Decoder, abstract_decoder
from asyncopd_jax.models.lora import add_adapters
from asyncopd_jax.pipeline.layout import SnapshotChannel
from asyncopd_jax.scale import plan as plan_module
from asyncopd_jax.scale.balance import Answers, RolloutCost
from asyncopd_jax.scale.chips import CHIPS, Topology, get_topology
from asyncopd_jax.scale.flops import transformer_flops
from asyncopd_jax.scale.learner_inputs import ARCHITECTURES, abstract_learner_batch, architecture
from asyncopd_jax.scale.plan import (
    Plan,
    Shapes,
    StageFigures,
    make_plan,
)
from asyncopd_jax.scale.report import format_plan
from asyncopd_jax.scale.student_shapes import received_weights, resident_bytes, sampler_weights, student_decoder
from asyncopd_jax.scale.swaps import SwapFigures, swap_figures


class _Refused:
    """A lowered program whose compile fails as XLA's does when it does not fit the chip."""

    def compile(self):
        raise RuntimeError("RESOURCE_EXHAUSTED: " + "x" * 400 + "\nthe allocator's details")


def test_a_stage_the_compiler_refuses_is_a_figure_with_the_first_line_of_its_error():
    """Bug guarded: the figures of a stage that does not compile built with an argument
    dropped (``StageFigures(stage, devices, tokens, …)``: a TypeError, or the rows taken for
    the tokens) or with another slice of the compiler's message."""
    figures = plan_module._figures("sampler decode", 4, 8, 16, _Refused())
    assert figures == StageFigures("sampler decode", 4, 8, 16, error=("RESOURCE_EXHAUSTED: " + "x" * 400)[:300])


def test_an_rl_batch_carries_the_advantages_a_distillation_batch_does_not():
    """Bug guarded: ``advantages`` left out of the abstract batch of an RL run, whose learner
    step reads them: the plan would compile another program than the run's."""
    rl = load_config(configs.RL, [])
    config, _ = architecture(rl.student)
    batch = abstract_learner_batch(rl, 4, Shapes(8, 28), abstract_decoder(config, rl.student.dtype))
    assert (batch.rollout.advantages.shape, batch.rollout.advantages.dtype) == ((4, 28), jnp.float32)
    assert batch.rollout.reference_logp is None
    demo = load_config(configs.DEMO, [])
    assert abstract_learner_batch(demo, 4, Shapes(8, 28)).rollout.advantages is None


def _timed(stage: str, rows: int, tokens: int, seconds: float) -> StageFigures:
    """A stage's figures whose roofline time on an H100 is ``seconds`` (its FLOPs)."""
    return StageFigures(stage, 4, rows, tokens, executed_flops=seconds * CHIPS["h100"].peak_flops)


@pytest.mark.parametrize("published,itemsize", [("auto", 4), ("bfloat16", 2)])
def test_make_plan_compiles_each_stage_at_the_reduced_depth_and_the_shared_vocabulary(
    tmp_path, monkeypatch, published, itemsize
):
    """Bug guarded: ``make_plan`` compiling the student at its full depth (``shapes.layers``
    not passed on), at the whole vocabulary when the teacher embeds fewer ids
    (``vocab_limit`` lost), or adding the stages' times up wrongly. The compiles are
    replaced by stand-ins that record their arguments and return known figures."""
    teacher = tmp_path / "Teacher-151000"
    teacher.mkdir()
    hf = json.loads((ARCHITECTURES / "Qwen3-8B" / "config.json").read_text())
    (teacher / "config.json").write_text(json.dumps({**hf, "vocab_size": 151000}))
    cfg = load_config(
        None,
        [
            "student.path=/models/Qwen3-1.7B",
            f"teacher.path={teacher}",
            "scoring.topk=16",
            "estimator.name=forward_kl_topk",
            "learner.batch_size=8",
            "learner.mini_batches=2",
            "stages.rollouts=2",
            f"stages.snapshot_dtype={published}",  # bf16: the version as the samplers receive it
        ],
    )
    seen = {}

    def learner(cfg, config, devices, shapes, vocab_limit=None):
        seen["learner"] = (config.num_hidden_layers, config.vocab_size, len(devices), vocab_limit)
        return _timed("learner step", 4, 512, 1.0)

    def sampler(cfg, config, devices, shapes, rows, vocab_limit=None):
        seen["sampler"] = (config.num_hidden_layers, config.vocab_size, rows, vocab_limit)
        return [
            _timed(f"sampler {n}", rows, rows, s) for n, s in (("prefill", 0.5), ("decode", 0.01), ("recompute", 9.0))
        ]

    def scoring(cfg, config, devices, shapes, rows, vocab_limit=None, source=None, stage="teacher scoring"):
        seen["scoring"] = (config.num_hidden_layers, config.vocab_size, rows, vocab_limit)
        return _timed(stage, rows, rows, 0.25)

    monkeypatch.setattr(plan_module, "compile_learner_step", learner)
    monkeypatch.setattr(plan_module, "compile_sampler", sampler)
    monkeypatch.setattr(plan_module, "compile_teacher_scoring", scoring)
    plan = make_plan(cfg, get_topology("h100-4"), Shapes(prompt_tokens=32, response_tokens=96, layers=1))
    # a group is the batch over the 2 rollout stages: 4 rows
    assert seen == {
        "learner": (1, 151936, 4, 151000),
        "sampler": (1, 151936, 4, 151000),
        "scoring": (1, 151000, 4, 151000),
    }
    assert [s.stage for s in plan.stages] == [
        "learner step",
        "sampler prefill",
        "sampler decode",
        "sampler recompute",
        "teacher scoring",
    ]
    assert plan.sources == {
        "student": str(ARCHITECTURES / "Qwen3-1.7B" / "config.json"),
        "teacher": str(teacher / "config.json"),
    }
    # rollout: ⌈8 / (4 rows × 2 stages)⌉ = 1 wave of prefill + 96 decode steps, then the
    # version's load and (fully_async: interruptible) the recompute of the group; learning: 2
    # mini-batches + the publish; scoring: 8 / 4 = 2 groups on the one scoring stage
    swap = plan.swap
    assert swap is not None and swap.route.startswith("in memory") and swap.load_seconds > 0
    assert plan.balance == pytest.approx(
        {
            "rollout": 0.5 + 96 * 0.01 + swap.load_seconds + 9.0,
            "learning": 2 * 1.0 + swap.publish_seconds,
            "scoring": 2 * 0.25,
        }
    )
    # the student's parameters at the shared vocabulary, in the published dtype (auto: fp32,
    # student.dtype), both rollout stages' copies sent by the learner's 4 chips, each
    # received whole (no rollout mesh)
    _, params = abstract_decoder(plan_module.read_models(cfg, Shapes(32, 96, 1)).student, "float32", 151000)
    size = sum(x.size * itemsize for x in jax.tree_util.tree_leaves(params))
    rate = CHIPS["h100"].interconnect_bytes_per_s / 2
    assert (swap.published_bytes, swap.reader_chip_bytes) == (size, size)
    assert swap.publish_seconds == pytest.approx(2 * size / 4 / rate)
    assert swap.load_seconds == pytest.approx(size / rate)


GOLDEN = (
    "topology h100-4: 4 × NVIDIA H100 SXM 80 GB (74.51 GiB, 989 TFLOP/s, 3350 GB/s), "
    "compiled by XLA:CPU (a proxy for the GPUs)\n"
    """\
shapes: 32 prompt + 96 response tokens, 1 layers (reduced)
student: /a/config.json
teacher: /b/config.json

per chip and call; TFLOP: matmul FLOPs counted from the program (model: without
recomputation; run: as configured; /book: model over 2 (6 with a backward pass) ·
weights · tokens + attention; XLA: the compiler's own count, which takes a loop's body once)

stage            chips  rows  args GiB  temp GiB  peak GiB  of HBM   model     run  /book     XLA  roofline s   MFU
learner step         4     8      3.00      5.00      9.00     12%    30.0    40.0   1.20     0.1       0.597    5%
sampler decode       4     8      0.50      0.00      0.50      1%     0.0     0.0      -     1.0       0.200    0%
teacher scoring      4     8  does not compile: RESOURCE_EXHAUSTED: out of memory

answers: 40 expected of 96 tokens, after 32 prompt slots
a weight swap per published version (in memory: device to device over the chips' links): 3.40 GB published, \
learner 0.019 s, each sampler 0.004 s to load (0.85 GB)
per rollout batch, at the roofline (asyncopd_jax/scale/balance.py; the sampler: prefill +
decode + a weight swap's load and recompute): the slowest stage sets the pace, the others idle the rest
  rollout        2.50 s  busy 100%  (prefill 0.50 + decode 1.50 + swap 0.50)
  learning       1.25 s  busy  50%  (publish 0.02)
  scoring     (does not compile)
"""
)


def test_the_plan_table_prints_every_figure_per_chip():
    """Bug guarded: the printed plan saying other figures than the plan holds (a column
    scaled by another factor, a legend or a line changed or lost). The figures are made
    up and checked by hand against the table: peak = 3 + 2 − 1 + 5 GiB, 12 % of 80 GB, model
    30 / run 40 / book 25 TFLOP (1.20), roofline max(40 TFLOP / 989 TFLOP/s, 2 TB / 3.35 TB/s)
    = 0.597 s, MFU 30 / (0.597 · 989) = 5 %; the XLA count of 0.05 TFLOP sits on a rounding
    edge (0.1), so that a column scaled by even 1 + 1e-12 shows."""
    topology = Topology("h100-4", CHIPS["h100"], (0, 1, 2, 3), "XLA:CPU (a proxy for the GPUs)")
    gib = 1024**3
    stages = [
        StageFigures(
            "learner step",
            4,
            8,
            1024,
            argument_bytes=3 * gib,
            output_bytes=2 * gib,
            alias_bytes=gib,
            temp_bytes=5 * gib,
            flops=5e10,
            bytes_accessed=2e12,
            executed_flops=4e13,
            model_flops=3e13,
            textbook_flops=2.5e13,
        ),
        StageFigures("sampler decode", 4, 8, 8, argument_bytes=gib // 2, flops=1e12, bytes_accessed=6.7e11),
        StageFigures("teacher scoring", 4, 8, 1024, error="RESOURCE_EXHAUSTED: out of memory"),
    ]
    plan = Plan(
        topology,
        Shapes(prompt_tokens=32, response_tokens=96, layers=1),
        stages,
        {"student": "/a/config.json", "teacher": "/b/config.json"},
        {"rollout": 2.5, "learning": 1.25, "scoring": float("nan")},
        answers=Answers(32, 96, 40),
        rollout=RolloutCost(prefill=0.5, decode=1.5, swap=0.5),
        swap=SwapFigures(
            "in memory: device to device over the chips' links", 3_400_000_000, 850_000_000, 0.019, 0.0038
        ),
    )
    assert format_plan(plan) == GOLDEN.rstrip("\n")


def _uncompiled(monkeypatch):
    """The plan's compiles skipped: each stage's figures carry only what ``plan`` counts
    itself (the compiler's memory and cost analyses are zeros)."""
    monkeypatch.setattr(
        plan_module,
        "_figures",
        lambda stage, devices, rows, tokens, lowered: StageFigures(stage, devices, rows, tokens),
    )


def test_the_samplers_figures_are_the_textbooks_work_per_call(monkeypatch):
    """Bug guarded: the sampler's work per call counted wrongly, e.g. a decode step's reads
    of the cache as rows / layers instead of rows · layers (the same at one layer, the depth
    ``test_plan`` compiles at). Three layers of the demo student's widths, 4 rows, 8 prompt
    and 16 response slots, nothing compiled."""
    _uncompiled(monkeypatch)
    cfg = load_config(configs.DEMO, [])
    config = dataclasses.replace(architecture(cfg.student)[0], num_hidden_layers=3)
    prefill, decode, recompute = plan_module.compile_sampler(cfg, config, jax.devices()[:1], Shapes(8, 16), 4)
    q = config.num_attention_heads * config.head_dim
    reads = 4 * 3 * 4 * (8 + 16) * q  # rows · layers · (q·k and p·v: 2 · 2 FLOPs) · slots · N_q·D
    want = {
        "sampler prefill": (4, 4 * 8, transformer_flops(config, 4, 8, 1, backward=False)),
        "sampler decode": (4, 4, transformer_flops(config, 4, 1, 1, backward=False) + reads),
        "sampler recompute": (4, 4 * 24, transformer_flops(config, 4, 24, 1, backward=False)),
    }
    assert {s.stage: (s.rows, s.tokens, s.executed_flops) for s in (prefill, decode, recompute)} == want
    assert all(s.executed_flops == s.model_flops == s.textbook_flops for s in (prefill, decode, recompute))


def test_the_learner_step_is_counted_with_its_backward_pass(monkeypatch):
    """Bug guarded: the learner step's textbook count taken without the backward pass
    (``backward`` falsy: 2 · weights · tokens instead of 6 ·), which the model's own count,
    backward pass included, is compared with (the plan's ``/book`` column)."""
    _uncompiled(monkeypatch)
    cfg = load_config(configs.DEMO, ["learner.batch_size=4"])
    config, _ = architecture(cfg.student)
    learner = plan_module.compile_learner_step(cfg, config, jax.devices()[:1], Shapes(8, 16))
    assert learner.textbook_flops == transformer_flops(config, 4, 24, 16, backward=True)
    assert 0.9 < learner.model_flops / learner.textbook_flops < 1.5


class _Stop(Exception):
    """Raised by a stand-in to end a compile once it has seen what it was handed."""


@pytest.mark.parametrize(
    "sets",
    [
        [],
        ["student.lora.rank=4", "student.lora.targets=[q_proj, down_proj]"],
        ["student.lora.rank=2", "student.lora.modules_to_save=[embed_tokens, '.*norm']"],
    ],
)
def test_the_planned_learner_step_holds_the_runs_train_state(monkeypatch, sets):
    """Bug guarded: the abstract train state the plan compiles the learner step for unlike
    the run's (its step counter a float: ``jnp.zeros((), None)``; a LoRA student's adapters
    missing, or moments for its frozen base), so that the plan compiles another program
    than the run's. The state is caught where it is laid out, and compared leaf by leaf
    with the one ``create_train_state`` makes for the run."""
    seen = []

    def caught(state, mesh):
        seen.append(state)
        raise _Stop

    monkeypatch.setattr(plan_module, "state_shardings", caught)
    cfg = load_config(configs.DEMO, sets)
    config, _ = architecture(cfg.student)
    with pytest.raises(_Stop):
        plan_module.compile_learner_step(cfg, config, jax.devices()[:1], Shapes(8, 16))
    optimizer = make_optimizer(cfg.optim, cfg.train.steps)
    student = add_adapters(Decoder(config, rngs=nnx.Rngs(0)), cfg.student.lora, nnx.Rngs(0))
    _, run = create_train_state(student, optimizer)
    leaves = lambda tree: [(x.shape, x.dtype) for x in jax.tree_util.tree_leaves(tree)]  # noqa: E731
    assert (seen[0].step.shape, seen[0].step.dtype) == ((), jnp.int32)
    assert leaves(seen[0]) == leaves(run)


@pytest.mark.extended  # CI time (~8 s: Qwen3-1.7B's shapes built three times): the second step
def test_a_lora_learner_holds_no_moments_for_its_frozen_base():
    """Qwen3-1.7B in fp32 on one chip: trained whole, its state is the weights and Adam's two
    moments (3×); with rank 16 on the 7 projections, the weights and the adapters' moments."""
    cfg = load_config(configs.DEMO, ["student.path=/models/Qwen3-1.7B"])
    config, _ = architecture(cfg.student)
    full = plan_module.learner_state_bytes(cfg, config, jax.devices()[:1])
    lora = load_config(configs.DEMO, ["student.path=/models/Qwen3-1.7B", "student.lora.rank=16"])
    adapted = plan_module.learner_state_bytes(lora, config, jax.devices()[:1])
    weights = 4 * sum(x.size for x in jax.tree_util.tree_leaves(abstract_decoder(config, "float32")[1]))
    assert full == pytest.approx(3 * weights, rel=1e-3)
    c = config  # rank 16 on q, k, v, o, gate, up, down of each layer: 16 · (in + out) each, 3× (weights, μ, ν)
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    per_layer = (c.hidden_size + q) * 2 + (c.hidden_size + kv) * 2 + (c.hidden_size + c.intermediate_size) * 3
    assert adapted == pytest.approx(weights + 3 * 4 * 16 * per_layer * c.num_hidden_layers, rel=1e-3)


@pytest.mark.extended  # CI time (~6 s: Qwen3-1.7B's shapes built three times): the second step
@pytest.mark.parametrize("in_memory", [True, False])
def test_a_lora_version_ships_its_adapters_alone_and_the_sampler_merges_them(in_memory):
    """Issue 58's figure: Qwen3-1.7B in fp32, rank 16 on the 7 projections of every layer: a
    version ships the adapters alone, about 1 % of the whole student (the acceptance asks at
    most 5 %); a sampler that merges them reads and writes every adapted kernel once per
    version, and keeps the base and adapters beside the weights it decodes with."""
    cfg = load_config(configs.DEMO, ["student.path=/models/Qwen3-1.7B", "student.lora.rank=16"])
    config, _ = architecture(cfg.student)
    devices = jax.devices()[:1]
    _, published = student_decoder(cfg, config, cfg.published_dtype)
    channel = SnapshotChannel(in_memory=in_memory, directory="", format="safetensors", keep=3, temporary=False)
    received = received_weights(cfg, config, devices)
    chip = CHIPS["v6e"]
    swap = swap_figures(channel, published, received, learner_chips=2, samplers=1, chip=chip, merge=True)
    c = config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    adapters = (
        4
        * 16
        * c.num_hidden_layers
        * ((c.hidden_size + q) * 2 + (c.hidden_size + kv) * 2 + (c.hidden_size + c.intermediate_size) * 3)
    )
    kernels = (
        4
        * c.num_hidden_layers
        * (2 * c.hidden_size * q + 2 * c.hidden_size * kv + 3 * c.hidden_size * c.intermediate_size)
    )
    base = 4 * sum(x.size for x in jax.tree_util.tree_leaves(abstract_decoder(config, "float32")[1]))
    assert (swap.published_bytes, swap.full_bytes) == (adapters, base + adapters)
    assert swap.published_bytes / swap.full_bytes < 0.05
    assert swap.merge_seconds == pytest.approx(2 * kernels / chip.hbm_bytes_per_s)
    rate = chip.copy_bytes_per_s if in_memory else 1e9
    assert swap.load_seconds == pytest.approx(adapters / rate + swap.merge_seconds)
    share = f"the adapters and any modules_to_save: {100 * adapters / (base + adapters):.2f} % of the full version"
    assert share in swap.describe()
    # the sampler decodes a plain model and holds the base and adapters beside it
    assert sampler_weights(cfg, config, devices) is not None
    assert not jax.tree_util.tree_leaves(nnx.filter_state(sampler_weights(cfg, config, devices), nnx.LoRAParam))
    assert resident_bytes(cfg, config, devices) == base + adapters
    unmerged = load_config(
        configs.DEMO, [*["student.path=/models/Qwen3-1.7B", "student.lora.rank=16"], "student.lora.sampler=unmerged"]
    )
    assert resident_bytes(unmerged, config, devices) == 0
    if not in_memory:
        return  # the rest is the same figure on either route: built once (Qwen3-1.7B's shapes take seconds)
    # the tied embedding trained whole ships with every version: its V × H fp32 weights
    saved = load_config(
        configs.DEMO,
        [*["student.path=/models/Qwen3-1.7B", "student.lora.rank=16"], "student.lora.modules_to_save=[embed_tokens]"],
    )
    _, published = student_decoder(saved, config, saved.published_dtype)
    received = received_weights(saved, config, devices)
    swap = swap_figures(channel, published, received, learner_chips=2, samplers=1, chip=chip, merge=True)
    assert (swap.published_bytes, swap.full_bytes) == (adapters + 4 * c.vocab_size * c.hidden_size, base + adapters)


# Written for survivors of the sampled mutation run of 2026-11-26 with seed 37 (a second
# sample of 40 plan mutants, none of them in the seed-36 sample).


def test_the_teacher_scorings_figures_are_the_textbooks_forward_per_chip_and_its_samples_keyed(monkeypatch):
    """Bug guarded: the teacher scoring's textbook count multiplied by its chips instead of
    divided (``textbook * len(devices)``), its model FLOPs left out (0: the plan's ``model``,
    ``/book`` and MFU columns read nothing), or its key not handed to the program
    (``lower(…, None)``: a run that draws teacher samples cannot be planned). Two chips, 4
    rows of 8 prompt + 16 response slots, 2 teacher samples a position, nothing compiled."""
    _uncompiled(monkeypatch)
    cfg = load_config(configs.DEMO, ["scoring.num_samples=2"])
    config, _ = architecture(cfg.teacher)
    scoring = plan_module.compile_teacher_scoring(cfg, config, jax.devices()[:2], Shapes(8, 16), 4)
    assert (scoring.stage, scoring.devices, scoring.rows, scoring.tokens) == ("teacher scoring", 2, 4, 4 * 24)
    assert scoring.textbook_flops == transformer_flops(config, 4, 24, 16, backward=False) / 2
    assert scoring.model_flops == scoring.executed_flops
    assert 0.9 < scoring.model_flops / scoring.textbook_flops < 1.5


def test_the_sampler_is_planned_on_the_rollout_stages_mesh_each_chip_holding_its_rows(monkeypatch):
    """Bug guarded: the sampler's programs built without the rollout stage's mesh
    (``make_sampler(…, mesh=None)``): the weights still come placed on it, but the prompts
    are then whole on every chip instead of split by rows as the run lays them out, so the
    plan's memory figures are another program's. Two chips, a group of 4 rows; only the
    prefill (one forward of the demo student) is compiled, for its input layout."""
    lowered = {}

    def caught(stage, devices, rows, tokens, low):
        lowered[stage] = low
        return StageFigures(stage, devices, rows, tokens)

    monkeypatch.setattr(plan_module, "_figures", caught)
    cfg = load_config(configs.DEMO, [])
    config, _ = architecture(cfg.student)
    plan_module.compile_sampler(cfg, config, jax.devices()[:2], Shapes(8, 16), 4)
    *_, ids, mask, keys = lowered["sampler prefill"].compile().input_shardings[0]
    assert [s.shard_shape(shape) for s, shape in ((ids, (4, 8)), (mask, (4, 8)), (keys, (4,)))] == [
        (2, 8),
        (2, 8),
        (2,),
    ]


class _Analysed:
    """A lowered program whose compile reports its memory, and its costs as a list (as some
    backends give them) without a count of the bytes accessed."""

    def compile(self):
        return self

    def memory_analysis(self):
        return types.SimpleNamespace(
            argument_size_in_bytes=3, output_size_in_bytes=5, alias_size_in_bytes=1, temp_size_in_bytes=7
        )

    def cost_analysis(self):
        return [{"flops": 11.0}]


def test_a_compilers_analyses_become_the_figures_and_a_count_it_lacks_is_zero():
    """Bug guarded: a count the compiler's cost analysis does not report read as
    ``float(None)`` (a TypeError: the plan of a backend without it fails) instead of 0, or
    the analyses' figures put in other fields."""
    figures = plan_module._figures("learner step", 4, 8, 16, _Analysed())
    assert figures == StageFigures(
        "learner step",
        4,
        8,
        16,
        argument_bytes=3,
        output_bytes=5,
        alias_bytes=1,
        temp_bytes=7,
        flops=11.0,
        bytes_accessed=0.0,
    )


def test_a_plan_on_cpu_devices_compiles_the_attention_the_gpus_would_run():
    """Bug guarded: the XLA:CPU devices that stand in for a GPU topology's not recognised as
    such (``platform == "CPU"``: ``device.platform`` is lower case), so that ``attention:
    auto`` resolves as on a CPU run (the plain attention, its S × S scores in memory) and the
    plan compiles the learner step and the teacher's scoring with another attention than the
    GPUs' (blockwise). TPU chips are planned as TPU chips."""
    cpu = jax.devices("cpu")[:1]
    assert cpu[0].platform == "cpu"
    assert plan_module.target_platform(cpu) == "gpu"
    assert resolve_implementation("auto", plan_module.target_platform(cpu)) == "blockwise"
    assert plan_module.target_platform([types.SimpleNamespace(platform="tpu")]) == "tpu"


def test_the_sampler_is_compiled_at_the_plans_answer_length_not_the_configs():
    """``asyncopd plan --response-tokens T`` compiles the rollout engine for answers of T
    tokens whatever ``sampling.max_new_tokens`` the config holds: the decode's cache spans
    the plan's P + T."""
    student, _ = architecture(load_config(configs.DEMO).student)
    devices = [get_topology("h100-1").devices[0]]

    def decode_argument_bytes(config_tokens: int, plan_tokens: int) -> int:
        cfg = load_config(configs.DEMO, ["sampling.engine=static", f"sampling.max_new_tokens={config_tokens}"])
        shapes = Shapes(prompt_tokens=16, response_tokens=plan_tokens)
        figures = plan_module.compile_sampler(cfg, student, devices, shapes, rows=4)
        (decode,) = [f for f in figures if f.stage == "sampler decode"]
        assert decode.error is None, decode.error
        return decode.argument_bytes

    at_plan = decode_argument_bytes(config_tokens=8, plan_tokens=48)
    assert at_plan == decode_argument_bytes(config_tokens=48, plan_tokens=48)
    assert at_plan > decode_argument_bytes(config_tokens=48, plan_tokens=8)


@pytest.mark.parametrize("routed", [True, False])
def test_the_plan_prints_the_experts_link_bytes_at_uniform_routing_and_at_worst(routed):
    """Bug guarded: the exchange's line giving the roofline's bytes without saying at what
    routing, or the worst case lost. H100 links: 450 GB/s a direction; 90 GB → 0.200 s,
    360 GB → 0.800 s. A padded exchange sends the same bytes whatever the routing."""
    topology = Topology("h100-4", CHIPS["h100"], (0, 1, 2, 3), "XLA:CPU (a proxy for the GPUs)")
    uniform = 90e9 if routed else 360e9
    teacher = StageFigures(
        "teacher scoring", 4, 8, 1024, flops=1e12, interconnect_bytes=uniform, interconnect_worst_bytes=360e9
    )
    plan = Plan(topology, Shapes(32, 96, 1), [teacher], {}, {"scoring": teacher.roofline_seconds(CHIPS["h100"])})
    line = next(line for line in format_plan(plan).splitlines() if "all-to-alls" in line)
    if routed:
        assert line == (
            "teacher scoring: the experts' all-to-alls send 90.0 GB per chip and call, 0.200 s over its links "
            "(in its roofline), at uniform routing (routed rows only); 360.0 GB, 0.800 s, where one chip holds "
            "every token's experts"
        )
    else:
        assert line == (
            "teacher scoring: the experts' all-to-alls send 360.0 GB per chip and call, 0.800 s over its links "
            "(in its roofline), whatever the routing (padded chunks)"
        )


def test_the_sampler_is_planned_at_the_vocabulary_the_teacher_shares(monkeypatch):
    """Bug guarded: the sampler compiled with the student's whole vocabulary where the plan
    cuts it to the ids the teacher embeds (``vocab_limit``), as it does the learner's and
    the teacher's: its head, logits and sampling then larger than the run's."""
    cfg = load_config(configs.DEMO, [])
    config, _ = architecture(cfg.student)
    handed = []

    def recording(graphdef, params, mesh=None):
        handed.append(graphdef)
        raise _Stop

    monkeypatch.setattr(plan_module, "make_sampler", recording)
    limited, whole = (abstract_decoder(config, cfg.student.dtype, limit)[0] for limit in (config.vocab_size - 3, None))
    assert limited != whole  # the limit is part of the model the engine compiles
    for limit, want in ((config.vocab_size - 3, limited), (None, whole)):
        with pytest.raises(_Stop):
            plan_module.compile_sampler(cfg, config, jax.devices()[:1], Shapes(8, 16), 4, vocab_limit=limit)
        assert handed.pop() == want
