"""Tiny random Hugging Face checkpoints made with the PyTorch reference implementation.

Test-only: PyTorch is a test dependency, never a run-time one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers

TINY = dict(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def tiny_config(family: str, *, tied: bool = False, **moe) -> transformers.PretrainedConfig:
    """A tiny config of each family, exercising that family's peculiarities; ``moe``: Qwen3-MoE
    fields in place of its defaults here."""
    if family == "llama":
        return transformers.LlamaConfig(
            **TINY,
            tie_word_embeddings=tied,
            rope_theta=500_000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        )
    if family == "qwen2":
        return transformers.Qwen2Config(**TINY, tie_word_embeddings=tied, rope_theta=1_000_000.0)
    if family == "qwen3":
        return transformers.Qwen3Config(**TINY, head_dim=16, tie_word_embeddings=tied, rope_theta=1_000_000.0)
    if family == "qwen3_moe":  # layer 0 sparse (4 experts, 2 a token), layer 1 dense
        experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=[1])
        return transformers.Qwen3MoeConfig(
            **TINY, head_dim=16, tie_word_embeddings=tied, rope_theta=1_000_000.0, **{**experts, **moe}
        )
    raise ValueError(family)


def make_checkpoint(family: str, path: Path, *, tied: bool = False, seed: int = 0, **moe) -> torch.nn.Module:
    """Random-init a tiny torch model (non-trivial norms and biases too) and save it in HF layout."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family, tied=tied, **moe))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim in (2, 3):  # 3: the experts' stacked [E, out, in] weights
                # Fan-in scaled weights (not the 0.02 init): peaked attention and logits of
                # order one, so a wrong position (RoPE) or scale shows in the logits.
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(path)
    return model


def torch_logits(model: torch.nn.Module, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = model(
            input_ids=torch.as_tensor(ids, dtype=torch.long),
            attention_mask=torch.as_tensor(mask, dtype=torch.long),
            position_ids=torch.as_tensor(positions, dtype=torch.long),
        )
    return out.logits.float().numpy()


def left_padded_batch(seed: int = 0, vocab: int = 97) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Three sequences of lengths 96, 41 and 1, left-padded to 96: ids, mask, positions.

    Long enough for position errors to show: a RoPE base 10 % off moves the logits by
    ~1e-2 at position 95 but only ~5e-4 at position 8.
    """
    rng = np.random.default_rng(seed)
    lengths = [96, 41, 1]
    width = max(lengths)
    ids = np.zeros((len(lengths), width), np.int64)
    mask = np.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = rng.integers(3, vocab, size=n)
        mask[row, width - n :] = 1
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    return ids, mask, positions
