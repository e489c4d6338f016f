"""Qwen3-MoE: the router and the grouped experts against NumPy oracles, the whole model
against transformers' ``Qwen3MoeForCausalLM`` (routing ties included), the round trip
through a Hugging Face directory, and the config's checks."""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from asyncopd_jax.models import DecoderConfig, from_pretrained, save_pretrained
from asyncopd_jax.models.decoder import KVCache
from asyncopd_jax.models.moe import Experts, SparseMoE, route
from tests.models.hf_reference import left_padded_batch, make_checkpoint, torch_logits
from tests.tiny_models import tiny_moe_config

# Measured: float32 logits agree with transformers to ~3e-6 (the dense families' margin).
PARITY_ATOL = 2e-5


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _route_oracle(logits: np.ndarray, k: int, normalise: bool) -> tuple[np.ndarray, np.ndarray]:
    """Per token: the k most probable experts, of equal probabilities the lower id first."""
    probs = _softmax(logits.astype(np.float64))
    ids = np.stack([sorted(range(len(p)), key=lambda e: (-p[e], e))[:k] for p in probs])
    top = np.take_along_axis(probs, ids, axis=1)
    return (top / top.sum(1, keepdims=True) if normalise else top), ids


@pytest.mark.parametrize("normalise", [False, True])
def test_the_router_picks_the_k_most_probable_experts_lower_id_first_on_ties(normalise):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(40, 6)).astype(np.float32)
    logits[:10, 3] = logits[:10, 1]  # ties: experts 1 and 3 equally probable
    logits[10:20] = 0.0  # every expert equally probable
    weights, experts = route(jnp.asarray(logits), 3, normalise)
    want_w, want_ids = _route_oracle(logits, 3, normalise)
    np.testing.assert_array_equal(np.asarray(experts), want_ids)
    np.testing.assert_allclose(np.asarray(weights), want_w, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(experts)[10:20], np.tile([0, 1, 2], (10, 1)))
    if normalise:
        np.testing.assert_allclose(np.asarray(weights).sum(1), 1.0, rtol=1e-6)


def test_the_grouped_experts_equal_each_tokens_experts_run_one_by_one():
    """Tokens sorted by expert through ragged matmuls, then back: each token's output is
    Σ_j w_j · down_e(silu(gate_e x) · up_e x) over its own experts, whatever their order,
    and an expert no token chose (here 5) contributes nothing."""
    config = tiny_moe_config()
    experts = Experts(config, jnp.float32, nnx.Rngs(0))
    rng = np.random.default_rng(1)
    x = rng.normal(size=(9, 16)).astype(np.float32)
    ids = np.array([[0, 1], [1, 0], [2, 2], [4, 0], [3, 1], [0, 4], [2, 3], [1, 1], [4, 2]], np.int32)
    w = rng.uniform(size=(9, 2)).astype(np.float32)
    got = np.asarray(experts(jnp.asarray(x), jnp.asarray(w), jnp.asarray(ids)))
    gate, up, down = (np.asarray(p[...], np.float64) for p in (experts.gate_proj, experts.up_proj, experts.down_proj))

    def silu(a):
        return a / (1 + np.exp(-a))

    want = np.zeros((9, 16))
    for t in range(9):
        for j in range(2):
            e = ids[t, j]
            want[t] += w[t, j] * (silu(x[t] @ gate[e]) * (x[t] @ up[e])) @ down[e]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_the_sparse_block_is_the_router_then_the_experts():
    config = tiny_moe_config(norm_topk_prob=True)
    block = SparseMoE(config, jnp.float32, nnx.Rngs(2))
    x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 5, 16)), jnp.float32)
    flat = x.reshape(10, 16)
    weights, experts = route(block.router_logits(flat), 2, True)
    want = block.experts(flat, weights, experts).reshape(2, 5, 16)
    np.testing.assert_array_equal(np.asarray(block(x)), np.asarray(want))


def _torch_router_ties(model: torch.nn.Module) -> int:
    """Tokens of the left-padded batch whose k-th and (k+1)-th router probabilities tie in
    layer 0 (so a tie-break decides which expert runs)."""
    captured = []
    gate = model.model.layers[0].mlp.gate
    handle = gate.register_forward_hook(lambda _m, _i, out: captured.append(out[0]))
    ids, mask, positions = left_padded_batch()
    torch_logits(model, ids, mask, positions)
    handle.remove()
    probs = torch.softmax(captured[0].float(), -1).numpy()
    top = -np.sort(-probs, axis=1)
    k = model.config.num_experts_per_tok
    return int(np.sum(top[:, k - 1] == top[:, k]))


