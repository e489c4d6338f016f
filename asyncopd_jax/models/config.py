"""One config for the decoder family, read from a Hugging Face ``config.json``.

Llama, Qwen2 and Qwen3 share one architecture (pre-norm, RoPE, grouped-query attention,
SwiGLU MLP) and differ in a few switches, which is all this dataclass records:

| family | ``model_type`` | differences |
|---|---|---|
| Llama 2/3 | ``llama`` | optional Llama 3 RoPE scaling; optional ``attention_bias`` / ``mlp_bias`` |
| Qwen2 / 2.5 | ``qwen2`` | bias on q, k, v projections |
| Qwen3 (dense) | ``qwen3`` | RMSNorm on each head of q and k before RoPE; explicit ``head_dim`` |
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Hyper-parameters of a Llama / Qwen2 / Qwen3 decoder (names follow Hugging Face)."""

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
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type", "default") not in ("default", "llama3"):
            raise ValueError(
                f"unsupported rope_scaling {self.rope_scaling!r}; supported rope_type: default, llama3"
            )

    @property
    def qkv_bias(self) -> bool:
        """Qwen2 always biases q, k, v; Llama (and Qwen3) when ``attention_bias`` is set."""
        return self.model_type == "qwen2" or self.attention_bias

    @property
    def o_proj_bias(self) -> bool:
        """Llama's ``attention_bias`` covers o_proj too; Qwen2 biases only q, k, v."""
        return self.attention_bias and self.model_type in ("llama", "qwen3")

    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalises each head of q and k (RMSNorm over D) before RoPE."""
        return self.model_type == "qwen3"

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> DecoderConfig:
        """Build from a parsed Hugging Face ``config.json``."""
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            arch = raw.get("architectures")
            raise ValueError(
                f"unsupported architecture: model_type={model_type!r} architectures={arch!r}; "
                f"supported model_type: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if raw.get("use_sliding_window"):
            raise ValueError("config.json sets use_sliding_window=true, which this decoder does not implement")
        heads = raw["num_attention_heads"]
        rope_scaling = raw.get("rope_scaling")
        rope_theta = raw.get("rope_theta")
        rope_parameters = raw.get("rope_parameters")  # transformers >= 5 nests RoPE settings
        if isinstance(rope_parameters, dict):
            rope_theta = rope_parameters.get("rope_theta", rope_theta)
            if rope_parameters.get("rope_type", "default") != "default":
                rope_scaling = rope_parameters
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
            rope_scaling = None
        if rope_scaling is not None and "rope_type" not in rope_scaling:
            rope_scaling = {**rope_scaling, "rope_type": rope_scaling.get("type")}
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta if rope_theta is not None else 10_000.0,
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=raw.get("attention_bias", False) if model_type != "qwen2" else False,
            mlp_bias=raw.get("mlp_bias", False),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"),
            pad_token_id=raw.get("pad_token_id"),
        )

    @classmethod
    def from_json(cls, path: str | Path) -> DecoderConfig:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"missing model config: {path} does not exist")
        return cls.from_hf_dict(json.loads(path.read_text()))

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
        if self.model_type in ("qwen2", "qwen3"):
            out["use_sliding_window"] = False
        if self.model_type == "qwen3":
            out["attention_bias"] = self.attention_bias
        return out

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.eos_token_id
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)


def rope_inverse_frequencies(config: DecoderConfig) -> np.ndarray:
    """``[head_dim / 2]`` inverse frequencies ``θ^(−2i/d)``, with Llama 3 scaling if set.

    Llama 3 scaling keeps high frequencies (wavelength < L/high_factor), divides low
    ones (wavelength > L/low_factor) by ``factor``, and interpolates smoothly between.
    """
    d = config.head_dim
    # fp32 throughout, as transformers computes it, so that positions agree to the last bit.
    inv = (1.0 / (np.float32(config.rope_theta) ** (np.arange(0, d, 2).astype(np.float32) / np.float32(d))))
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
