"""LoRA adapters (asyncopd_jax/models/lora.py): a NumPy oracle of the adapted projection,
the targets, dropout, merging, the checkpoint written merged, and the partition rules."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from asyncopd_jax.config import ConfigError, load_config
from asyncopd_jax.models import Decoder, from_pretrained, save_pretrained
from asyncopd_jax.models.lora import (
    LoRALinear,
    LoRAParams,
    WholeParam,
    adapters,
    add_adapters,
    has_adapters,
    join,
    merge_adapters,
    merged_state,
    split_adapters,
    with_dropout,
)
from asyncopd_jax.models.partitioning import parameter_spec
from tests.tiny_models import tiny_decoder, tiny_lora_decoder, tiny_moe_config

PARAMS = LoRAParams(rank=3, alpha=5.0)  # α / r = 5/3: a scale of 1 or 2 would hide a wrong one
TOKENS = jnp.asarray([[5, 9, 3, 17, 22, 4], [8, 8, 30, 2, 11, 6]])


def test_an_adapted_projection_is_its_base_plus_the_scaled_low_rank_path():
    model = tiny_lora_decoder(PARAMS)
    path, module = adapters(model)[0]
    x = np.asarray(jax.random.normal(jax.random.key(1), (2, 4, module.kernel.shape[0])))
    w, a, b = (np.asarray(v[...], np.float64) for v in (module.kernel, module.lora_a, module.lora_b))
    want = x @ w + (5.0 / 3.0) * (x @ a) @ b  # the oracle: y = x W + (α / r) (x A) B
    np.testing.assert_allclose(np.asarray(module(jnp.asarray(x))), want, rtol=1e-5, atol=1e-5)
    assert a.shape == (w.shape[0], 3) and b.shape == (3, w.shape[1])


def test_a_bfloat16_base_takes_float32_adapters_and_computes_in_bfloat16():
    """The frozen base may be bf16; the trained adapters stay fp32 (AdamW's small steps on
    bf16 weights would round away), cast to the base's dtype in the forward."""
    base = tiny_decoder(0, scale=0.7)
    nnx.update(base, jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), nnx.state(base)))
    model = add_adapters(base, PARAMS, nnx.Rngs(0))
    _, module = adapters(model)[0]
    assert module.kernel[...].dtype == jnp.bfloat16
    assert module.lora_a[...].dtype == module.lora_b[...].dtype == jnp.float32
    module.lora_b[...] = 0.3 * jax.random.normal(jax.random.key(5), module.lora_b.shape)
    x = jax.random.normal(jax.random.key(1), (2, module.kernel.shape[0])).astype(jnp.bfloat16)
    y = module(x)
    bf = lambda v: v[...].astype(jnp.bfloat16)  # noqa: E731
    want = jnp.dot(x, bf(module.kernel)) + (5.0 / 3.0 * jnp.dot(jnp.dot(x, bf(module.lora_a)), bf(module.lora_b)))
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want.astype(jnp.bfloat16), np.float32), rtol=2e-2)


def test_fresh_adapters_compute_exactly_what_the_base_does():
    base = tiny_decoder(0, scale=0.7)
    want = np.asarray(base(TOKENS))
    for init in ("kaiming", "gaussian"):
        model = add_adapters(tiny_decoder(0, scale=0.7), LoRAParams(rank=4, init=init), nnx.Rngs(0))
        assert len(adapters(model)) == 14  # 7 projections × 2 layers
        np.testing.assert_array_equal(np.asarray(model(TOKENS)), want)
        a = np.asarray(adapters(model)[0][1].lora_a[...])
        assert np.abs(a).max() > 0 and not np.asarray(adapters(model)[0][1].lora_b[...]).any()