ROUTINGS = {
    # layer 0 sparse (4 experts, 2 a token), layer 1 dense; the chosen probabilities as they are
    "k2-of-4": dict(),
    # renormalised, 3 of 5 experts, every layer sparse
    "k3-of-5-normalised": dict(num_experts=5, num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[]),
    # layer 1 sparse only (decoder_sparse_step 2), one expert a token
    "k1-step2": dict(num_experts_per_tok=1, decoder_sparse_step=2, mlp_only_layers=[]),
}


@pytest.mark.parametrize("routing", ROUTINGS.values(), ids=ROUTINGS.keys())
def test_logits_match_transformers(tmp_path, routing):
    reference = make_checkpoint("qwen3_moe", tmp_path / "hf", **routing)
    ids, mask, positions = left_padded_batch()
    want = torch_logits(reference, ids, mask, positions)
    model = from_pretrained(tmp_path / "hf")
    c = model.config
    assert (c.model_type, c.num_experts_per_tok, c.norm_topk_prob) == (
        "qwen3_moe",
        routing.get("num_experts_per_tok", 2),
        routing.get("norm_topk_prob", False),
    )
    sparse = [isinstance(layer.mlp, SparseMoE) for layer in model.layers]
    assert sparse == [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in reference.model.layers]
    got = np.asarray(model(jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(mask)))
    valid = mask.astype(bool)
    np.testing.assert_allclose(got[valid], want[valid], atol=PARITY_ATOL, rtol=0)


def test_logits_match_transformers_when_the_router_ties_at_the_kth_expert(tmp_path):
    """Expert 2 a copy of expert 1, router row and weights (an upcycled MoE starts so): for
    every token the two tie, and where they tie for the last place a tie-break picks one.
    Ours takes the lower id (:func:`jax.lax.top_k`); transformers takes what ``torch.topk``
    returns, whose order among equal values is not defined (on this CPU it took the higher
    id for most of these tokens). With equal experts either choice gives the same output, so
    the logits must agree: neither both copies chosen nor a weight lost at a tie."""
    reference = make_checkpoint("qwen3_moe", tmp_path / "hf")
    with torch.no_grad():
        mlp = reference.model.layers[0].mlp
        for weight in (mlp.gate.weight, mlp.experts.gate_up_proj, mlp.experts.down_proj):
            weight[2].copy_(weight[1])
    reference.save_pretrained(tmp_path / "hf")
    assert _torch_router_ties(reference) > 10
    ids, mask, positions = left_padded_batch()
    want = torch_logits(reference, ids, mask, positions)
    model = from_pretrained(tmp_path / "hf")
    got = np.asarray(model(jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(mask)))
    valid = mask.astype(bool)
    np.testing.assert_allclose(got[valid], want[valid], atol=PARITY_ATOL, rtol=0)


def test_save_pretrained_writes_one_tensor_per_expert_that_transformers_loads(tmp_path):
    make_checkpoint("qwen3_moe", tmp_path / "hf", seed=1, norm_topk_prob=True)
    model = from_pretrained(tmp_path / "hf")
    save_pretrained(model, tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["norm_topk_prob"] is True
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", local_files_only=True).eval()
    ids, mask, positions = left_padded_batch(seed=2)
    ours = np.asarray(model(jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(mask)))
    valid = mask.astype(bool)
    np.testing.assert_allclose(torch_logits(reloaded, ids, mask, positions)[valid], ours[valid], atol=PARITY_ATOL)
    again = from_pretrained(tmp_path / "ours")
    np.testing.assert_array_equal(np.asarray(again(jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(mask))), ours)


def test_a_missing_expert_tensor_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    make_checkpoint("qwen3_moe", tmp_path / "hf")
    file = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.0.mlp.experts.3.up_proj.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"no tensor 'model.layers.0.mlp.experts.3.up_proj.weight'.*num_experts"):
        from_pretrained(tmp_path / "hf")


