"""``asyncopd plan``: the learner step compiled at shapes only, on a topology's devices.

The abstract batch must be the batch the pipeline makes (else the plan compiles another
program than the run's); rematerialisation must lower what a step holds; the command's
errors are one line.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from asyncopd_jax import configs
from asyncopd_jax.cli import main
from asyncopd_jax.config import load_config
from asyncopd_jax.learner.optimizer import make_optimizer
from asyncopd_jax.learner.step import PolicyLoss, TrainState, train_step_function
from asyncopd_jax.models.decoder import abstract_decoder
from asyncopd_jax.pipeline.learner_stage import LearnerStage
from asyncopd_jax.pipeline.trainer import Trainer
from asyncopd_jax.scale import plan as plan_module
from asyncopd_jax.scale.balance import Answers
from asyncopd_jax.scale.chips import GIB, get_topology
from asyncopd_jax.scale.flops import matmul_flops, transformer_flops
from asyncopd_jax.scale.learner_inputs import abstract_learner_batch, architecture
from asyncopd_jax.scale.plan import Shapes, compile_learner_step, hidden_payload_notes, make_plan
from asyncopd_jax.scale.report import format_plan
from tests.pipeline.test_trainer import _config, models  # noqa: F401


def _structure(tree):
    """Tree structure, and each leaf's shape after the rows and its dtype."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, [(tuple(x.shape[1:]), str(x.dtype)) for x in leaves]


@pytest.mark.e2e  # a whole run per setting: the end-to-end step (-m e2e)
@pytest.mark.parametrize(
    "sets",
    [
        {},  # forward_kl_topk with 4 MC candidates: teacher top-K, candidates
        {"estimator.name": "reverse_kl_hybrid", "sampling.student_topk": 3, "scoring.store_dtype": "bfloat16"},
        {"estimator.name": "decoupled_ppo", "scoring.num_samples": 2},  # proximal log-probs, teacher samples
        {"estimator.name": "forward_kl_dense", "teacher.payload": "hidden", "scoring.hidden_dtype": "bfloat16"},
    ],
    ids=["topk+candidates", "hybrid+bf16", "proximal+samples", "hidden-states"],
)
def test_the_abstract_batch_is_the_batch_the_pipeline_makes(models, tmp_path, monkeypatch, sets):  # noqa: F811
    cfg = _config(models, tmp_path, **{"train.steps": 1, **sets})
    seen = []
    original = LearnerStage.step
    monkeypatch.setattr(LearnerStage, "step", lambda self, mini: seen.append(mini) or original(self, mini))
    Trainer(cfg, progress=False).run()
    real = seen[0]
    rows, prompt = real.rollout.prompt_tokens.shape
    config, _ = architecture(cfg.student)
    model = abstract_decoder(config, cfg.student.dtype)
    abstract = abstract_learner_batch(cfg, rows, Shapes(prompt, cfg.sampling.max_new_tokens), model)
    assert _structure(abstract) == _structure(real)
    assert abstract.rollout.response_tokens.shape == real.rollout.response_tokens.shape


def test_the_shipped_architectures_stand_in_for_weights_this_machine_lacks():
    config, source = architecture(load_config(None, ["student.path=/models/Qwen3-1.7B"]).student, layers=2)
    assert source.endswith("architectures/Qwen3-1.7B/config.json")
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (2048, 2, 151936)


def _qwen_width_config(**sets):
    """Qwen3-1.7B's widths and vocabulary, 2 layers, 2 rows × 256 tokens per learner device."""
    base = {
        "student.path": "/models/Qwen3-1.7B",
        "teacher.path": "/models/Qwen3-8B",
        "scoring.topk": 16,
        "estimator.name": "forward_kl_topk",
        "learner.batch_size": 8,
        "learner.mesh": "{data: 1, fsdp: -1}",
        **sets,
    }
    return load_config(None, [f"{k}={v}" for k, v in base.items()])


