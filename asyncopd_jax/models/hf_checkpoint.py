"""Load and save decoders in the Hugging Face layout (``config.json`` + ``*.safetensors``).

No PyTorch: tensors are read and written with ``safetensors``' JAX backend, bf16
included. Our parameter paths follow Hugging Face module names, so the mapping is
mechanical: ``layers.3.self_attn.q_proj.kernel`` ↔ ``model.layers.3.self_attn.q_proj.weight``
(transposed: torch stores ``[out, in]``), ``embed_tokens.embedding`` ↔
``model.embed_tokens.weight``, ``lm_head.kernel`` ↔ ``lm_head.weight``. A mixture of experts'
weights are stacked over the experts here and one tensor per expert there:
``layers.3.mlp.experts.gate_proj [E, H, I]`` ↔ ``model.layers.3.mlp.experts.{e}.gate_proj.weight
[I, H]`` for e = 0 … E − 1 (the layout of Qwen3-MoE's checkpoints, which transformers reads).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from safetensors import SafetensorError, safe_open
from safetensors.flax import save_file

from asyncopd_jax.models.config import DecoderConfig, read_hf_config, read_json
from asyncopd_jax.models.decoder import Decoder, abstract_decoder
from asyncopd_jax.models.lora import merge_adapters
from asyncopd_jax.models.partitioning import parameter_spec

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Tensors some checkpoints carry that the model recomputes: ignored on load.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _hf_names(path: tuple, shape: tuple[int, ...]) -> tuple[list[str], bool, bool]:
    """Our parameter path → (its Hugging Face tensor names, whether each is transposed,
    whether they are stacked on our axis 0): one name, or for stacked experts
    (``…experts.gate_proj``, ``shape [E, …]``) one per expert, each the transpose of its slice."""
    *module, leaf = (str(p) for p in path)
    if module[-1] == "experts":
        return [f"model.{'.'.join(module)}.{e}.{leaf}.weight" for e in range(shape[0])], True, True
    prefix = "" if module[0] == "lm_head" else "model."
    transpose = leaf == "kernel"
    leaf = {"kernel": "weight", "embedding": "weight"}.get(leaf, leaf)
    return [prefix + ".".join([*module, leaf])], transpose, False


def _unreadable(file: Path, err: Exception) -> ValueError:
    """The error for a safetensors file that cannot be read: its path, the reason, the fix."""
    return ValueError(f"{file} is truncated or corrupt ({err}); re-download or re-save it")


def _open(file: Path, stack: contextlib.ExitStack) -> Any:
    """``safe_open`` whose failure (a bad header, a file shorter than its header says) is a
    ``ValueError`` naming the file, not safetensors' bare ``SafetensorError``."""
    try:
        return stack.enter_context(safe_open(file, framework="numpy"))  # host arrays: placed by the caller
    except SafetensorError as err:
        raise _unreadable(file, err) from None


def _tensor_files(path: Path) -> dict[str, Path]:
    """Tensor name → the safetensors file that holds it (single file or sharded index)."""
    index = path / INDEX_FILE
    if index.is_file():
        raw = read_json(index)
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(weight_map, dict):
            raise ValueError(f'{index} has no "weight_map" object; re-download or re-save the checkpoint')
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
    with contextlib.ExitStack() as stack:
        return {name: single for name in _open(single, stack).keys()}  # noqa: SIM118 - a handle, not a dict


def _unused(names: set[str], config: DecoderConfig) -> list[str]:
    """Checkpoint tensors the model has no parameter for, except those it may safely drop."""
    # A tied model reuses the embedding as its head: a stored copy of the head is redundant.
    redundant = {"lm_head.weight"} if config.tie_word_embeddings else set()
    return sorted(n for n in names if n not in redundant and not n.endswith(_IGNORED_SUFFIXES))


def read_lm_head(path: str | Path, vocab_limit: int | None = None, dtype: str | None = None) -> np.ndarray:
    """A checkpoint's LM head alone, ``[H, V]`` on the host (V = ``vocab_limit`` or the
    config's vocabulary): ``lm_head.weight`` transposed, or the embedding's for a model
    with tied embeddings; no other tensor is read (a learner that applies a teacher's
    head to the teacher's hidden states holds that head, not the teacher)."""
    path = Path(path)
    config, saved_dtype = read_hf_config(path)
    name = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    files = _tensor_files(path)
    if name not in files:
        raise ValueError(f"{path} has no tensor {name} (the LM head of its config.json)")
    with contextlib.ExitStack() as stack:
        weight = _open(files[name], stack).get_tensor(name)  # [V, H]
    limit = config.vocab_size if vocab_limit is None else vocab_limit
    return np.ascontiguousarray(weight[:limit].T).astype(jnp.dtype(dtype or saved_dtype or "float32"))


def head_digest(head: np.ndarray) -> str:
    """The SHA-256 of an LM head ``[H, V]`` as :func:`read_lm_head` gives it: of its dtype's
    name, its shape and its C-order bytes (bfloat16 as its bits). Two heads with one digest
    compute the same log-probs; a served teacher's ``/v1/models`` card states its head's, and
    a learner holding a copy checks it before trusting it."""
    digest = hashlib.sha256(f"{head.dtype}:{list(head.shape)}:".encode())
    digest.update(np.ascontiguousarray(head).view(np.uint8).data)
    return digest.hexdigest()