def test_the_kv_cache_forward_equals_the_plain_forward():
    """The sampler's path (:meth:`Decoder.forward` over a KV cache, a prompt then one token
    at a time) runs the same experts as the learner's."""
    from asyncopd_jax.models.decoder import Decoder

    model = Decoder(tiny_moe_config(num_experts_per_tok=3, norm_topk_prob=True), rngs=nnx.Rngs(4))
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, 50, size=(2, 7)), jnp.int32)
    whole = np.asarray(model.logits(model.hidden_states(tokens)))
    cache = KVCache.empty(model.config, 2, 7, jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(7), (2, 7))
    valid = jnp.ones((2, 7), bool)
    hidden, cache = model.forward(tokens[:, :4], positions[:, :4], valid[:, :4], cache, 0)
    steps = [hidden]
    for t in range(4, 7):
        hidden, cache = model.forward(tokens[:, t : t + 1], positions[:, t : t + 1], valid[:, t : t + 1], cache, t)
        steps.append(hidden)
    np.testing.assert_allclose(np.asarray(model.logits(jnp.concatenate(steps, 1))), whole, atol=2e-5)


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        (dict(num_experts_per_tok=7), "num_experts_per_tok = 7 is invalid; allowed: 1 … num_experts (6)"),
        (dict(moe_intermediate_size=0), "moe_intermediate_size = 0 and decoder_sparse_step = 1 are invalid"),
    ],
)
def test_bad_expert_settings_are_one_line(fields, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        tiny_moe_config(**fields)


def test_a_bad_expert_field_in_config_json_names_the_file(tmp_path):
    make_checkpoint("qwen3_moe", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": 9}))
    with pytest.raises(ValueError, match=r"config.json: num_experts_per_tok = 9 is invalid; allowed: 1 … num_experts"):
        from_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "moe_intermediate_size": -1}))
    with pytest.raises(ValueError, match=r"config.json: moe_intermediate_size = -1 is invalid; allowed: a positive"):
        from_pretrained(tmp_path / "hf")


def test_a_dense_family_with_experts_is_refused():
    with pytest.raises(ValueError, match="num_experts = 4 is invalid for qwen3; allowed: 0"):
        DecoderConfig("qwen3", 10, 8, 8, 1, 2, 1, 4, num_experts=4)


def test_jit_and_grad_flow_through_the_experts():
    """The learner differentiates through the router's weights and the experts' (ragged
    matmuls have gradients): every expert that a token chose gets one."""
    model = SparseMoE(tiny_moe_config(), jnp.float32, nnx.Rngs(6))
    graphdef, state = nnx.split(model)
    x = jnp.asarray(np.random.default_rng(7).normal(size=(12, 16)), jnp.float32)

    @jax.jit
    def loss(state):
        return jnp.sum(nnx.merge(graphdef, state)(x) ** 2)

    grads = jax.grad(loss)(state)
    _, chosen = route(model.router_logits(x), 2, False)
    used = np.unique(np.asarray(chosen))
    per_expert = np.abs(np.asarray(grads["experts"]["gate_proj"][...])).sum(axis=(1, 2))
    assert np.all(per_expert[used] > 0) and np.all(per_expert[np.setdiff1d(np.arange(6), used)] == 0)
    assert np.abs(np.asarray(grads["gate"]["kernel"][...])).sum() > 0


def _mesh(data: int, fsdp: int, tensor: int):
    from asyncopd_jax.config import MeshConfig
    from asyncopd_jax.learner import make_mesh

    return make_mesh(MeshConfig(data=data, fsdp=fsdp, tensor=tensor))


# (data, fsdp, tensor), experts, and how many experts a device holds: fsdp splits the experts
# where it divides them (expert parallelism), else each expert's H as a dense MLP's (FSDP)
MESHES = {
    "ep8": ((1, 8, 1), 8, 1),
    "ep2-tensor2-data2": ((2, 2, 2), 8, 4),
    "ep4-tensor2": ((1, 4, 2), 8, 2),
    "fsdp8-experts-not-divisible": ((1, 8, 1), 6, 6),
    "tensor8-no-ep": ((1, 1, 8), 8, 8),
}


