"""The computed estimates of docs/scaling.md: parameter counts, memory, FLOPs, stage times.

    python docs/scaling_estimates.py            # every table of docs/scaling.md

Plain arithmetic from the model configurations and the code's data layout (no JAX, no
measurement). Stage times divide FLOPs or bytes by a vendor peak times an *assumed*
utilisation (MATMUL_UTILISATION, HBM_UTILISATION below): they are planning figures to
be replaced by measurements (benchmarks/, trace.json), not results.
"""

from __future__ import annotations

import dataclasses

GIB = 2**30
VOCAB = 151_936

# Assumptions for the time estimates (not measured on GPUs or TPUs by this project).
MATMUL_UTILISATION = 0.4  # fraction of peak matmul FLOP/s in learner steps, scoring, prefill
HBM_UTILISATION = 0.5  # fraction of peak HBM bandwidth in decode steps


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


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    hbm_gib: float
    matmul_flops: float  # dense peak at the rate fp32 matmuls run at by default (TF32 / bf16)
    bf16_flops: float
    hbm_bytes_per_s: float


# Vendor peak figures (dense). JAX runs fp32 matmuls as TF32 on Ampere/Hopper and as
# single-pass bf16 on TPU by default (jax_default_matmul_precision).
CHIPS = {
    "H100-80GB": Chip("H100 SXM 80 GB", 80 * 1e9 / GIB, 495e12, 989e12, 3.35e12),
    "A100-80GB": Chip("A100 SXM 80 GB", 80 * 1e9 / GIB, 156e12, 312e12, 2.04e12),
    "v5p": Chip("TPU v5p chip", 95 * 1e9 / GIB, 459e12, 459e12, 2.765e12),
    "v5e": Chip("TPU v5e chip", 16 * 1e9 / GIB, 197e12, 197e12, 0.819e12),
}


def fmt_gib(x: float) -> str:
    return f"{x / GIB:.1f}"


# --- memory ---------------------------------------------------------------------------


def learner_state_bytes(m: Model, b: int) -> dict[str, float]:
    """Params, AdamW's two moments (optax.adamw: same dtype as the params), the gradient
    accumulator of the micro-batch scan and one micro-batch's gradients (transient)."""
    p = m.params * b
    return {"params": p, "adam_moments": 2 * p, "grad_accumulator": p, "grads_transient": p}


def activation_bytes_per_sequence(m: Model, s: int, b: int) -> float:
    """Rough, no rematerialisation: ~(10·H + 4·I) saved values per token and layer in the
    parameter dtype, plus the attention scores (fp32) and probabilities (param dtype)
    ``[N_q, S, S]`` of every layer, which this decoder materialises."""
    linear = m.layers * s * (10 * m.hidden + 4 * m.intermediate) * b
    attention = m.layers * m.q_heads * s * s * (4 + b)
    return linear + attention


def lm_head_chunk_bytes(m: Model, chunk: int) -> float:
    """One chunk of the fused gather: [chunk, V] fp32 logits, log-softmax and gradient."""
    return 3 * chunk * m.vocab * 4


def sampler_bytes(m: Model, b: int, group: int, slots: int) -> dict[str, float]:
    """Weights, the KV cache of a group (cache dtype = parameter dtype), and the largest
    transient: the prefill that recomputes the cache after a weight swap (one layer's
    fp32 scores and probabilities [G, N_q, S, S])."""
    return {
        "weights": m.params * b,
        "kv_cache": group * slots * m.kv_bytes_per_token(b),
        "recompute_prefill": group * m.q_heads * slots * slots * (4 + b),
    }


def scorer_bytes(m: Model, b: int, group: int, slots: int, chunk: int) -> dict[str, float]:
    """Teacher weights, one layer's attention transient over prompt + response, one
    chunk of [G, chunk, V] fp32 logits (x2: log-softmax)."""
    return {
        "weights": m.params * b,
        "attention_transient": group * m.q_heads * slots * slots * (4 + b),
        "logit_chunk": 2 * group * chunk * m.vocab * 4,
    }


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


# --- FLOPs and time ---------------------------------------------------------------------