def test_the_plan_names_its_compiler_and_every_figure_per_chip():
    cfg = _qwen_width_config()
    plan = make_plan(cfg, get_topology("h100-4"), Shapes(prompt_tokens=32, response_tokens=96, layers=1))
    text = format_plan(plan)
    assert "XLA:CPU (a proxy for the GPUs)" in text and "1 layers (reduced)" in text
    learner, prefill, decode, recompute, scoring = plan.stages
    assert learner.stage == "learner step" and learner.tokens == 8 * 128
    assert learner.flops > 0 and learner.peak_bytes > learner.argument_bytes > 0
    assert learner.executed_flops >= learner.model_flops >= learner.textbook_flops > 0
    # the sampler and the teacher handle one rollout group (the whole batch: one rollout stage)
    assert [s.stage for s in (prefill, decode, recompute)] == ["sampler prefill", "sampler decode", "sampler recompute"]
    assert (decode.rows, decode.tokens, recompute.tokens) == (8, 8, 8 * 128)
    assert scoring.stage == "teacher scoring" and (scoring.rows, scoring.devices) == (8, 4)
    assert scoring.flops > 0 and scoring.peak_bytes > scoring.argument_bytes > 0
    assert set(plan.balance) == {"rollout", "scoring", "learning"} and min(plan.balance.values()) > 0
    assert "teacher scoring" in text and "busy" in text


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--topology", "v5e"], "--topology 'v5e': expected <chip>-<count>"),
        (["--topology", "h100-4", "--set", "learner.remat=all"], "learner.remat"),
    ],
)
def test_plan_errors_are_one_line(capsys, argv, says):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err


@pytest.mark.extended  # 28 layers traced twice, 20 s: CI's second step
def test_the_learner_steps_flops_are_the_textbooks_at_real_shapes():
    """Qwen3-1.7B, 2 rows × (512 + 3,584) tokens (counted from the program, nothing
    compiled): the model's matmul FLOPs are 6 · weights · tokens + attention to within
    10 % — above it by the LM head's logits, which the fused gather recomputes in the
    backward pass (4 passes over the head, not 3) — and rematerialising every layer adds
    about one forward (8/6)."""
    cfg = _qwen_width_config(**{"learner.batch_size": 2})
    config, _ = architecture(cfg.student)
    graphdef, params = abstract_decoder(config, "float32", None, "xla")
    optimizer = make_optimizer(cfg.optim, 10)
    state = jax.eval_shape(lambda p: TrainState(p, optimizer.init(p), jnp.zeros((), jnp.int32)), params)
    batch = abstract_learner_batch(cfg, 2, Shapes(512, 3584))

    def counted(remat):
        loss = dataclasses.replace(PolicyLoss.from_config(cfg), remat=remat)
        return matmul_flops(train_step_function(graphdef, optimizer, loss), state, batch)

    book = transformer_flops(config, 2, 4096, 3584, backward=True)
    model, remat = counted("none"), counted("layer")
    assert 1.0 < model / book < 1.1
    assert 1.2 < remat / model < 4 / 3