@pytest.mark.parametrize("mesh_shape, experts, held", MESHES.values(), ids=MESHES.keys())
@pytest.mark.parametrize("rows, columns", [(4, 6), (3, 5)])  # 15 tokens: padded to the batch shards
def test_a_model_on_a_mesh_gives_the_one_device_logits(mesh_shape, experts, held, rows, columns):
    """Experts split over fsdp (expert parallelism: tokens to their experts by all-to-all),
    or laid out as dense MLPs where fsdp does not divide them: the single device's logits."""
    from asyncopd_jax.models.decoder import Decoder
    from asyncopd_jax.models.partitioning import mesh_context, parameter_shardings

    model = Decoder(tiny_moe_config(num_experts=experts, num_experts_per_tok=3), rngs=nnx.Rngs(8))
    graphdef, state = nnx.split(model)
    tokens = jnp.asarray(np.random.default_rng(9).integers(0, 50, size=(rows, columns)), jnp.int32)
    want = np.asarray(model(tokens))
    mesh = _mesh(*mesh_shape)
    placed = jax.device_put(state, parameter_shardings(state, mesh))
    assert placed["layers"][0]["mlp"]["experts"]["gate_proj"].addressable_shards[0].data.shape[0] == held
    forward = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
    with mesh_context(mesh):
        got = forward(placed, tokens)
        hlo = forward.lower(placed, tokens).as_text()
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)
    # per sparse layer, only where experts are split: one of counts, and on the CPU two padded
    # trips of rows, each with its slices' offsets (padded_all_to_all)
    assert hlo.count("all_to_all") == (5 * 2 if held < experts else 0), hlo.count("all_to_all")


def _fake_ragged_all_to_all(operand, output, *slices, axis_name):
    """jax.lax.ragged_all_to_all, which XLA:CPU cannot compile, as padded_all_to_all (itself
    checked against the documented semantics below), room for a whole operand per slice."""
    from asyncopd_jax.models.moe import Slices, padded_all_to_all

    return padded_all_to_all(operand, output, Slices(*slices), axis_name, operand.shape[0])


@pytest.mark.parametrize("routed", [False, True], ids=["padded", "routed"])
@pytest.mark.parametrize(
    "mesh_shape, chunk", [((1, 4, 2), 512), ((2, 4, 1), 512), ((2, 2, 2), 512), ((1, 8, 1), 512), ((1, 8, 1), 1)]
)
def test_expert_parallel_drops_no_token_whatever_the_routing(mesh_shape, chunk, routed, monkeypatch):
    """The worst case of the all-to-all's buffers: every token of every device routed to
    experts 6 and 7, which one device holds; then random routing. Equal to the grouped
    experts on one device, a device's tokens in one exchange or in two (1 token each: 16
    tokens on 8 devices), by either exchange: padded chunks (the CPU's), or the routed rows
    of TPU and GPU, its ragged all-to-all stood in for by the padded one."""
    from asyncopd_jax.models import moe
    from asyncopd_jax.models.moe import _grouped, expert_parallel

    monkeypatch.setattr(moe, "EXPERT_CHUNK_TOKENS", chunk)
    trips = []
    if routed:
        monkeypatch.setattr(moe, "routed_exchange", lambda platform: True)
        counted = lambda *a, **kw: trips.append(1) or _fake_ragged_all_to_all(*a, **kw)  # noqa: E731
        monkeypatch.setattr(jax.lax, "ragged_all_to_all", counted)
    from asyncopd_jax.models.partitioning import mesh_context, parameter_shardings

    rng = np.random.default_rng(12)
    e, h, i, t = 8, 16, 12, 16
    gate, up = (jnp.asarray(rng.normal(size=(e, h, i)), jnp.float32) for _ in range(2))
    down = jnp.asarray(rng.normal(size=(e, i, h)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(t, h)), jnp.float32)
    weights = jnp.asarray(rng.uniform(size=(t, 2)), jnp.float32)
    for chosen in (np.tile([7, 6], (t, 1)), rng.integers(0, e, size=(t, 2))):
        chosen = jnp.asarray(chosen, jnp.int32)
        want = _grouped(x, weights, chosen, gate, up, down)
        mesh = _mesh(*mesh_shape)
        tree = {"experts": {"gate_proj": gate, "up_proj": up, "down_proj": down}}
        placed = jax.device_put(tree, parameter_shardings(tree, mesh))["experts"]
        stacked = [placed[name] for name in ("gate_proj", "up_proj", "down_proj")]
        with mesh_context(mesh):
            forward = jax.jit(lambda *args: expert_parallel(*args))  # traced anew: not the other exchange's
            got = forward(x, weights, chosen, *stacked)
            hlo = forward.lower(x, weights, chosen, *stacked).as_text()
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
        assert hlo.count("all_to_all") == 5, hlo.count("all_to_all")  # the table, then two trips of two
    assert len(trips) == (2 * 2 if routed else 0)  # the two trips, traced once per routing