def test_the_inits_have_their_documented_scales():
    model = add_adapters(tiny_decoder(0), LoRAParams(rank=64, init="kaiming"), nnx.Rngs(0))
    a = np.asarray(adapters(model)[0][1].lora_a[...])  # down_proj: in = 64
    assert np.abs(a).max() <= 1 / 8 and np.abs(a).max() > 0.9 / 8  # uniform in ±1/√in
    model = add_adapters(tiny_decoder(0), LoRAParams(rank=64, init="gaussian"), nnx.Rngs(0))
    a = np.asarray(adapters(model)[0][1].lora_a[...])
    assert abs(a.std() - 1 / 64) < 0.1 / 64  # normal, standard deviation 1/r


def test_targets_match_a_projections_name_or_its_whole_path():
    model = add_adapters(tiny_decoder(0), LoRAParams(rank=2, targets=("q_proj", "v_proj")), nnx.Rngs(0))
    assert [p for p, _ in adapters(model)] == [
        "layers.0.self_attn.q_proj",
        "layers.0.self_attn.v_proj",
        "layers.1.self_attn.q_proj",
        "layers.1.self_attn.v_proj",
    ]
    model = add_adapters(tiny_decoder(0), LoRAParams(rank=2, targets=(r"layers\.1\..*_proj",)), nnx.Rngs(0))
    assert len(adapters(model)) == 7 and all(p.startswith("layers.1.") for p, _ in adapters(model))


@pytest.mark.parametrize(
    "targets, message",
    [
        (("q_proj", "qproj"), "'qproj' matches no projection of the student"),
        (("lm_head",), "matches no projection"),  # the tiny model ties its head: no lm_head module
        (("embed_tokens",), "'embed_tokens' matches embed_tokens, which cannot take an adapter"),
    ],
)
def test_a_target_that_cannot_take_an_adapter_is_refused_naming_it(targets, message):
    with pytest.raises(ValueError, match=message):
        add_adapters(tiny_decoder(0), LoRAParams(rank=2, targets=targets), nnx.Rngs(0))


