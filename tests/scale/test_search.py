"""``asyncopd plan --balance``: the split search picks the fastest split that fits, sizes the
sampler's slots by its bytes, places a config as it says, and prints it. The learner's and
the teacher's compiles are stand-ins with known figures (a real one: the CLI test)."""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path

import pytest

from asyncopd_jax import configs
from asyncopd_jax.cli import main
from asyncopd_jax.config import load_config, with_overrides
from asyncopd_jax.pipeline.layout import device_ids, plan_layout
from asyncopd_jax.scale import plan as plan_module
from asyncopd_jax.scale import search as search_module
from asyncopd_jax.scale.balance import Answers
from asyncopd_jax.scale.chips import CHIPS, get_topology
from asyncopd_jax.scale.plan import Shapes, StageFigures, decode_bytes, read_models
from asyncopd_jax.scale.report import format_balanced
from asyncopd_jax.scale.search import (
    Split,
    balance_split,
    by_id,
    mesh_split,
    places,
    sampler_fit,
    scoring_mesh_split,
)
from asyncopd_jax.scale.student_shapes import sampler_weights
from asyncopd_jax.scale.swaps import bytes_per_device

SHAPES = Shapes(prompt_tokens=16, response_tokens=24)


def _seconds(stage: str, chips: int, rows: int, seconds: float, peak_fraction: float = 0.1) -> StageFigures:
    """A stage on ``chips`` H100s whose roofline is ``seconds`` and whose peak is that fraction of HBM."""
    h100 = CHIPS["h100"]
    return StageFigures(
        stage,
        chips,
        rows,
        rows,
        argument_bytes=int(peak_fraction * h100.hbm_bytes),
        executed_flops=seconds * h100.peak_flops,
    )


@pytest.fixture
def stand_ins(monkeypatch):
    """The learner takes 8 / L s a step and does not fit one chip; the teacher 3 / C s a
    group; the sampler's compiled calls (the full plan's) are instant."""

    def learner(cfg, config, devices, shapes, vocab_limit=None):
        n = len(devices)
        return _seconds("learner step", n, 8, 8.0 / n / cfg.learner.mini_batches, 0.95 if n == 1 else 0.2)

    def scoring(cfg, config, devices, shapes, rows, vocab_limit=None, source=None, stage="teacher scoring"):
        return _seconds(stage, len(devices), rows, 3.0 / len(devices))

    def sampler(cfg, config, devices, shapes, rows, vocab_limit=None):
        return [_seconds(f"sampler {name}", len(devices), rows, 0.0) for name in ("prefill", "decode", "recompute")]

    for module in (plan_module, search_module):
        monkeypatch.setattr(module, "compile_learner_step", learner, raising=False)
        monkeypatch.setattr(module, "compile_teacher_scoring", scoring, raising=False)
    monkeypatch.setattr(plan_module, "compile_sampler", sampler)


def _demo(*sets: str):
    return load_config(configs.DEMO, ["learner.batch_size=64", "learner.mini_batches=2", *sets])


def test_the_fastest_split_that_fits_is_chosen_and_planned_in_full(stand_ins):
    """h100-8: L, R, C in {1, 2, 4} (each other stage needs a chip). L = 1 does not fit (95 %
    of HBM); the learner then takes 8 / L s a batch, the teacher 3 / C s, the sampler of the
    demo's student far less. Fastest: L = 4 (2 s), C = 2 (1.5 s); R = 1 and R = 2 sample
    alike, so the fewer chips: (4, 1, 2)."""
    found = balance_split(_demo(), get_topology("h100-8"), SHAPES, mean_response_tokens=8)
    split = found.chosen.split
    assert (split.learner, split.rollout, split.scoring) == (4, 1, 2)
    assert any(d.startswith("learner step on 1 chips: peak 95% of HBM") for d in found.dropped)
    assert all(c.split.learner != 1 for c in found.candidates)
    rates = [c.samples_per_s for c in found.candidates]
    assert rates == sorted(rates, reverse=True) and found.chosen is found.candidates[0]
    # the chosen split's own plan: the learner on chips 0-3, the sampler on 4, the teacher on 5-6
    stages = {s.stage: s for s in found.plan.stages}
    assert (stages["learner step"].devices, stages["sampler decode"].devices, stages["teacher scoring"].devices) == (
        4,
        1,
        2,
    )
    assert found.plan.balance["learning"] == pytest.approx(2 * 1.0 + found.plan.swap.publish_seconds)
    assert found.plan.balance["scoring"] == pytest.approx(1.5)
    # the sampler of the demo's tiny student idles: it already holds one chip, the fewest
    assert any(n.startswith("rollout is ") and "the fewest it fits on" in n for n in found.notes)
    text = format_balanced(found)
    assert "--set stages.rollout_devices='4'" in text and "the chosen split, planned in full:" in text