def _ragged_all_to_all_oracle(args: list[tuple[np.ndarray, ...]]) -> list[np.ndarray]:
    """``jax.lax.ragged_all_to_all`` over ``D`` devices as its documentation states it (JAX
    0.10.2, jax/_src/lax/parallel.py): device ``i``'s ``args[i] = (operand, output,
    input_offsets, send_sizes, output_offsets, recv_sizes)``, one slice per device; device
    ``j`` sends ``operand[input_offsets[d]:][:send_sizes[d]]`` to device ``d``, which writes it
    at ``j``'s ``output_offsets[d]``, and expects ``recv_sizes[j]`` rows from ``j``."""
    n = len(args)
    results = [np.array(a[1], copy=True) for a in args]
    for j, (operand, _, in_off, send, out_off, _) in enumerate(args):
        for d in range(n):
            assert send[d] == args[d][5][j], "send_sizes must equal the receivers' recv_sizes"
            results[d][out_off[d] : out_off[d] + send[d]] = operand[in_off[d] : in_off[d] + send[d]]
    return results


def test_the_ragged_all_to_all_oracle_gives_the_documented_example():
    """The example of jax.lax.ragged_all_to_all's docstring: [1, 3, 0, 0] and [2, 2, 4, 0]."""
    i32 = lambda *v: np.asarray(v, np.int32)  # noqa: E731
    got = _ragged_all_to_all_oracle(
        [
            (i32(1, 2, 2), i32(0, 0, 0, 0), i32(0, 1), i32(1, 2), i32(0, 0), i32(1, 1)),
            (i32(3, 4, 0), i32(0, 0, 0, 0), i32(0, 1), i32(1, 1), i32(1, 2), i32(2, 1)),
        ]
    )
    np.testing.assert_array_equal(got[0], [1, 3, 0, 0])
    np.testing.assert_array_equal(got[1], [2, 2, 4, 0])


