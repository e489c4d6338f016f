"""The built-in task wired to models and tokenizers: model presets, SFT batches, and the
task seen through a tokenizer (:class:`TaskData`, a :class:`PromptTask`).

The task itself (:mod:`asyncopd_jax.tasks.arith`) is text; here it meets token ids.
Prompts go through the run's tokenizer (its chat template if it has one), responses are
decoded and checked by the verifier, so the same task runs with the built-in character
tokenizer or with a Hugging Face model's own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx
from transformers import PreTrainedTokenizerBase

from asyncopd_jax.cache import RolloutBatch
from asyncopd_jax.config import TaskConfig
from asyncopd_jax.models import Decoder, DecoderConfig
from asyncopd_jax.sampling import left_pad
from asyncopd_jax.tasks.arith import (
    Problem,
    long_tailed_probabilities,
    operand_counts,
    problems_with_counts,
    random_solution,
    sample_problems,
    verify,
)
from asyncopd_jax.tasks.prompt_task import PromptTask
from asyncopd_jax.tasks.tokenizer import EOS_ID, PAD_ID

VOCAB_SIZE = 32  # the character tokenizer's 19 tokens, padded
SFT_SLOTS_PER_ROW = 128  # task.lengths = long_tailed: an SFT batch's budget, per row of --batch-size


# (hidden, layers, MLP width, head dim, context): the ``_long`` sizes are the same models with a
# context for ``task.lengths = long_tailed`` (the longest prompt + answer at 40 operands: 122 + 494 tokens)
MODEL_SIZES = {
    "teacher": (128, 4, 384, 32, 128),
    "student": (64, 2, 192, 16, 128),
    "teacher_long": (128, 4, 384, 32, 1024),
    "student_long": (64, 2, 192, 16, 1024),
    "teacher_moe": (128, 4, 384, 32, 128),
}

# (experts, experts per token, an expert's MLP width) of the mixtures of experts among
# them: the teacher's widths with 8 experts of 96 in each layer's MLP, 2 a token (an active
# MLP of 192 where the dense teacher's is 384, and 768 in all), as Qwen3-MoE routes them
# (norm_topk_prob)
EXPERT_SIZES = {"teacher_moe": (8, 2, 96)}


def model_config(size: str, vocab_size: int = VOCAB_SIZE) -> DecoderConfig:
    """A key of :data:`MODEL_SIZES`: small Qwen3-style decoders for the built-in task. The
    context (``max_position_embeddings``) is what the pipeline checks prompt + answer against;
    RoPE itself has no length limit. ``vocab_size``: the embedding's rows
    (:func:`padded_vocab` of the tokenizer's size)."""
    if size not in MODEL_SIZES:
        raise ValueError(f"built-in model {size!r} is invalid; allowed: {', '.join(MODEL_SIZES)}")
    hidden, layers, mlp, head_dim, context = MODEL_SIZES[size]
    experts, per_token, expert_mlp = EXPERT_SIZES.get(size, (0, 0, 0))
    return DecoderConfig(
        model_type="qwen3_moe" if experts else "qwen3",
        num_experts=experts,
        num_experts_per_tok=per_token,
        moe_intermediate_size=expert_mlp,
        norm_topk_prob=bool(experts),
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        tie_word_embeddings=True,
        max_position_embeddings=context,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        rope_theta=10_000.0,
    )


def padded_vocab(tokens: int) -> int:
    """Embedding rows for a tokenizer of ``tokens`` ids: a multiple of 32, at least
    :data:`VOCAB_SIZE` (the character tokenizer's 19 → 32, the merges' 64 → 64)."""
    return max(VOCAB_SIZE, -(-tokens // 32) * 32)


def new_model(size: str, seed: int, vocab_size: int = VOCAB_SIZE) -> Decoder:
    return Decoder(model_config(size, vocab_size), rngs=nnx.Rngs(seed))


class TaskData(PromptTask):
    """The built-in task seen through one tokenizer; items are :class:`Problem` s.

    ``prompt_slots`` and ``max_new_tokens`` hold the worst case (an upper bound when the
    operands are distinct): every operand ``max_value``, as many operands as a problem can
    have (``difficulty``, or ``max_operands`` when ``task.lengths = long_tailed``).
    """

    def __init__(self, task: TaskConfig, tokenizer: PreTrainedTokenizerBase):
        super().__init__(tokenizer)
        self.task = task
        self.most_operands = task.max_operands if task.lengths == "long_tailed" else task.difficulty
        self.prompt_slots, self.max_new_tokens = self._widths(self.most_operands)
        self.eval_items = self._problems(np.random.default_rng(task.seed + 12345), task.eval_prompts, held_out=True)

    def _widths(self, operands: int) -> tuple[int, int]:
        """(prompt tokens, answer tokens with the EOS) of the longest problem of ``operands`` operands.

        An answer may take as many tokens as it has characters, whatever the tokenizer's own
        encoding of it: a byte-pair student can write one character a token (as it learns to
        from a character teacher, :mod:`asyncopd_jax.teacher.cross_tokenizer`), and its
        evaluation must not cut such an answer short. For the character tokenizer the two
        counts are the same."""
        worst = Problem((self.task.max_value,) * operands)
        solution = worst.solution(tuple(range(operands)))
        return len(self.encode([worst])[0]), max(len(self.tokenizer.encode(solution)), len(solution)) + 1

    def _problems(self, rng: np.random.Generator, n: int, *, held_out: bool) -> list[Problem]:
        t = self.task
        return sample_problems(
            rng,
            n,
            t.difficulty,
            t.max_value,
            held_out=held_out,
            lengths=t.lengths,
            max_operands=t.max_operands,
            tail_exponent=t.tail_exponent,
        )

    def prompt_text(self, problem: Problem) -> str:
        return problem.prompt

    def score(self, problem: Problem, response: str) -> float:
        return float(verify(problem, response))

    def train_prompts(self, rng: np.random.Generator, n: int) -> tuple[list[list[int]], list[Problem]]:
        problems = self._problems(rng, n, held_out=False)
        return self.encode(problems), problems

    def fields(self, problem: Problem) -> dict[str, str]:
        """``prompt`` (``Q:a+b=``), ``answer`` (the sum) and ``solution`` (the partial sums
        left to right, as the teacher was trained to write them)."""
        order = tuple(range(len(problem.operands)))
        return {"prompt": problem.prompt, "answer": str(problem.answer), "solution": problem.solution(order)}

    def bounding_items(self) -> list[Problem]:
        """The longest problem: every operand ``max_value``, as many as a problem can have."""
        return [Problem((self.task.max_value,) * self.most_operands)]

    def where(self, problems: Sequence[Problem]) -> str:
        return "problems " + ", ".join(p.prompt for p in problems[:3]) + (" …" if len(problems) > 3 else "")

    def _sft_problems(self, rng: np.random.Generator, batch_size: int) -> tuple[list[Problem], int, int]:
        """A batch of training problems and its (prompt, answer) widths.

        Long-tailed: the problems of a batch all come from one :func:`length_buckets` bucket
        (the bucket drawn with its probability under the law, the counts from the law within
        it) and are padded to that bucket's worst case, so that short answers are not padded
        to the longest (one compiled shape per bucket). A batch holds at most
        ``batch_size × SFT_SLOTS_PER_ROW`` prompt + answer slots: ``batch_size`` rows of short
        problems, fewer (at least one) of long ones, so a step costs about the same whatever
        its bucket; rows of the long buckets are therefore rarer than the law says.
        """
        t = self.task
        if t.lengths != "long_tailed":
            return self._problems(rng, batch_size, held_out=False), self.prompt_slots, self.max_new_tokens
        first = operand_counts(rng, 1, t.difficulty, t.max_operands, t.tail_exponent)[0]
        low, high = next(b for b in length_buckets(t.difficulty, t.max_operands) if b[0] <= first <= b[1])
        prompt_slots, answer_slots = self._widths(high)
        rows = max(1, min(batch_size, batch_size * SFT_SLOTS_PER_ROW // (prompt_slots + answer_slots)))
        return self._problems_in(rng, rows, low, high, held_out=False), prompt_slots, answer_slots

    def _problems_in(self, rng: np.random.Generator, n: int, low: int, high: int, *, held_out: bool) -> list[Problem]:
        """``n`` problems of ``low … high`` operands, the counts from the long-tailed law within that range."""
        t = self.task
        within = long_tailed_probabilities(t.difficulty, t.max_operands, t.tail_exponent)[
            low - t.difficulty : high - t.difficulty + 1
        ]
        counts = low + rng.choice(len(within), size=n, p=within / within.sum())
        return problems_with_counts(rng, counts, t.max_value, held_out=held_out, distinct=True)

    def accuracy_by_length(
        self, graphdef: nnx.GraphDef, params: nnx.State, per_bucket: int = 64
    ) -> list[tuple[int, int, float]]:
        """``(low, high, greedy accuracy)`` for each of :func:`length_buckets`, on ``per_bucket``
        held-out problems of ``low … high`` operands each (a fixed draw: counts from the
        long-tailed law within the bucket), so that the rare long answers are measured too."""
        t = self.task
        if t.lengths != "long_tailed":
            raise ValueError(f"accuracy by length needs task.lengths = long_tailed, not {t.lengths}")
        rng = np.random.default_rng(t.seed + 54321)
        out = []
        for low, high in length_buckets(t.difficulty, self.most_operands):
            items = self._problems_in(rng, per_bucket, low, high, held_out=True)
            out.append((low, high, self.accuracy(graphdef, params, items=items)))
        return out

    def sft_batch(self, rng: np.random.Generator, batch_size: int) -> RolloutBatch:
        """Training problems with uniformly random solution orders (teacher SFT data).

        Long-tailed: the operands added left to right instead. The built-in teacher's width
        did not learn to keep track of which of many operands a random order had used within
        minutes of CPU SFT (at 6 operands it re-used or skipped one in most answers, 3 %
        correct against 36 % left to right after the same 200 steps; docs/results.md). Any
        order still passes the verifier."""
        problems, prompt_slots, answer_slots = self._sft_problems(rng, batch_size)
        in_order = self.task.lengths == "long_tailed"
        texts = [p.solution(tuple(range(len(p.operands)))) if in_order else random_solution(rng, p) for p in problems]
        return self.answer_batch(problems, texts, prompt_slots, answer_slots)

    def answer_batch(
        self, problems: Sequence[Problem], texts: Sequence[str], prompt_slots: int, answer_slots: int
    ) -> RolloutBatch:
        """``problems`` with the answers ``texts`` (each then EOS) in this tokenizer's own
        encoding, ``[B, prompt_slots]`` / ``[B, answer_slots]``: supervised data."""
        prompts, mask = left_pad(self.encode(problems), self.pad_id, prompt_slots)
        responses = np.full((len(problems), answer_slots), self.pad_id, np.int32)
        response_mask = np.zeros(responses.shape, bool)
        for row, text in enumerate(texts):
            ids = (self.tokenizer.encode(text) + [self.eos_id])[:answer_slots]
            responses[row, : len(ids)] = ids
            response_mask[row, : len(ids)] = True
        return RolloutBatch(
            prompt_tokens=jnp.asarray(prompts),
            prompt_mask=jnp.asarray(mask),
            response_tokens=jnp.asarray(responses),
            response_mask=jnp.asarray(response_mask),
            behavior_logp=jnp.zeros(responses.shape, jnp.float32),
            token_version=jnp.zeros(responses.shape, jnp.int32),
        )


def length_buckets(minimum: int, maximum: int) -> list[tuple[int, int]]:
    """Operand-count ranges ``(low, high)`` covering ``minimum … maximum``, each starting at
    about 1.5 times the start of the one before (from 2 to 40: 2, 3–4, 5–7, 8–11, 12–17, 18–26,
    27–40): the long-tailed SFT batches and the by-length accuracy in the docs use them."""
    out, low = [], minimum
    while low <= maximum:
        high = min(max(low, math.ceil(low * 1.5) - 1), maximum)
        out.append((low, high))
        low = high + 1
    return out


__all__ = [
    "EXPERT_SIZES",
    "MODEL_SIZES",
    "TaskData",
    "VOCAB_SIZE",
    "length_buckets",
    "model_config",
    "new_model",
    "padded_vocab",
]
