"""Adapters exported in PEFT's layout (asyncopd_jax/models/lora_checkpoint.py), loaded by
``peft`` on ``transformers``' PyTorch model: its logits are ours (fp32, within 1e-4), with
α ≠ r, for adapters on every projection and on a subset named by path."""

from __future__ import annotations

import json

import jax
import numpy as np
import peft
import pytest
import torch
import transformers
from flax import nnx

from asyncopd_jax.models import from_pretrained
from asyncopd_jax.models.lora import LoRAParams, WholeParam, adapters, add_adapters, merge_adapters
from asyncopd_jax.models.lora_checkpoint import CONFIG_FILE, save_adapters
from tests.models.hf_reference import make_checkpoint

TOKENS = np.asarray([[1, 5, 9, 3, 17, 22, 4, 60], [1, 8, 8, 30, 2, 11, 6, 90]])


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny random Qwen3 (untied, with q/k norms) saved by transformers."""
    path = tmp_path_factory.mktemp("base")
    make_checkpoint("qwen3", path)
    return path


@pytest.mark.parametrize(
    "params, targets",
    [
        (LoRAParams(rank=4, alpha=12.0), ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]),
        pytest.param(  # CI time: the second step
            LoRAParams(rank=2, alpha=3.0, targets=(r"layers\.1\.self_attn\.(q|v)_proj",)),
            ["model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj"],
            marks=pytest.mark.extended,
        ),
    ],
    ids=["every_projection", "by_path"],
)
def test_peft_loads_the_exported_adapters_and_computes_our_logits(base, tmp_path, params, targets):
    model = add_adapters(from_pretrained(base), params, nnx.Rngs(0))
    for i, (_, module) in enumerate(adapters(model)):  # a fresh B is zero: it would hide a wrong A
        module.lora_b[...] = 0.5 * jax.random.normal(jax.random.key(i), module.lora_b.shape)
    save_adapters(model, tmp_path, params, base_model=str(base))
    config = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert config["target_modules"] == targets and config["r"] == params.rank and config["lora_alpha"] == params.alpha

    torch_base = transformers.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    with torch.no_grad():
        plain = torch_base(torch.as_tensor(TOKENS)).logits.numpy()
        adapted = peft.PeftModel.from_pretrained(torch_base, tmp_path).eval()
        theirs = adapted(torch.as_tensor(TOKENS)).logits.numpy()
    ours = np.asarray(model(TOKENS))
    assert np.abs(theirs - plain).max() > 0.05  # the adapters change the logits: loading them matters
    np.testing.assert_allclose(theirs, ours, atol=1e-4)
    np.testing.assert_allclose(np.asarray(merge_adapters(model)(TOKENS)), theirs, atol=1e-4)


def test_a_model_without_adapters_has_none_to_save(base, tmp_path):
    with pytest.raises(ValueError, match="no LoRA adapters to save"):
        save_adapters(from_pretrained(base), tmp_path, LoRAParams())


@pytest.mark.parametrize(
    "tied, params, saved",
    [
        (
            True,
            LoRAParams(rank=4, alpha=12.0, modules_to_save=("embed_tokens", ".*norm")),
            ["model.embed_tokens", "model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm"]
            + ["model.layers.0.self_attn.k_norm", "model.layers.0.self_attn.q_norm"],
        ),
        pytest.param(  # CI time: the second step
            False,
            LoRAParams(rank=2, alpha=3.0, modules_to_save=("lm_head", r"layers\.1\.input_layernorm")),
            None,
            marks=pytest.mark.extended,
        ),
    ],
    ids=["tied_embedding_and_norms", "untied_head_by_path"],
)
def test_peft_loads_the_modules_trained_whole_as_modules_to_save(tmp_path, tied, params, saved):
    """Weights trained whole beside the adapters (``modules_to_save``) export as PEFT saves
    them: peft on transformers then computes our logits, a tied head following its embedding."""
    base = tmp_path / "base"
    make_checkpoint("qwen3", base, tied=tied)
    model = add_adapters(from_pretrained(base), params, nnx.Rngs(0))
    for i, (_, module) in enumerate(adapters(model)):
        module.lora_b[...] = 0.5 * jax.random.normal(jax.random.key(i), module.lora_b.shape)
    whole = nnx.state(model, WholeParam)
    nnx.update(model, jax.tree_util.tree_map(lambda x: x + 0.3 * jax.random.normal(jax.random.key(7), x.shape), whole))
    save_adapters(model, tmp_path / "adapter", params, base_model=str(base))
    config = json.loads((tmp_path / "adapter" / CONFIG_FILE).read_text())
    assert config["ensure_weight_tying"] is tied
    if saved is not None:  # every layer's norms, the final norm and the embedding
        layers = {name.replace("layers.0.", f"layers.{i}.") for name in saved for i in range(2)}
        assert config["modules_to_save"] == sorted(layers | {"model.norm"})
    else:
        assert config["modules_to_save"] == ["lm_head", "model.layers.1.input_layernorm"]

    torch_base = transformers.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    with torch.no_grad():
        adapted = peft.PeftModel.from_pretrained(torch_base, tmp_path / "adapter").eval()
        theirs = adapted(torch.as_tensor(TOKENS)).logits.numpy()
        adapted.base_model.disable_adapter_layers()  # the projections' adapters off, modules_to_save still on
        no_projections = adapted(torch.as_tensor(TOKENS)).logits.numpy()
    np.testing.assert_allclose(theirs, np.asarray(model(TOKENS)), atol=1e-4)
    np.testing.assert_allclose(np.asarray(merge_adapters(model)(TOKENS)), theirs, atol=1e-4)
    assert np.abs(theirs - no_projections).max() > 0.05