def test_the_continuous_engine_balance_decodes_the_expected_answers_through_its_slots():
    """64 prompts a batch through a stream of 16 slots, answers of 10 tokens expected of 24:
    64 · 10 / 16 = 40 decode steps of 16 slots over the mean context 16 + 5, each at the
    roofline of its weights' and that context's KV bytes; 64 / 16 = 4 prefills of a full set
    of slots; a swap's load and the recompute of the live slots' share of the worst case
    (21 of 40 tokens). The teacher is served: named external, it is neither compiled nor in
    the balance."""
    served = ["teacher.path=''", "teacher.server.url=http://teacher:8000"]
    cfg = load_config(
        configs.DEMO, ["sampling.engine=continuous", "sampling.slots=16", "learner.batch_size=64", *served]
    )
    shapes = Shapes(prompt_tokens=16, response_tokens=24)
    plan = make_plan(cfg, get_topology("h100-4"), shapes, mean_response_tokens=10)
    assert [s.stage for s in plan.stages] == ["learner step", "sampler prefill", "sampler decode", "sampler recompute"]
    assert set(plan.balance) == {"rollout", "learning"}
    text = format_plan(plan)
    assert "teacher: external, served at http://teacher:8000 (not planned on these chips)" in text
    assert "answers: 10 expected of 24 tokens, after 16 prompt slots" in text
    prefill, decode, recompute = plan.stages[1:]
    assert (prefill.rows, decode.rows) == (16, 16)
    chip = plan.topology.chip
    student, _ = architecture(cfg.student)
    layer_bytes = 2 * student.num_key_value_heads * student.head_dim * 4  # K and V, fp32, one layer
    held = plan_module.decode_bytes(cfg, student, [get_topology("h100-4").devices[0]], shapes)
    assert held.kv_per_token == student.num_hidden_layers * layer_bytes
    weights = sum(x.size * 4 for x in jax.tree_util.tree_leaves(abstract_decoder(student, "float32")[1]))
    assert held.weights == weights
    q = student.num_attention_heads * student.head_dim
    flops = transformer_flops(student, 16, 1, 1, backward=False) + 16 * student.num_hidden_layers * 4 * 21 * q
    step = max(flops / chip.peak_flops, (weights + 16 * 21 * held.kv_per_token) / chip.hbm_bytes_per_s)
    swap = plan.swap.load_seconds + recompute.roofline_seconds(chip) * 21 / 40
    want = 4 * prefill.roofline_seconds(chip) + 40 * step + swap
    assert plan.balance["rollout"] == pytest.approx(want)
    assert plan.rollout.decode == pytest.approx(40 * step)
    # admission and decode widths are loops inside the one call program: two programs in all
    want = "the rollout engine (continuous) compiles 2 programs at most for these shapes: run 1, recompute 1"
    assert want in text


def test_a_mean_answer_longer_than_the_limit_is_one_line():
    with pytest.raises(ValueError, match="--mean-response-tokens 30 is invalid; expected 0 < it <= the response"):
        Answers(16, 24, 30)


def test_several_teachers_each_compiled_their_share_in_the_balance_and_their_weights_summed():
    """Three teachers: a (weight 3) and b (weight 1) in-process, c served (weight 4). Each
    in-process one is compiled on the scoring chips as its own stage; the balance counts a's
    3/8 and b's 1/8 of each group (c's half runs elsewhere); a note adds their weights."""
    teachers = (
        "[{name: a, path: 'builtin:teacher', weight: 3}, {name: b, path: 'builtin:student', weight: 1}, "
        "{name: c, server: {url: 'http://teacher:8000'}, weight: 4}]"
    )
    cfg = load_config(configs.DEMO, ["teacher.path=''", f"teachers={teachers}", "learner.batch_size=64"])
    plan = make_plan(cfg, get_topology("h100-4"), Shapes(prompt_tokens=16, response_tokens=24))
    scoring = {s.stage: s for s in plan.stages if s.stage.startswith("scoring")}
    assert list(scoring) == ["scoring a", "scoring b"] and all(not s.error for s in scoring.values())
    chip = plan.topology.chip
    want = 3 / 8 * scoring["scoring a"].roofline_seconds(chip) + 1 / 8 * scoring["scoring b"].roofline_seconds(chip)
    assert plan.balance["scoring"] == pytest.approx(want)
    text = format_plan(plan)
    assert "teacher c: external, served at http://teacher:8000" in text and "teacher a: " in text
    weights = sum(s.argument_bytes for s in scoring.values()) / GIB
    assert f"the 2 teachers share the scoring chips: weights and inputs {weights:.2f} GiB" in text


def test_a_decode_step_reads_the_weights_and_cache_in_the_samplers_compute_dtype():
    """bf16 compute over an fp32 student: the weights a step reads and its KV cache per
    token are half the fp32 ones (shapes only: nothing compiled)."""
    student, _ = architecture(load_config(configs.DEMO).student)
    devices = [get_topology("h100-1").devices[0]]
    shapes = Shapes(prompt_tokens=16, response_tokens=24)
    sets = ["sampling.engine=continuous", "sampling.slots=8"]
    fp32 = plan_module.decode_bytes(load_config(configs.DEMO, sets), student, devices, shapes)
    bf16 = plan_module.decode_bytes(
        load_config(configs.DEMO, [*sets, "sampling.compute_dtype=bfloat16"]), student, devices, shapes
    )
    assert (bf16.weights * 2, bf16.kv_per_token * 2) == (fp32.weights, fp32.kv_per_token)