def learner_flops(m: Model, rows: int, s: int, t: int) -> float:
    """Forward + backward of the decoder over prompt + response (6·P_ne per token), the
    fused LM-head gather on response tokens (4 matmuls of 2·H·V: logits recomputed in the
    backward pass) and the S² attention terms (fwd + bwd, no causal skipping)."""
    return (
        6 * m.non_embedding * rows * s
        + 8 * m.hidden * m.vocab * rows * t
        + 12 * m.layers * rows * s * s * m.q_heads * m.head_dim
    )


def scoring_flops(m: Model, rows: int, s: int, t: int) -> float:
    """One teacher forward over prompt + response, LM head on the response positions."""
    return (
        2 * m.non_embedding * rows * s
        + 2 * m.hidden * m.vocab * rows * t
        + 4 * m.layers * rows * s * s * m.q_heads * m.head_dim
    )


def decode_step_bytes(m: Model, b: int, group: int, slots: int) -> float:
    """HBM traffic of one decode step: all weights once, the whole static KV cache (every
    step attends over all slots, masked)."""
    return m.params * b + group * slots * m.kv_bytes_per_token(b)


def decode_seconds(m: Model, b: int, group: int, slots: int, steps: int, chip: Chip) -> float:
    return steps * decode_step_bytes(m, b, group, slots) / (chip.hbm_bytes_per_s * HBM_UTILISATION)


def matmul_seconds(flops: float, chips: int, peak: float) -> float:
    return flops / (chips * peak * MATMUL_UTILISATION)


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


