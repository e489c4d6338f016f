"""Our decoder against the transformers PyTorch implementation, and the HF round trip."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import transformers

from asyncopd_jax.models import DecoderConfig, from_pretrained, save_pretrained
from tests.models.hf_reference import left_padded_batch, make_checkpoint, torch_logits

FAMILIES = ["llama", "qwen2", "qwen3"]
# Measured: float32 logits (order 4, positions up to 95) agree with transformers to ~4e-6.
PARITY_ATOL = 2e-5


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_on_padded_batch(tmp_path, family, tied):
    reference = make_checkpoint(family, tmp_path / "hf", tied=tied)
    ids, mask, positions = left_padded_batch()
    want = torch_logits(reference, ids, mask, positions)

    model = from_pretrained(tmp_path / "hf")
    assert model.config.model_type == family and model.config.tie_word_embeddings == tied
    got = np.asarray(model(jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(mask)))
    valid = mask.astype(bool)
    # float32 logits of order 4 agree to ~4e-6: 5x margin, and nothing relative.
    np.testing.assert_allclose(got[valid], want[valid], atol=PARITY_ATOL, rtol=0)
    # Default positions (cumsum of the mask) are the same explicit ones.
    np.testing.assert_allclose(
        np.asarray(model(jnp.asarray(ids), attention_mask=jnp.asarray(mask)))[valid], got[valid], atol=1e-6
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_save_pretrained_loads_in_transformers_with_same_logits(tmp_path, family):
    make_checkpoint(family, tmp_path / "hf", seed=1)
    model = from_pretrained(tmp_path / "hf")
    save_pretrained(model, tmp_path / "ours")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", local_files_only=True)
    reloaded.eval()
    ids, mask, positions = left_padded_batch(seed=2)
    ours = np.asarray(model(jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(mask)))
    valid = mask.astype(bool)
    np.testing.assert_allclose(
        torch_logits(reloaded, ids, mask, positions)[valid], ours[valid], atol=PARITY_ATOL, rtol=0
    )
    # And back into ours: bit-identical.
    again = from_pretrained(tmp_path / "ours")
    np.testing.assert_array_equal(np.asarray(again(jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(mask))), ours)


def test_sharded_checkpoint_and_bf16(tmp_path):
    make_checkpoint("qwen3", tmp_path / "hf", seed=3)
    model = from_pretrained(tmp_path / "hf")
    save_pretrained(model, tmp_path / "sharded", dtype="bfloat16", max_shard_bytes=20_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    bf16 = from_pretrained(tmp_path / "sharded")
    assert bf16.embed_tokens.embedding[...].dtype == jnp.bfloat16
    ids, mask, positions = left_padded_batch(seed=4)
    ref = np.asarray(model(jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(mask)))
    got = np.asarray(bf16(jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(mask)))
    assert got.dtype == np.float32
    valid = mask.astype(bool)
    assert np.abs(got[valid] - ref[valid]).max() < 0.1  # bf16 weights: close, not equal
    as_fp32 = from_pretrained(tmp_path / "sharded", dtype="float32")
    assert as_fp32.embed_tokens.embedding[...].dtype == jnp.float32


def test_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        from_pretrained(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json does not exist"):
        from_pretrained(tmp_path / "empty")

    make_checkpoint("llama", tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").rename(tmp_path / "hf" / "moved.bin")
    with pytest.raises(FileNotFoundError, match="expected model.safetensors or model.safetensors.index.json"):
        from_pretrained(tmp_path / "hf")

    make_checkpoint("qwen2", tmp_path / "bad")
    config = json.loads((tmp_path / "bad" / "config.json").read_text())
    (tmp_path / "bad" / "config.json").write_text(json.dumps({**config, "intermediate_size": 64}))
    with pytest.raises(ValueError, match=r"tensor 'model.layers.0.mlp.\w+_proj.weight' has shape \[(80, 48|48, 80)\]"):
        from_pretrained(tmp_path / "bad")
    (tmp_path / "bad" / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported architecture: model_type='gpt2'"):
        from_pretrained(tmp_path / "bad")
    with pytest.raises(ValueError, match="unsupported model_type"):
        DecoderConfig("mistral", 10, 8, 8, 1, 2, 1, 4)


def test_loading_works_with_torch_unavailable(tmp_path):
    """PyTorch is a test-only reference: the package loads and runs a model without it."""
    import subprocess
    import sys

    make_checkpoint("qwen3", tmp_path / "hf")
    code = f"""
import importlib.util, sys
# Make torch look uninstalled: availability probes find no spec, and imports fail.
_find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name.split(".")[0] == "torch" else _find_spec(name, *a)
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            raise ImportError("torch blocked for this test")
sys.meta_path.insert(0, NoTorch())
import jax.numpy as jnp
from asyncopd_jax.models import from_pretrained
model = from_pretrained({str(tmp_path / "hf")!r})
print(model(jnp.ones((1, 3), jnp.int32)).shape, "torch" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "(1, 3, 97) False"