def from_pretrained(
    path: str | Path,
    dtype: jnp.dtype | str | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> Decoder:
    """Load a Llama / Qwen2 / Qwen3 / Qwen3-MoE decoder from a local Hugging Face directory.

    Args:
      path: directory with ``config.json`` and ``model.safetensors`` (or shards listed in
        ``model.safetensors.index.json``). Nothing is downloaded.
      dtype: parameter dtype (``"float32"``, ``"bfloat16"``, …); default: the
        checkpoint's own ``torch_dtype``, else fp32.
      mesh: the mesh to place the weights on, each as the partition rules lay it out
        (:mod:`asyncopd_jax.models.partitioning`): each tensor is read on the host and put
        straight into its shards, never whole on one device. Default: the default device.

    Returns:
      The model.

    Raises:
      FileNotFoundError: the directory, ``config.json`` or a weight file is missing.
      ValueError: unsupported architecture or setting in ``config.json``, a truncated or
        corrupt file, or weights that do not match ``config.json`` (a tensor missing, of
        the wrong shape, or left over); the file and tensor are named.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"model directory not found: {path}; expected a Hugging Face checkpoint directory "
            "(config.json + *.safetensors)"
        )
    config, saved_dtype = read_hf_config(path)
    dtype = jnp.dtype(dtype or saved_dtype or "float32")

    graphdef, state = abstract_decoder(config, dtype)
    files = _tensor_files(path)
    loaded = {}
    used: set[str] = set()
    with contextlib.ExitStack() as stack:
        handles = {f: _open(f, stack) for f in sorted(set(files.values()))}
        for key, variable in nnx.to_flat_state(state):
            names, transpose, stacked = _hf_names(key, variable.shape)
            shape = tuple(variable.shape[1:] if stacked else variable.shape)  # of each tensor
            tensors = []
            for name in names:
                if name not in files:
                    raise ValueError(
                        f"{path}: the weights have no tensor {name!r}, which config.json ({config.model_type}) "
                        "needs; weights and config.json do not match (check num_hidden_layers, "
                        "tie_word_embeddings, attention_bias, mlp_bias, num_experts, mlp_only_layers)"
                    )
                try:
                    tensor = handles[files[name]].get_tensor(name)
                except SafetensorError as err:
                    raise _unreadable(files[name], err) from None
                expected = shape[::-1] if transpose else shape
                if tuple(tensor.shape) != expected:
                    raise ValueError(
                        f"{files[name]}: tensor {name!r} has shape {list(tensor.shape)}, but "
                        f"{path / 'config.json'} implies "
                        f"{list(expected)}; weights and config.json belong to different models"
                    )
                tensors.append(np.asarray(tensor.T if transpose else tensor, dtype))
                used.add(name)
            value = np.stack(tensors) if stacked else tensors[0]
            loaded[key] = (
                jax.device_put(value, NamedSharding(mesh, parameter_spec(key, value.shape, mesh)))
                if mesh is not None
                else jnp.asarray(value)
            )
    # A tensor nothing reads means config.json describes a different model (fewer layers,
    # no biases where the weights have them): loading would silently drop it.
    unused = _unused(set(files) - used, config)
    if unused:
        more = f" and {len(unused) - 5} more" if len(unused) > 5 else ""
        raise ValueError(
            f"{path}: the weights hold tensor(s) that config.json does not account for: "
            f"{', '.join(map(repr, unused[:5]))}{more}; weights and config.json do not match (check "
            "num_hidden_layers, attention_bias, mlp_bias, num_experts, mlp_only_layers)"
        )
    flat = [(key, variable.replace(loaded[key])) for key, variable in nnx.to_flat_state(state)]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def hf_tensors(state: nnx.State, dtype: jnp.dtype | str) -> dict[str, jax.Array]:
    """``state``'s weights by their Hugging Face names, in ``dtype``, laid out as transformers
    stores them (``[out, in]`` kernels, one tensor per expert)."""
    tensors: dict[str, jax.Array] = {}
    for key, variable in nnx.to_flat_state(state):
        names, transpose, stacked = _hf_names(key, variable.shape)
        value = jnp.asarray(variable[...], dtype)
        for name, part in zip(names, value if stacked else [value]):
            tensors[name] = jnp.asarray(part.T if transpose else part)  # contiguous copy
    return tensors


def save_pretrained(
    model: Decoder, path: str | Path, *, dtype: jnp.dtype | str | None = None, max_shard_bytes: int = 5 * 2**30
) -> None:
    """Write ``model`` in the Hugging Face layout, loadable by ``transformers``.

    Args:
      model: the decoder (a LoRA student's adapters folded into its weights).
      path: output directory (created).
      dtype: tensor dtype on disk; default: the model's parameter dtype.
      max_shard_bytes: above this, weights are split into shards with an index file.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dtype = jnp.dtype(dtype or model.dtype)
    model = merge_adapters(model)  # a LoRA student is written merged, as transformers loads it
    config = model.config
    (path / "config.json").write_text(json.dumps(config.to_hf_dict(dtype.name), indent=2) + "\n")

    tensors = hf_tensors(nnx.state(model, nnx.Param), dtype)

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