def table_learner_state() -> None:
    print(
        "| model | param dtype | params | AdamW moments | grad accumulator | + transient grads | total "
        "| ÷ 4 (FSDP 4) | ÷ 16 (FSDP 16) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for m in QWEN3.values():
        for b, name in ((4, "fp32"), (2, "bf16")):
            st = learner_state_bytes(m, b)
            total = sum(st.values())
            print(
                f"| {m.name} | {name} | {fmt_gib(st['params'])} | {fmt_gib(st['adam_moments'])} | "
                f"{fmt_gib(st['grad_accumulator'])} | {fmt_gib(st['grads_transient'])} | {fmt_gib(total)} | "
                f"{fmt_gib(total / 4)} | {fmt_gib(total / 16)} |"
            )


def table_activations(s_values=(532, 1044, 2068, 4116)) -> None:
    print("| model | param dtype | " + " | ".join(f"S = {s}" for s in s_values) + " |")
    print("|---|---|" + "---|" * len(s_values))
    for m in QWEN3.values():
        for b, name in ((4, "fp32"), (2, "bf16")):
            cells = " | ".join(f"{fmt_gib(activation_bytes_per_sequence(m, s, b))}" for s in s_values)
            print(f"| {m.name} | {name} | {cells} |")


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


@dataclasses.dataclass(frozen=True)
class Example:
    title: str
    student: Model
    teacher: Model
    student_b: int
    teacher_b: int
    batch: int  # sequences per rollout batch (B)
    rows_per_step: int  # B / mini_batches
    group: int  # sequences per rollout group (B / stages.rollout_processes)
    prompt: int
    response: int
    chunk: int  # scoring.chunk_size
    logprob_chunk: int
    learner_chips: int
    learner_chip: Chip
    stage_chip: Chip


def example_report(e: Example) -> None:
    s = e.prompt + e.response
    print(f"### {e.title}\n")
    print(
        f"S = {e.prompt} prompt + {e.response} response slots = {s}; B = {e.batch}, "
        f"{e.rows_per_step} rows per optimizer step over {e.learner_chips} learner devices, "
        f"rollout group G = {e.group}.\n"
    )
    st = learner_state_bytes(e.student, e.student_b)
    rows_dev = e.rows_per_step / e.learner_chips
    act = activation_bytes_per_sequence(e.student, s, e.student_b) * rows_dev
    gathered = e.student.params * e.student_b  # upper bound: all weights gathered at once
    teacher_in_learner = e.teacher.params * e.teacher_b
    head = lm_head_chunk_bytes(e.student, e.logprob_chunk)
    learner_total = sum(st.values()) / e.learner_chips + act + gathered + head
    print("| learner device | GiB |")
    print("|---|---|")
    print(f"| params + moments + grads (÷ {e.learner_chips}) | {fmt_gib(sum(st.values()) / e.learner_chips)} |")
    print(f"| activations, {rows_dev:g} rows per device | {fmt_gib(act)} |")
    print(f"| gathered weights (upper bound) | {fmt_gib(gathered)} |")
    print(f"| LM-head chunk ({e.logprob_chunk} rows) | {fmt_gib(head)} |")
    print(f"| **sum** | **{fmt_gib(learner_total)}** |")
    print(
        f"| + the teacher the learner process also loads (first device of each learner process) "
        f"| +{fmt_gib(teacher_in_learner)} |"
    )
    print()
    sb = sampler_bytes(e.student, e.student_b, e.group, s)
    tb = scorer_bytes(e.teacher, e.teacher_b, e.group, s, e.chunk)
    print("| stage device | weights | KV cache / attention | largest transient | sum GiB |")
    print("|---|---|---|---|---|")
    print(
        f"| rollout (samples G = {e.group}) | {fmt_gib(sb['weights'])} | {fmt_gib(sb['kv_cache'])} | "
        f"{fmt_gib(sb['recompute_prefill'])} (cache recompute) | {fmt_gib(sum(sb.values()))} |"
    )
    print(
        f"| scoring (G = {e.group}) | {fmt_gib(tb['weights'])} | {fmt_gib(tb['attention_transient'])} | "
        f"{fmt_gib(tb['logit_chunk'])} (logit chunk) | {fmt_gib(sum(tb.values()))} |"
    )
    print()
    lf = learner_flops(e.student, e.batch, s, e.response)
    sf = scoring_flops(e.teacher, e.batch, s, e.response)
    learner_peak = e.learner_chip.matmul_flops if e.student_b == 4 else e.learner_chip.bf16_flops
    t_learn = matmul_seconds(lf, e.learner_chips, learner_peak)
    t_score = matmul_seconds(sf, 1, e.stage_chip.bf16_flops if e.teacher_b == 2 else e.stage_chip.matmul_flops)
    t_decode = decode_seconds(e.student, e.student_b, e.group, s, e.response, e.stage_chip) * (e.batch / e.group)
    step_bytes = decode_step_bytes(e.student, e.student_b, e.group, s)
    print("| per rollout batch of B sequences | work | estimated seconds |")
    print("|---|---|---|")
    print(f"| learn (all mini-batches) | {lf:.2e} FLOP | {t_learn:.1f} on {e.learner_chips} devices |")
    print(f"| teacher scoring | {sf:.2e} FLOP | {t_score:.1f} on 1 device |")
    print(
        f"| sampling ({e.response} decode steps per group, {e.batch // e.group} group(s)) | "
        f"{step_bytes / GIB:.1f} GiB read per step | {t_decode:.1f} on 1 device |"
    )
    print()


EXAMPLES = [
    Example(
        "Qwen3-1.7B ← Qwen3-8B, one 8-GPU node (asyncopd_jax/configs/qwen3_1.7b_from_8b_gpu.yaml, H100 80 GB)",
        QWEN3["1.7B"],
        QWEN3["8B"],
        4,
        2,
        batch=64,
        rows_per_step=8,
        group=64,
        prompt=20,
        response=1024,
        chunk=64,
        logprob_chunk=512,
        learner_chips=4,
        learner_chip=CHIPS["H100-80GB"],
        stage_chip=CHIPS["H100-80GB"],
    ),
    Example(
        "Qwen3-0.6B ← Qwen3-4B, TPU v5p (asyncopd_jax/configs/qwen3_0.6b_from_4b_tpu.yaml, 16 learner chips)",
        QWEN3["0.6B"],
        QWEN3["4B"],
        4,
        2,
        batch=64,
        rows_per_step=64,
        group=64,
        prompt=20,
        response=1024,
        chunk=64,
        logprob_chunk=512,
        learner_chips=16,
        learner_chip=CHIPS["v5p"],
        stage_chip=CHIPS["v5p"],
    ),
]


if __name__ == "__main__":
    print("## Models\n")
    table_models()
    print("\n## Learner state\n")
    table_learner_state()
    print("\n## Activations per sequence (GiB)\n")
    table_activations()
    print("\n## Teacher-score cache\n")
    table_cache()
    print()
    for example in EXAMPLES:
        example_report(example)
