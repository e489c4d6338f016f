"""The arithmetic of docs/scaling.md: parameter counts and KV-cache bytes per model, and the
bytes of the teacher-score cache per position.

    python docs/scaling_estimates.py            # the two tables of docs/scaling.md

Plain arithmetic from the model configurations and the code's data layout (no JAX). What
a stage holds on a chip, its FLOPs and its roofline time come from the compiler instead:
``asyncopd plan`` (docs/scaling.md).
"""

from __future__ import annotations

import dataclasses

GIB = 2**30
VOCAB = 151_936


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool
    vocab: int = VOCAB

    @property
    def layer_params(self) -> int:
        h, d = self.hidden, self.head_dim
        attention = h * self.q_heads * d + 2 * h * self.kv_heads * d + self.q_heads * d * h + 2 * d  # + q/k norm
        return attention + 3 * h * self.intermediate + 2 * h  # MLP + two RMSNorms

    @property
    def non_embedding(self) -> int:
        return self.layers * self.layer_params + self.hidden  # + final norm

    @property
    def params(self) -> int:
        return self.non_embedding + self.vocab * self.hidden * (1 if self.tied else 2)

    def kv_bytes_per_token(self, b: int) -> int:
        """Keys and values of one token in every layer: 2 · L · N_kv · D · bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * b


# Qwen3 dense configurations (config.json of the Hugging Face releases).
QWEN3 = {
    "0.6B": Model("Qwen3-0.6B", 28, 1024, 16, 8, 128, 3072, tied=True),
    "1.7B": Model("Qwen3-1.7B", 28, 2048, 16, 8, 128, 6144, tied=True),
    "4B": Model("Qwen3-4B", 36, 2560, 32, 8, 128, 9728, tied=True),
    "8B": Model("Qwen3-8B", 36, 4096, 32, 8, 128, 12288, tied=False),
}


def fmt_gib(x: float) -> str:
    return f"{x / GIB:.1f}"


def record_bytes_per_position(
    n: int = 0, k_student: int = 0, k_teacher: int = 0, m_samples: int = 0, store: int = 4
) -> int:
    """Bytes per response position of one spool record (rollout + teacher-score cache).

    Rollout: token id (int32), mask (bool), behaviour log-prob (fp32), token version (int32);
    N candidates and K student top-K ids with behaviour log-probs (int32 + fp32 each).
    Cache: log q of the token, of the N candidates and K student ids (store dtype); the
    teacher's top-K and M samples, ids (int32) and log q (store dtype).
    """
    rollout = 4 + 1 + 4 + 4 + n * 8 + k_student * 8
    cache = store + n * store + k_student * store + k_teacher * (4 + store) + m_samples * (4 + store)
    return rollout + cache


# --- the tables of docs/scaling.md -----------------------------------------------------


def table_models() -> None:
    print(
        "| model | layers | hidden | q / kv heads | MLP | tied | parameters | non-embedding "
        "| weights bf16 | weights fp32 | KV per token bf16 | KV per token fp32 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for m in QWEN3.values():
        print(
            f"| {m.name} | {m.layers} | {m.hidden} | {m.q_heads} / {m.kv_heads} | {m.intermediate} | "
            f"{'yes' if m.tied else 'no'} | {m.params:,} | {m.non_embedding:,} | {fmt_gib(m.params * 2)} GiB | "
            f"{fmt_gib(m.params * 4)} GiB | {m.kv_bytes_per_token(2) // 1024} KiB | "
            f"{m.kv_bytes_per_token(4) // 1024} KiB |"
        )


def table_cache() -> None:
    full = VOCAB * 4
    print(f"| cache per position | bytes (fp32 store) | bytes (bf16 store) | vs. full logits ({full:,} B) |")
    print("|---|---|---|---|")
    for label, kw in [
        ("sampled token only", {}),
        ("teacher top-16 (forward_kl_topk)", {"k_teacher": 16}),
        ("N = 8 MC candidates (reverse_kl_mc)", {"n": 8}),
        ("N = 8 candidates + student top-16 + teacher top-16", {"n": 8, "k_student": 16, "k_teacher": 16}),
        ("teacher top-64", {"k_teacher": 64}),
    ]:
        b4, b2 = record_bytes_per_position(**kw, store=4), record_bytes_per_position(**kw, store=2)
        print(f"| {label} | {b4} | {b2} | 1 / {full // b4:,} |")


if __name__ == "__main__":
    print("## Models\n")
    table_models()
    print("\n## Teacher-score cache\n")
    table_cache()