def test_a_stage_off_the_learners_host_makes_stage_processes_and_swaps_through_storage(stand_ins):
    """Hosts of 4 chips: the fastest split, (4, 1, 2), puts the sampler and the teacher on the
    second host, so they run as stage processes and each version goes through storage; no
    candidate has a stage over two hosts. With storage at 1 kB/s its swap costs more than a
    whole batch, and the one split that keeps every stage on the learner's host wins."""
    fast = balance_split(_demo(), get_topology("h100-8"), SHAPES, mean_response_tokens=8, chips_per_host=4)
    assert (fast.chosen.split.learner, fast.chosen.split.rollout, fast.chosen.split.scoring) == (4, 1, 2)
    assert fast.chosen.split.processes and "stages.placement=processes" in fast.overrides
    assert "stages.scoring_processes=1" in fast.overrides
    assert fast.plan.swap.route.startswith("safetensors through storage")
    for c in fast.candidates:
        spans = [(0, c.split.learner), (c.split.learner, c.split.rollout), (c.split.learner + c.split.rollout, 1)]
        assert all(first // 4 == (first + n - 1) // 4 for first, n in spans[:2]), c.split
    slow = balance_split(
        _demo(), get_topology("h100-8"), SHAPES, mean_response_tokens=8, chips_per_host=4, storage_bytes_per_s=1e3
    )
    split = slow.chosen.split
    assert (split.learner, split.rollout, split.scoring, split.processes) == (2, 1, 1, False)
    assert slow.plan.swap.route.startswith("in memory")


def test_the_overrides_place_every_stage_where_the_split_says():
    cfg = _demo()
    models = read_models(cfg, SHAPES)
    split = Split(learner=4, rollout=2, scoring=2, slots=32, kv_pages=100)
    placed = split.placed(cfg, models, get_topology("h100-8").devices)
    assert with_overrides(cfg, split.overrides(placed)) == placed  # the lines printed give the config planned
    layout = plan_layout(placed, run_path=Path("/tmp/x"), available_cores=())
    chips = {role: device_ids(layout, layout.of_role(role)[0], 8, "tpu") for role in ("learner", "rollout", "scoring")}
    assert chips == {"learner": (0, 1, 2, 3), "rollout": (4, 5), "scoring": (6, 7)}
    kv = models.student.num_key_value_heads
    assert placed.stages.rollout_mesh.tensor == mesh_split(2, kv)[1] and placed.learner.mesh.fsdp == 4
    assert (placed.sampling.engine, placed.sampling.slots, placed.sampling.kv_pages) == ("continuous", 32, 100)
    assert layout.snapshots.in_memory


@pytest.mark.parametrize(
    "split",
    [
        Split(learner=4, rollout=1, scoring=2, slots=64, kv_pages=96, processes=True),
        Split(learner=2, rollout=1, scoring=0, slots=8, kv_pages=20, processes=True),
        Split(learner=1, rollout=4, scoring=1, slots=16, kv_pages=40),
    ],
    ids=["processes", "processes-no-teacher", "threads"],
)
def test_a_splits_set_lines_give_the_config_it_planned(split):
    """Bug guarded: the ``--set`` lines printed and the config the search planned (built by
    ``dataclasses.replace``) telling two stories: a field set in one and not the other."""
    cfg = _demo("stages.scoring_processes=2", "stages.snapshot_in_memory=false", "sampling.slots=3")
    models = read_models(cfg, SHAPES)
    placed = split.placed(cfg, models, get_topology("h100-8").devices)
    assert with_overrides(cfg, split.overrides(placed)) == placed
    assert placed.stages.placement == ("processes" if split.processes else "threads")


def test_a_stage_takes_the_chips_of_consecutive_ids_wherever_the_topology_lists_them():
    """libtpu lists a v5e-16's chips by 2 × 2 blocks (ids 0, 1, 4, 5, 2, 3, 6, 7, …) and refuses
    a collective over the first four; a stage of 4 takes ids 0-3, at places 0, 1, 4, 5."""
    listed = [types.SimpleNamespace(id=i) for i in (0, 1, 4, 5, 2, 3, 6, 7)]
    assert [d.id for d in by_id(listed)] == list(range(8))
    assert (places(listed, 0, 4), places(listed, 4, 2), places(listed, 6, 1)) == ("0,1,4,5", "2-3", "6")
    assert places(listed, 0, 8) == "0-7"  # the same chips as places 0-7: written as the range


@pytest.mark.parametrize(("chips", "kv", "want"), [(8, 8, (1, 8)), (16, 8, (2, 8)), (4, 2, (2, 2)), (6, 4, (3, 2))])
def test_heads_split_over_the_chips_that_hold_whole_key_value_heads(chips, kv, want):
    assert mesh_split(chips, kv) == want


def test_a_mixture_of_experts_teacher_splits_its_experts_over_fsdp_and_a_dense_one_its_heads():
    from tests.tiny_models import tiny_config, tiny_moe_config

    moe, dense = tiny_moe_config(num_experts=128), tiny_config("qwen3", 61)
    assert scoring_mesh_split(8, [moe]) == (1, 8, 1)  # 16 experts a chip, tokens by all-to-all
    assert scoring_mesh_split(8, [tiny_moe_config(num_experts=12)]) == (2, 4, 1)  # the most chips dividing 12
    assert scoring_mesh_split(4, [moe, dense]) == (1, 4, 1)  # the dense teacher FSDP beside it
    assert scoring_mesh_split(4, [dense]) == (4 // mesh_split(4, 2)[1], 1, mesh_split(4, 2)[1])


def test_the_sampler_takes_the_most_slots_whose_weights_and_cache_fit():
    """A chip sized so that 16 slots' weights (fp32 as received + as computed in) and pool
    fit 75 % of it and 32 slots' do not."""
    cfg = _demo()
    models = read_models(cfg, SHAPES)
    devices = list(get_topology("h100-1").devices)
    answers = Answers(16, 24, 8)
    page = cfg.sampling.page_size
    trial = with_overrides(cfg, ["sampling.engine=continuous", "sampling.slots=1"])
    held = decode_bytes(trial, models.student, devices, SHAPES)
    received = bytes_per_device(sampler_weights(trial, models.student, devices))

    def chip_bytes(slots: int) -> float:
        pages = -(-slots * (16 + 8) // page)  # each slot's prompt and expected answer
        return received + held.weights + (pages + 1) * page * held.kv_per_token

    chip = dataclasses.replace(CHIPS["h100"], hbm_bytes=(chip_bytes(16) + 1) / 0.75)
    fit = sampler_fit(cfg, models, devices, SHAPES, answers, chip)
    assert (fit.slots, fit.kv_pages) == (16, -(-16 * 24 // page)) and chip_bytes(32) > 0.75 * chip.hbm_bytes
    assert fit.chip_bytes == pytest.approx(chip_bytes(16))
    tiny = dataclasses.replace(chip, hbm_bytes=received)
    assert sampler_fit(cfg, models, devices, SHAPES, answers, tiny) is None


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--mean-response-tokens", "99"], "--mean-response-tokens 99 is invalid"),
        (["--storage-gbps", "0"], "--storage-gbps 0 is invalid"),
        (["--balance", "--chips-per-host", "3"], "--chips-per-host 3 is invalid; expected a divisor of h100-4's 4"),
    ],
)
def test_bad_balance_settings_are_one_line(capsys, argv, says):
    assert main(["plan", "--config", "demo", "--topology", "h100-4", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err


@pytest.mark.e2e  # every stage compiled at each chip count: the end-to-end step
def test_plan_balance_from_the_command_line_compiles_and_prints_the_chosen_split(capsys):
    """The real path: every stage compiled by XLA:CPU for the demo's models on a 4-GPU proxy."""
    assert main(["plan", "--config", "demo", "--topology", "h100-4", "--balance", "--mean-response-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "splits fit" in out and "chosen: Split(" in out and "--set sampling.engine=continuous" in out
    assert "answers: 8 expected of 28 tokens" in out and "a weight swap per published version (in memory" in out