def _routings(devices: int, e: int, a: int, rng) -> dict[str, np.ndarray]:
    """Each device's ``a`` assignments (expert ids) for a few routings of ``e`` experts."""
    return {
        "random": rng.integers(0, e, size=(devices, a)),
        "worst: all to the last device": np.full((devices, a), e - 1),
        "device 0 sends to itself only": np.vstack([np.zeros((1, a), int), rng.integers(0, e, size=(devices - 1, a))]),
        "one device each": np.repeat(((np.arange(devices) + 1) % devices * (e // devices))[:, None], a, axis=1),
    }


@pytest.mark.parametrize("devices", [2, 4, 8])  # the expert devices of the meshes above
def test_exchange_slices_take_each_row_to_its_experts_device_and_back_to_its_place(devices):
    """Through the documented ragged all-to-all (the oracle): after the first trip, receiver
    ``d`` holds sender ``s``'s rows for it at ``s·a``, in the sender's sorted order, and zeros
    past them; after the second, each sender holds every one of its rows, as the receiver
    that has its expert changed it, where the row left from. At four routings, the worst
    (every row on one device) among them."""
    from asyncopd_jax.models.moe import exchange_slices

    e, a, h = 2 * devices, 6, 3
    rng = np.random.default_rng(devices)
    for name, chosen in _routings(devices, e, a, rng).items():
        owner = np.sort(chosen, axis=1) // (e // devices)  # [D, a]: each sorted row's device
        to = np.stack([np.bincount(o, minlength=devices) for o in owner])  # [sender, receiver]
        starts = np.cumsum(to, axis=1) - to
        rows = rng.normal(size=(devices, a, h))  # each device's rows, sorted by expert
        trips = [
            exchange_slices(*(jnp.asarray(v, jnp.int32) for v in (to[d], to[:, d], starts[:, d], d)), a)
            for d in range(devices)
        ]
        there = [tuple(np.asarray(v) for v in trip[0]) for trip in trips]
        back = [tuple(np.asarray(v) for v in trip[1]) for trip in trips]
        held = _ragged_all_to_all_oracle([(rows[d], np.zeros((devices * a, h)), *there[d]) for d in range(devices)])
        for d in range(devices):
            for s in range(devices):
                chunk = held[d][s * a : (s + 1) * a]
                np.testing.assert_array_equal(chunk[: to[s, d]], rows[s][owner[s] == d], err_msg=name)
                assert not chunk[to[s, d] :].any(), name
        changed = [held[d] + 100.0 * (d + 1) * (held[d] != 0) for d in range(devices)]  # marks who ran it
        returned = _ragged_all_to_all_oracle([(changed[d], np.zeros((a, h)), *back[d]) for d in range(devices)])
        for s in range(devices):
            np.testing.assert_allclose(returned[s], rows[s] + 100.0 * (owner[s] + 1)[:, None], err_msg=name)


@pytest.mark.parametrize("mesh_shape", [(1, 2, 4), (1, 4, 2), (1, 8, 1)])
def test_padded_all_to_all_is_the_documented_ragged_all_to_all(mesh_shape):
    """On the CPU's all_to_all, any ragged arguments (slices anywhere in the operand, written
    anywhere in the output, some empty) give the oracle's result on every device."""
    from jax.sharding import NamedSharding, PartitionSpec

    from asyncopd_jax.models.moe import Slices, padded_all_to_all

    mesh = _mesh(*mesh_shape)
    n, capacity, rows_in, rows_out = mesh_shape[1], 3, 7, 3 * mesh_shape[1] + 2
    rng = np.random.default_rng(n)
    sizes = rng.integers(0, capacity + 1, size=(n, n))  # [sender, receiver]
    sizes[0, 1 % n] = 0
    in_off = np.stack([rng.integers(0, rows_in - s + 1) for s in sizes])  # anywhere, overlaps allowed
    # each receiver's slots for its senders: disjoint, in a random order, with gaps
    out_off = np.zeros((n, n), int)
    for d in range(n):
        at = 1
        for s in rng.permutation(n):
            out_off[s, d], at = at, at + sizes[s, d] + int(rng.integers(0, 2))
    operand = rng.normal(size=(n, rows_in, 2)).astype(np.float32)
    output = rng.normal(size=(n, rows_out, 2)).astype(np.float32)
    args = [(operand[d], output[d], in_off[d], sizes[d], out_off[d], sizes[:, d]) for d in range(n)]
    want = _ragged_all_to_all_oracle(args)

    split = PartitionSpec("fsdp")
    stacked = [np.stack(v) for v in zip(*args, strict=True)]
    stacked = [v.astype(np.int32) if v.dtype.kind == "i" else v for v in stacked]
    placed = [jax.device_put(jnp.asarray(v), NamedSharding(mesh, split)) for v in stacked]

    def local(operand, output, *slices):
        got = padded_all_to_all(operand[0], output[0], Slices(*(v[0] for v in slices)), ("fsdp",), capacity)
        return got[None]

    got = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=split, out_specs=split))(*placed)
    np.testing.assert_array_equal(np.asarray(got), np.stack(want))


@pytest.mark.parametrize("engine", ["static", "continuous"])
def test_either_engine_samples_a_moe_model_and_the_scorer_scores_its_answers(engine):
    """A Qwen3-MoE model through each sampler (the static engine's KV cache, the continuous
    engine's paged one) and the teacher scorer (a whole-sequence forward): the behaviour
    log-probs are the model's own log-probs of the tokens it drew, and so are the scores of
    the same model as the teacher."""
    from asyncopd_jax.models.decoder import Decoder
    from asyncopd_jax.sampling import SamplingParams, make_sampler
    from asyncopd_jax.teacher import ScoringParams, TeacherScorer

    model = Decoder(tiny_moe_config(num_experts_per_tok=2, norm_topk_prob=True), rngs=nnx.Rngs(10))
    graphdef, state = nnx.split(model)
    params = SamplingParams(temperature=1.0, max_new_tokens=8, chunk_steps=4)
    if engine == "continuous":
        params = dataclasses.replace(params, engine="continuous", slots=2, page_size=4)
    prompts = [[5, 9, 3], [7, 1], [2, 8, 4, 6]]
    batch = make_sampler(graphdef, params).generate(state, prompts, jax.random.key(11))
    cache = TeacherScorer(model, ScoringParams()).score(batch)
    mask = np.asarray(batch.response_mask)
    assert mask.sum() > 12
    np.testing.assert_allclose(np.asarray(cache.token_logp)[mask], np.asarray(batch.behavior_logp)[mask], atol=2e-5)


def test_the_shipped_qwen3_30b_a3b_has_the_model_cards_parameter_counts():
    """Qwen's model card for Qwen3-30B-A3B-Instruct-2507: 30.5B parameters in total, 3.3B
    activated, 29.9B without the embeddings (input and output, untied). The abstract model
    of the shipped config.json has those counts, so layers, experts and widths are its."""
    import math

    from asyncopd_jax.models.config import read_hf_config
    from asyncopd_jax.models.decoder import abstract_decoder
    from asyncopd_jax.scale.learner_inputs import ARCHITECTURES

    c, _ = read_hf_config(ARCHITECTURES / "Qwen3-30B-A3B-Instruct-2507")
    _, params = abstract_decoder(c, "bfloat16")
    total = sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(params))
    idle = c.num_hidden_layers * (c.num_experts - c.num_experts_per_tok) * 3 * c.hidden_size * c.moe_intermediate_size
    assert round(total / 1e9, 1) == 30.5
    assert 3.3 <= (total - idle) / 1e9 < 3.4  # 3.35: the card truncates
    assert round((total - 2 * c.vocab_size * c.hidden_size) / 1e9, 1) == 29.9


