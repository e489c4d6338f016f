"""One config for the decoder family, read from a Hugging Face ``config.json`` by
``transformers.AutoConfig`` (:func:`read_hf_config`), then checked.

Llama, Qwen2 and Qwen3 share one architecture (pre-norm, RoPE, grouped-query attention,
SwiGLU MLP) and differ in a few switches, which is all this dataclass records:

| family | ``model_type`` | differences |
|---|---|---|
| Llama 2/3 | ``llama`` | optional Llama 3 RoPE scaling; optional ``attention_bias`` / ``mlp_bias`` |
| Qwen2 / 2.5 | ``qwen2`` | bias on q, k, v projections |
| Qwen3 (dense) | ``qwen3`` | RMSNorm on each head of q and k before RoPE; explicit ``head_dim`` |
| Qwen3-MoE | ``qwen3_moe`` | Qwen3's, but the MLP of a sparse layer is a mixture of experts |

A Qwen3-MoE layer is sparse when :meth:`DecoderConfig.is_sparse` says so (every
``decoder_sparse_step``-th layer not in ``mlp_only_layers``); :mod:`asyncopd_jax.models.moe`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
_ROPE_TYPES = ("default", "llama3")
_ROPE_REQUIRED = {"llama3": ("factor", "original_max_position_embeddings")}
# Fields without which the shapes of the model are unknown.
_REQUIRED_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_OPTIONAL_INTS = ("num_key_value_heads", "head_dim", "max_position_embeddings")
# Mixture-of-experts switches: in another family's config they describe layers its decoder
# lacks (Qwen3-MoE's are read; Mixtral's and DeepSeek's are other families).
_MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok")
_MOE_INTS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step")
_ACTIVATIONS = ("silu", "swish")  # the SwiGLU gate; transformers treats both names alike
_ROPE_FIELDS = ("rope_scaling", "rope_parameters")  # transformers >= 5 writes the latter


def _check_rope(scaling: dict[str, Any], field: str) -> None:
    """Refuse a RoPE scaling :func:`rope_inverse_frequencies` does not implement (it would
    otherwise compute unscaled frequencies), or one lacking the values it needs."""
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in _ROPE_TYPES:
        raise ValueError(
            f"{field}.rope_type = {rope_type!r} is not implemented; allowed: {', '.join(_ROPE_TYPES)} (or no {field})"
        )
    missing = [k for k in _ROPE_REQUIRED.get(rope_type, ()) if k not in scaling]
    if missing:
        raise ValueError(
            f"{field} (rope_type {rope_type!r}) lacks {', '.join(missing)}; allowed: an object with "
            f"{', '.join(_ROPE_REQUIRED[rope_type])}"
        )


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Hyper-parameters of a Llama / Qwen2 / Qwen3 / Qwen3-MoE decoder (names follow
    Hugging Face; the expert fields are Qwen3-MoE's, 0 / empty for the dense families)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Llama: q, k, v and o projections carry a bias
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    num_experts: int = 0  # E
    num_experts_per_tok: int = 0  # k
    moe_intermediate_size: int = 0  # an expert's width I
    norm_topk_prob: bool = False  # renormalise the k chosen probabilities to sum to 1
    decoder_sparse_step: int = 1  # layer l is sparse when (l + 1) % step == 0 …
    mlp_only_layers: tuple[int, ...] = ()  # … and l is not listed here

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {self.model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.rope_scaling is not None:
            _check_rope(self.rope_scaling, "rope_scaling")
        if self.model_type == "qwen3_moe":
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok = {self.num_experts_per_tok} is invalid; allowed: 1 … num_experts "
                    f"({self.num_experts})"
                )
            if self.moe_intermediate_size <= 0 or self.decoder_sparse_step <= 0:
                raise ValueError(
                    f"moe_intermediate_size = {self.moe_intermediate_size} and decoder_sparse_step = "
                    f"{self.decoder_sparse_step} are invalid; allowed: positive integers"
                )
        elif self.num_experts:
            raise ValueError(f"num_experts = {self.num_experts} is invalid for {self.model_type}; allowed: 0")

    def is_sparse(self, layer: int) -> bool:
        """Whether layer ``layer`` (from 0) has a mixture of experts for its MLP (transformers'
        ``Qwen3MoeDecoderLayer``'s rule)."""
        return (
            self.num_experts > 0 and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def qkv_bias(self) -> bool:
        """Qwen2 always biases q, k, v; Llama (and Qwen3) when ``attention_bias`` is set."""
        return self.model_type == "qwen2" or self.attention_bias

    @property
    def o_proj_bias(self) -> bool:
        """Llama's ``attention_bias`` covers o_proj too; Qwen2 biases only q, k, v."""
        return self.attention_bias and self.model_type in ("llama", "qwen3", "qwen3_moe")

    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalises each head of q and k (RMSNorm over D) before RoPE."""
        return self.model_type in ("qwen3", "qwen3_moe")

    def to_hf_dict(self, dtype: str = "float32") -> dict[str, Any]:
        """The ``config.json`` content ``transformers`` expects for this family."""
        out: dict[str, Any] = {
            "architectures": [_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": dtype,
            "use_cache": True,
        }
        if self.model_type == "llama":
            out["attention_bias"] = self.attention_bias
            out["mlp_bias"] = self.mlp_bias
        if self.model_type in ("qwen2", "qwen3", "qwen3_moe"):
            out["use_sliding_window"] = False
        if self.model_type in ("qwen3", "qwen3_moe"):
            out["attention_bias"] = self.attention_bias
        if self.model_type == "qwen3_moe":
            out |= {
                "num_experts": self.num_experts,
                "num_experts_per_tok": self.num_experts_per_tok,
                "moe_intermediate_size": self.moe_intermediate_size,
                "norm_topk_prob": self.norm_topk_prob,
                "decoder_sparse_step": self.decoder_sparse_step,
                "mlp_only_layers": list(self.mlp_only_layers),
            }
        return out

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.eos_token_id
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)


def _check_file(raw: Any, source: Path) -> None:
    """What must be checked on the file itself, before ``transformers.AutoConfig`` reads it:
    a family AutoConfig would build another config class for (or refuse in a paragraph),
    fields it would fill in with its defaults (the model's shapes must come from the
    file), and types it would accept (transformers 4) or refuse in several lines (5)."""
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: expected a JSON object of model settings, found {type(raw).__name__}")
    model_type, arch = raw.get("model_type"), raw.get("architectures")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{source}: unsupported architecture: model_type={model_type!r} architectures={arch!r}; "
            f"allowed model_type: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    # Another head or body under a supported model_type (a classifier, an MoE variant)
    # has weights this decoder would not load.
    if arch is not None and (not isinstance(arch, list) or any(a != _ARCHITECTURES[model_type] for a in arch)):
        raise ValueError(
            f"{source}: architectures = {arch!r} is not supported for model_type {model_type!r}; "
            f"allowed: [{_ARCHITECTURES[model_type]!r}]"
        )
    for name in _REQUIRED_INTS:
        if name not in raw:
            raise ValueError(
                f"{source}: missing field {name!r} (a positive integer); is this the config.json "
                "of a Hugging Face model?"
            )
    for name in _REQUIRED_INTS + _OPTIONAL_INTS + (_MOE_INTS if model_type == "qwen3_moe" else ()):
        value = raw.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ValueError(f"{source}: {name} = {value!r} is invalid; allowed: a positive integer")
    for name in _ROPE_FIELDS:
        value = raw.get(name)
        if value is not None and not isinstance(value, dict):
            raise ValueError(
                f"{source}: {name} = {value!r} is invalid; allowed: null or an object with rope_type "
                f"{' or '.join(_ROPE_TYPES)}"
            )


def _auto_config(directory: Path, source: Path) -> dict[str, Any]:
    """``config.json`` as ``transformers.AutoConfig`` reads it (defaults filled in, legacy
    keys translated), as a dict; never downloads, never runs the checkpoint's own code."""
    from transformers import AutoConfig  # the training stack's; imported when a model is loaded

    try:
        config = AutoConfig.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)
    except Exception as err:  # transformers raises many types, some multi-line
        message = err.args[0] if isinstance(err, KeyError) and err.args else err  # a KeyError's str is quoted
        cause = " ".join(str(message).split()) or type(err).__name__  # one line for the CLI
        raise ValueError(f"{source}: transformers.AutoConfig refuses it: {cause}") from None
    return config.to_dict()


def _rope(fields: dict[str, Any], source: Path, field: str) -> tuple[float, dict[str, Any] | None]:
    """``(θ, the RoPE scaling or None)`` of AutoConfig's fields: transformers 5 nests both in
    ``rope_parameters``, 4 keeps ``rope_theta`` and ``rope_scaling`` apart. ``field``: the
    key the file used, for the error."""
    params = fields.get("rope_parameters")
    scaling: dict[str, Any] | None
    if isinstance(params, dict):
        theta, scaling = params.get("rope_theta"), {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta, scaling = fields.get("rope_theta"), fields.get("rope_scaling")
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type"))
        scaling = None if rope_type in (None, "default") else {**scaling, "rope_type": rope_type}
    if scaling is not None:
        try:
            _check_rope(scaling, field)
        except ValueError as err:
            raise ValueError(f"{source}: {err}") from None
    return (10_000.0 if theta is None else theta), scaling


def _check_fields(fields: dict[str, Any], source: Path) -> None:
    """Settings this decoder would otherwise silently ignore, as AutoConfig read them:
    mixture-of-experts layers, another activation, sliding-window attention."""
    for name in _MOE_FIELDS:
        if fields.get(name) and fields["model_type"] != "qwen3_moe":
            raise ValueError(
                f"{source}: {name} = {fields[name]!r} describes mixture-of-experts layers, which a "
                f"{fields['model_type']} decoder does not have; allowed: absent, null or 0 (qwen3_moe has experts)"
            )
    act = fields.get("hidden_act") or "silu"
    if act not in _ACTIVATIONS:
        raise ValueError(f"{source}: hidden_act = {act!r} is not implemented; allowed: {', '.join(_ACTIVATIONS)}")
    model_type, max_positions = fields["model_type"], fields["max_position_embeddings"]
    # Qwen2/Qwen3 apply the window only with use_sliding_window (transformers drops it
    # otherwise); a Llama config that carries one was trained with a window no Llama
    # implementation applies. A window covering the whole context changes nothing.
    window = fields.get("sliding_window")
    if model_type != "llama" and not fields.get("use_sliding_window"):
        window = None
    if isinstance(window, int) and window < max_positions:
        switch = "use_sliding_window = true with " if model_type != "llama" else ""
        fix = (
            "set use_sliding_window to false"
            if model_type != "llama"
            else "set sliding_window to null if the model was trained with full attention"
        )
        raise ValueError(
            f"{source}: {switch}sliding_window = {window} (< max_position_embeddings = {max_positions}) asks for "
            f"sliding-window attention, which this decoder does not implement; allowed: a window of at least "
            f"max_position_embeddings, or none ({fix})"
        )


def _moe_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-MoE's expert fields as AutoConfig filled them in (transformers 5 names
    ``num_experts`` ``num_local_experts`` in its dict)."""
    layers = fields.get("mlp_only_layers") or []
    return {
        "num_experts": fields.get("num_experts", fields.get("num_local_experts")),
        "num_experts_per_tok": fields["num_experts_per_tok"],
        "moe_intermediate_size": fields["moe_intermediate_size"],
        "norm_topk_prob": bool(fields.get("norm_topk_prob")),
        "decoder_sparse_step": fields.get("decoder_sparse_step") or 1,
        "mlp_only_layers": tuple(int(layer) for layer in layers),
    }


def read_hf_config(directory: str | Path) -> tuple[DecoderConfig, str | None]:
    """The decoder config of a local Hugging Face checkpoint directory, and the dtype its
    weights were saved in (``torch_dtype`` / ``dtype``; None: not recorded).

    ``config.json`` is read by ``transformers.AutoConfig`` (local files only, no remote
    code), so that its defaults and legacy keys mean what they mean to transformers; our
    checks come after it, each a one-line ``ValueError`` naming the file, the field, its
    value and what is allowed. Refused: another architecture, mixture-of-experts fields
    outside Qwen3-MoE, sliding-window attention, a RoPE scaling this decoder does not implement, another
    activation. Fields that do not change the forward pass (``torch_dtype``,
    ``initializer_range``, ``use_cache``, …) are ignored.

    Raises:
      FileNotFoundError: ``config.json`` is missing.
      ValueError: it is not valid JSON, or describes a model this decoder does not implement.
    """
    directory = Path(directory)
    source = directory / "config.json"
    if not source.is_file():
        raise FileNotFoundError(
            f"missing model config: {source} does not exist; a Hugging Face checkpoint directory needs its config.json"
        )
    raw = read_json(source)  # transformers' error for broken JSON names neither line nor column
    _check_file(raw, source)
    fields = _auto_config(directory, source)
    _check_fields(fields, source)
    model_type, heads = fields["model_type"], fields["num_attention_heads"]
    rope_theta, rope_scaling = _rope(fields, source, "rope_parameters" if "rope_parameters" in raw else "rope_scaling")
    try:
        config = DecoderConfig(
            model_type=model_type,
            vocab_size=fields["vocab_size"],
            hidden_size=fields["hidden_size"],
            intermediate_size=fields["intermediate_size"],
            num_hidden_layers=fields["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=fields.get("num_key_value_heads") or heads,
            head_dim=fields.get("head_dim") or fields["hidden_size"] // heads,
            rms_norm_eps=fields["rms_norm_eps"],
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=fields["max_position_embeddings"],
            tie_word_embeddings=bool(fields.get("tie_word_embeddings")),
            # transformers' Qwen2 always biases q, k, v and never o_proj, and no Qwen MLP
            # has a bias: both fields are ignored there, as transformers ignores them.
            attention_bias=bool(fields.get("attention_bias")) if model_type != "qwen2" else False,
            mlp_bias=bool(fields.get("mlp_bias")) if model_type == "llama" else False,
            bos_token_id=fields.get("bos_token_id"),
            eos_token_id=fields.get("eos_token_id"),
            pad_token_id=fields.get("pad_token_id"),
            **(_moe_fields(fields) if model_type == "qwen3_moe" else {}),
        )
    except ValueError as err:  # the dataclass's own checks, which cannot know the file
        raise ValueError(f"{source}: {err}") from None
    return config, raw.get("torch_dtype") or raw.get("dtype")


def read_json(path: Path) -> Any:
    """Parse a JSON file; a one-line ``ValueError`` naming the file if it is not JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        where = f" (line {err.lineno}, column {err.colno}: {err.msg})" if isinstance(err, json.JSONDecodeError) else ""
        raise ValueError(
            f"{path} is not valid JSON{where}; it is truncated or corrupt: re-download or re-save it"
        ) from None


def rope_inverse_frequencies(config: DecoderConfig) -> np.ndarray:
    """``[head_dim / 2]`` inverse frequencies ``θ^(−2i/d)``, with Llama 3 scaling if set.

    Llama 3 scaling keeps high frequencies (wavelength < L/high_factor), divides low
    ones (wavelength > L/low_factor) by ``factor``, and interpolates smoothly between.
    """
    d = config.head_dim
    # fp32 throughout, as transformers computes it, so that positions agree to the last bit.
    inv = 1.0 / (np.float32(config.rope_theta) ** (np.arange(0, d, 2).astype(np.float32) / np.float32(d)))
    inv = inv.astype(np.float32)
    scaling = config.rope_scaling
    if scaling is None or scaling.get("rope_type") in (None, "default"):
        return inv.astype(np.float32)
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    smooth = (old_len / wavelen - low) / (high - low)
    interpolated = (1 - smooth) * inv / factor + smooth * inv
    scaled = np.where(wavelen > old_len / low, inv / factor, inv)
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(medium, interpolated, scaled).astype(np.float32)