def test_a_mixtures_router_and_experts_are_refused():
    moe = Decoder(tiny_moe_config(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"'gate' matches layers\.0\.mlp\.gate, which cannot take an adapter"):
        add_adapters(moe, LoRAParams(rank=2, targets=("gate",)), nnx.Rngs(0))
    with pytest.raises(ValueError, match="'experts' matches"):
        add_adapters(
            Decoder(tiny_moe_config(), rngs=nnx.Rngs(0)), LoRAParams(rank=2, targets=("experts",)), nnx.Rngs(0)
        )
    # the default targets put adapters on a mixture's attention only (its experts are no nnx.Linear)
    adapted = add_adapters(Decoder(tiny_moe_config(), rngs=nnx.Rngs(0)), LoRAParams(rank=2), nnx.Rngs(0))
    assert {p.rsplit(".", 1)[1] for p, _ in adapters(adapted)} == {"q_proj", "k_proj", "v_proj", "o_proj"}


@pytest.mark.parametrize(
    "field, value, allowed",
    [("rank", -1, ">= 0"), ("alpha", 0, "> 0"), ("dropout", 1.0, r"in \[0, 1\)"), ("targets", "[]", "at least one")],
)
def test_a_bad_lora_setting_is_one_line_naming_its_field(field, value, allowed):
    with pytest.raises(ConfigError, match=rf"student\.lora\.{field} = .* is invalid; allowed: {allowed}"):
        load_config("demo", [f"student.lora.{field}={value}"])


def test_merging_folds_each_adapter_into_its_base_and_leaves_the_model_as_it_was():
    model = tiny_lora_decoder(PARAMS)
    want = np.asarray(model(TOKENS))
    merged = merge_adapters(model)
    assert not adapters(merged) and len(adapters(model)) == 14  # a copy; the original keeps its adapters
    np.testing.assert_allclose(np.asarray(merged(TOKENS)), want, atol=2e-5)
    path, module = adapters(model)[0]
    kernel = np.asarray(module.kernel[...], np.float64)
    delta = (5.0 / 3.0) * np.asarray(module.lora_a[...], np.float64) @ np.asarray(module.lora_b[...], np.float64)
    head, name = path.rsplit(".", 1)
    plain = getattr(merged.layers[0].mlp, name)
    np.testing.assert_allclose(np.asarray(plain.kernel[...]), kernel + delta, rtol=1e-6, atol=1e-6)


def test_a_lora_student_is_written_merged_as_transformers_loads_it(tmp_path):
    model = tiny_lora_decoder(PARAMS)
    save_pretrained(model, tmp_path)
    loaded = from_pretrained(tmp_path)
    assert not adapters(loaded)
    np.testing.assert_allclose(np.asarray(loaded(TOKENS)), np.asarray(model(TOKENS)), atol=2e-5)


def test_split_adapters_parts_the_trained_from_the_frozen_and_join_undoes_it():
    graphdef, state = nnx.split(tiny_lora_decoder(PARAMS))
    trained, frozen = split_adapters(state)
    assert has_adapters(state) and not has_adapters(frozen)
    names = {".".join(map(str, k)) for k, _ in nnx.to_flat_state(trained)}
    assert len(names) == 28 and all(n.endswith(("lora_a", "lora_b")) for n in names)
    model = nnx.merge(graphdef, join(trained, frozen))
    np.testing.assert_array_equal(np.asarray(model(TOKENS)), np.asarray(tiny_lora_decoder(PARAMS)(TOKENS)))
    # without adapters every weight is trained
    _, plain = nnx.split(tiny_decoder(0))
    everything, nothing = split_adapters(plain)
    assert len(jax.tree_util.tree_leaves(everything)) == len(jax.tree_util.tree_leaves(plain))
    assert not jax.tree_util.tree_leaves(nothing)


SAVED = LoRAParams(rank=3, alpha=5.0, modules_to_save=("embed_tokens", r".*_layernorm"))


def test_modules_to_save_train_whole_ship_with_the_adapters_and_stay_through_a_merge():
    model = tiny_lora_decoder(SAVED)
    whole = {".".join(map(str, k)) for k, _ in nnx.to_flat_state(nnx.state(model, WholeParam))}
    assert whole == {"embed_tokens.embedding"} | {
        f"layers.{i}.{n}_layernorm.weight" for i in range(2) for n in ("input", "post_attention")
    }
    graphdef, state = nnx.split(model)
    trained, frozen = split_adapters(state)
    names = {".".join(map(str, k)) for k, _ in nnx.to_flat_state(trained)}
    assert names == whole | {n for n in names if n.endswith(("lora_a", "lora_b"))} and len(names) == 28 + 5
    assert not {".".join(map(str, k)) for k, _ in nnx.to_flat_state(frozen)} & whole
    # moved whole weights change the model, and its merged state keeps them
    before = np.asarray(model(TOKENS))
    nnx.update(model, jax.tree_util.tree_map(lambda x: x + 0.2, nnx.state(model, WholeParam)))
    want = np.asarray(model(TOKENS))
    assert np.abs(want - before).max() > 1e-2
    merged = merged_state(nnx.state(model), SAVED.scale)
    assert not has_adapters(merged) and nnx.to_flat_state(nnx.state(merged, WholeParam))
    np.testing.assert_allclose(np.asarray(merge_adapters(model)(TOKENS)), want, atol=2e-5)
    plain = nnx.merge(nnx.split(tiny_decoder(0))[0], merged)  # what a merging sampler decodes
    np.testing.assert_allclose(np.asarray(plain(TOKENS)), want, atol=2e-5)


@pytest.mark.parametrize(
    "patterns, message",
    [
        (("nope",), "'nope' matches no module of the student"),
        (("layers",), "'layers' matches layers, which holds an adapter"),
        (("up_proj",), r"'up_proj' matches layers\.0\.mlp\.up_proj, which holds an adapter"),
    ],
)
def test_a_module_to_save_that_matches_nothing_or_holds_an_adapter_is_refused(patterns, message):
    with pytest.raises(ValueError, match=rf"student\.lora\.modules_to_save: {message}"):
        tiny_lora_decoder(LoRAParams(rank=2, modules_to_save=patterns))


def test_a_module_to_save_trains_its_submodules_weights_too():
    """``self_attn`` with adapters on the MLP alone: its projections and q / k norms, nested
    one module down, all train whole."""
    model = tiny_lora_decoder(LoRAParams(rank=2, targets=("up_proj",), modules_to_save=(r"layers\.0\.self_attn",)))
    whole = {".".join(map(str, k)) for k, _ in nnx.to_flat_state(nnx.state(model, WholeParam))}
    names = ("q_proj.kernel", "k_proj.kernel", "v_proj.kernel", "o_proj.kernel", "q_norm.weight", "k_norm.weight")
    assert whole == {f"layers.0.self_attn.{n}" for n in names}


@pytest.mark.parametrize(
    "sets, message",
    [
        (["student.lora.modules_to_save=[norm]"], "set with rank 0"),
        (["student.lora.rank=2", "student.lora.modules_to_save=['(norm']"], "'\\(norm' is not a regular expression"),
    ],
)
def test_bad_modules_to_save_are_one_line_naming_the_field(sets, message):
    with pytest.raises(ConfigError, match=rf"student\.lora\.modules_to_save: {message}"):
        load_config("demo", sets)


def test_dropout_acts_on_the_adapters_path_only_and_only_with_a_key():
    params = LoRAParams(rank=3, alpha=5.0, dropout=0.5)
    model = tiny_lora_decoder(params)
    _, module = adapters(model)[0]
    x = jax.random.normal(jax.random.key(1), (64, module.kernel.shape[0]))
    plain = np.asarray(module(x))
    np.testing.assert_array_equal(np.asarray(tiny_lora_decoder(PARAMS).layers[0].mlp.down_proj(x)), plain)
    graphdef, state = nnx.split(model)

    def forward(key):
        return with_dropout(nnx.merge(graphdef, state), key).layers[0].mlp.down_proj(x)

    one, again, other = (np.asarray(forward(jax.random.key(k))) for k in (7, 7, 8))
    np.testing.assert_array_equal(one, again)  # a key is a mask
    assert np.abs(one - other).max() > 1e-3 and np.abs(one - plain).max() > 1e-3
    # the base path is untouched: with B = 0 dropout changes nothing
    for _, m in adapters(model):
        m.lora_b[...] = jnp.zeros_like(m.lora_b[...])
    graphdef, state = nnx.split(model)
    np.testing.assert_allclose(np.asarray(forward(jax.random.key(7))), np.asarray(x @ module.kernel[...]), atol=1e-6)
    # unbiased: the mean over masks is the adapter's output without dropout
    for i, (_, m) in enumerate(adapters(model)):
        m.lora_b[...] = 0.3 * jax.random.normal(jax.random.key(100 + i), m.lora_b.shape)
    graphdef, state = nnx.split(model)
    mean = np.mean([np.asarray(forward(jax.random.key(k))) for k in range(400)], axis=0)
    np.testing.assert_allclose(mean, plain, atol=0.15 * np.abs(plain - np.asarray(x @ module.kernel[...])).max())


def test_adapters_lie_as_their_base_kernels_on_a_mesh():
    mesh = jax.sharding.AbstractMesh((1, 2, 2), ("data", "fsdp", "tensor"))
    for name, kernel, a, b in [
        ("q_proj", P("fsdp", "tensor"), P("fsdp"), P(None, "tensor")),
        ("o_proj", P("tensor", "fsdp"), P("tensor"), P(None, "fsdp")),
        ("down_proj", P("tensor", "fsdp"), P("tensor"), P(None, "fsdp")),
    ]:
        assert parameter_spec(("layers", 0, "self_attn", name, "kernel"), (32, 32), mesh) == kernel
        assert parameter_spec(("layers", 0, "self_attn", name, "lora_a", "value"), (32, 4), mesh) == a
        assert parameter_spec(("layers", 0, "self_attn", name, "lora_b"), (4, 32), mesh) == b
    assert isinstance(adapters(tiny_lora_decoder(PARAMS))[0][1], LoRALinear)