def test_the_exchange_bytes_are_the_routed_rows_or_whole_chunks_there_and_back_in_every_sparse_layer():
    """Qwen3-30B-A3B (48 sparse layers, k 8, H 2,048) on 4 expert devices, 65,536 bf16 tokens
    a device, each layer's rows sent there and back. Routed: 3 in 4 of its rows leave it at
    uniform routing; where one device holds every expert chosen, it receives and returns the
    3 others' rows. Padded: 3 of 4 chunks of [4,096, 2,048] per 512 tokens, whatever the routing."""
    from asyncopd_jax.models.config import read_hf_config
    from asyncopd_jax.models.moe import ExchangeBytes, exchange_bytes
    from asyncopd_jax.scale.learner_inputs import ARCHITECTURES
    from asyncopd_jax.scale.plan import teacher_exchange_bytes

    config, _ = read_hf_config(ARCHITECTURES / "Qwen3-30B-A3B-Instruct-2507")
    rows = 48 * 2 * 65536 * 8 * 2048 * 2  # a device's rows of H bf16, there and back, in 48 layers
    padded = 48 * 2 * (65536 // 512) * 3 * 512 * 8 * 2048 * 2  # D − 1 chunks of c·k rows
    assert exchange_bytes(config, 65536, 4, 2, routed=True) == ExchangeBytes(rows * 3 / 4, 3 * rows)
    assert exchange_bytes(config, 65536, 4, 2, routed=False) == ExchangeBytes(padded, padded) == (3 * rows, 3 * rows)
    assert exchange_bytes(config, 65536, 1, 2, routed=True) == (0.0, 0.0)
    every_other = dataclasses.replace(config, decoder_sparse_step=2)  # layers 1, 3, …: 24 sparse
    assert exchange_bytes(every_other, 65536, 4, 2, routed=True) == (rows * 3 / 8, 3 * rows / 2)
    # on a mesh: the expert devices are those fsdp puts the experts on, the tokens each's
    # share; CPU devices stand for a plan's GPUs, whose exchange is routed
    assert teacher_exchange_bytes(config, _mesh(2, 4, 1), 8 * 65536, 2) == (rows * 3 / 4, 3 * rows)
    assert teacher_exchange_bytes(config, _mesh(1, 1, 8), 8 * 65536, 2) == (0.0, 0.0)  # experts not split
    dense, _ = read_hf_config(ARCHITECTURES / "Qwen3-8B")
    assert teacher_exchange_bytes(dense, _mesh(2, 4, 1), 8 * 65536, 2) == (0.0, 0.0)


def test_the_exchange_is_routed_on_tpu_and_gpu_only():
    from asyncopd_jax.models.moe import routed_exchange

    assert [routed_exchange(p) for p in ("tpu", "gpu", "cuda", "rocm", "cpu")] == [True] * 4 + [False]
