"""Load and save decoders in the Hugging Face layout (``config.json`` + ``*.safetensors``).

No PyTorch: tensors are read and written with ``safetensors``' JAX backend, bf16
included. Our parameter paths follow Hugging Face module names, so the mapping is
mechanical: ``layers.3.self_attn.q_proj.kernel`` ↔ ``model.layers.3.self_attn.q_proj.weight``
(transposed: torch stores ``[out, in]``), ``embed_tokens.embedding`` ↔
``model.embed_tokens.weight``, ``lm_head.kernel`` ↔ ``lm_head.weight``.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.flax import save_file

from asyncopd_jax.models.config import DecoderConfig
from asyncopd_jax.models.decoder import Decoder

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Tensors some checkpoints carry that the model recomputes: ignored on load.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _hf_name(path: tuple) -> tuple[str, bool]:
    """Our parameter path → (Hugging Face tensor name, whether to transpose)."""
    *module, leaf = (str(p) for p in path)
    prefix = "" if module[0] == "lm_head" else "model."
    transpose = leaf == "kernel"
    leaf = {"kernel": "weight", "embedding": "weight"}.get(leaf, leaf)
    return prefix + ".".join([*module, leaf]), transpose


def _tensor_files(path: Path) -> dict[str, Path]:
    """Tensor name → the safetensors file that holds it (single file or sharded index)."""
    index = path / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = {name: path / file for name, file in weight_map.items()}
        missing = sorted({str(f) for f in files.values() if not f.is_file()})
        if missing:
            raise FileNotFoundError(f"{index} lists shard(s) that do not exist: {', '.join(missing)}")
        return files
    single = path / SINGLE_FILE
    if not single.is_file():
        raise FileNotFoundError(
            f"no weights in {path}: expected {SINGLE_FILE} or {INDEX_FILE} (found: "
            f"{', '.join(sorted(p.name for p in path.iterdir())) or 'nothing'})"
        )
    with safe_open(single, framework="flax") as f:
        return {name: single for name in f.keys()}


def from_pretrained(path: str | Path, dtype: jnp.dtype | str | None = None) -> Decoder:
    """Load a Llama / Qwen2 / Qwen3 decoder from a local Hugging Face directory.

    Args:
      path: directory with ``config.json`` and ``model.safetensors`` (or shards listed in
        ``model.safetensors.index.json``). Nothing is downloaded.
      dtype: parameter dtype (``"float32"``, ``"bfloat16"``, …); default: the
        checkpoint's own ``torch_dtype``, else fp32.

    Returns:
      The model, parameters on the default device.

    Raises:
      FileNotFoundError: the directory, ``config.json`` or a weight file is missing.
      ValueError: unsupported architecture, or a tensor missing or of the wrong shape
        (the tensor is named).
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory not found: {path}")
    raw = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else None
    if raw is None:
        raise FileNotFoundError(f"missing model config: {path / 'config.json'} does not exist")
    config = DecoderConfig.from_hf_dict(raw)
    dtype = jnp.dtype(dtype or raw.get("torch_dtype") or raw.get("dtype") or "float32")

    abstract = nnx.eval_shape(lambda: Decoder(config, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    files = _tensor_files(path)
    loaded = {}
    with contextlib.ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(f, framework="flax")) for f in set(files.values())}
        for key, variable in nnx.to_flat_state(state):
            name, transpose = _hf_name(key)
            if name not in files:
                raise ValueError(f"checkpoint {path} has no tensor {name!r} (needed for {config.model_type})")
            tensor = handles[files[name]].get_tensor(name)
            expected = tuple(variable.shape[::-1]) if transpose else tuple(variable.shape)
            if tuple(tensor.shape) != expected:
                raise ValueError(
                    f"tensor {name!r} has shape {list(tensor.shape)} in {files[name].name}, "
                    f"but config.json implies {list(expected)}"
                )
            loaded[key] = jnp.asarray(tensor.T if transpose else tensor, dtype)
    flat = [(key, variable.replace(loaded[key])) for key, variable in nnx.to_flat_state(state)]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def save_pretrained(
    model: Decoder, path: str | Path, *, dtype: jnp.dtype | str | None = None, max_shard_bytes: int = 5 * 2**30
) -> None:
    """Write ``model`` in the Hugging Face layout, loadable by ``transformers``.

    Args:
      model: the decoder.
      path: output directory (created).
      dtype: tensor dtype on disk; default: the model's parameter dtype.
      max_shard_bytes: above this, weights are split into shards with an index file.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dtype = jnp.dtype(dtype or model.dtype)
    config = model.config
    (path / "config.json").write_text(json.dumps(config.to_hf_dict(dtype.name), indent=2) + "\n")

    tensors: dict[str, jax.Array] = {}
    for key, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name, transpose = _hf_name(key)
        value = jnp.asarray(variable[...], dtype)
        tensors[name] = jnp.asarray(value.T if transpose else value)  # contiguous copy

    shards: list[dict[str, jax.Array]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].size * dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    for stale in list(path.glob("model*.safetensors")) + [path / INDEX_FILE]:
        stale.unlink(missing_ok=True)
    if len(shards) == 1:
        save_file(shards[0], path / SINGLE_FILE, metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, path / file, metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    total = int(sum(np.prod(t.shape) for t in tensors.values()) * dtype.itemsize)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