def test_the_static_engine_names_no_cache_for_the_balance_to_model():
    """A static batch's decode step reads its whole dense cache, as its compiled call does:
    the engine names no cache (``Engine.decode_cache``), so the plan models no decode bytes."""
    cfg = load_config(configs.DEMO, ["sampling.engine=static"])
    student, _ = architecture(cfg.student)
    devices = [get_topology("h100-1").devices[0]]
    assert plan_module.decode_bytes(cfg, student, devices, Shapes(prompt_tokens=16, response_tokens=24)) is None


def test_a_stage_whose_link_bytes_dominate_has_them_as_its_roofline():
    """The experts' all-to-alls count in a stage's roofline at one direction of its links."""
    from asyncopd_jax.scale.chips import CHIPS

    chip = CHIPS["v6e"]
    figures = plan_module.StageFigures("teacher scoring", 8, 64, 64 * 4096, flops=1e12, bytes_accessed=1e9)
    assert figures.roofline_seconds(chip) == pytest.approx(1e12 / chip.peak_flops)
    linked = dataclasses.replace(figures, interconnect_bytes=448e9)
    assert linked.roofline_seconds(chip) == pytest.approx(448e9 / (chip.interconnect_bytes_per_s / 2)) == 2.0


def test_the_hidden_state_payload_is_counted_in_the_learner_step_and_the_notes():
    """``teacher.payload: hidden`` with ``forward_kl_dense`` at Qwen3 widths (1 layer, the
    XLA:CPU proxy): the learner step takes the teacher's head as an argument (its bytes in
    the step's inputs) and does its matmuls (2 · H_q · V a response position, forward and
    the backward's recompute); the notes give the payload's bytes per batch."""
    shapes = Shapes(prompt_tokens=32, response_tokens=96, layers=1)
    devices = get_topology("h100-4").devices
    topk = compile_learner_step(_qwen_width_config(), architecture(_qwen_width_config().student, 1)[0], devices, shapes)
    cfg = _qwen_width_config(**{"estimator.name": "forward_kl_dense", "teacher.payload": "hidden"})
    dense = compile_learner_step(cfg, architecture(cfg.student, 1)[0], devices, shapes)
    assert not topk.error and not dense.error, (topk.error, dense.error)
    h_q, vocab, rows = 4096, 151_936, cfg.learner.batch_size  # Qwen3-8B's head over the batch's positions
    head_bytes = h_q * vocab * 4  # fp32 (teacher.dtype's default), replicated on each device
    assert dense.argument_bytes - topk.argument_bytes >= head_bytes - rows * 96 * 16 * 8 // 4
    teacher_head_flops = 2 * (2 * h_q * vocab) * rows * 96 / len(devices)
    assert dense.executed_flops - topk.executed_flops >= teacher_head_flops
    topology = get_topology("h100-4")
    (note,) = hidden_payload_notes(cfg, shapes, None, len(devices), topology.chip)
    # 8 rows × 96 positions × 4,096 × 4 bytes = 12 MiB; the top-16's ids and log q: 8 bytes each, 0.09 MiB
    assert note.startswith("the teachers' hidden states: 12.00 MiB per batch from scoring to the learner (4096 a ")
    assert "a top-16 cache: 0.09 MiB" in note and "their heads, 2.32 GiB on every learner chip" in note
    # the FLOPs the compiled step does on top of the top-K one's: 2 · 2 · 768 positions · 4,096 · 151,936
    per_chip_ms = teacher_head_flops / topology.chip.peak_flops * 1e3
    assert f"at 1.91 TFLOP per batch (0.48 a learner chip: {per_chip_ms:.1f} ms at" in note
