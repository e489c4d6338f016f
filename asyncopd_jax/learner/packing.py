"""Dynamic batching: token-budget micro-batches of rows of similar length.

A mini-batch holds B rows padded to P prompt and T response slots; with long-tailed
response lengths most of those slots are padding, and the learner pays for every one.
With ``learner.token_budget`` the learner instead

1. sorts the rows by their real length (prompt + response tokens), longest first;
2. cuts them into micro-batches of R rows with R · (p + t) ≤ budget, where p and t are
   the longest prompt and response in the micro-batch rounded up to a multiple of
   ``bucket`` (so only a few shapes are ever compiled);
3. trims every micro-batch to its own ``[R, p]`` prompt and ``[R, t]`` response slots
   (prompts are left-padded: their last p slots; responses right-padded: their first t),
   and fills it up to a power of two rows with copies of its first row whose response mask
   is empty (real tokens keep every value finite; an empty mask makes their loss and
   gradient 0), so that few shapes compile.

R is a multiple of ``row_multiple`` (the learner mesh's batch-axis size), so every device
gets the same padded shape: SPMD work is balanced by construction. The token mean stays
exact because each micro-batch's loss is normalised by the token count of the whole
mini-batch (:func:`~asyncopd_jax.estimators.normalized_token_sum`): the summed gradients
are those of the unpacked mini-batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from asyncopd_jax.cache import RolloutBatch


@dataclasses.dataclass(frozen=True)
class MicroBatchPlan:
    """One packed micro-batch: which rows, and the slots kept.

    Attributes:
      rows: ``[R]`` row indices into the mini-batch (a row repeated at the end is filler).
      real: how many of ``rows`` are real (the rest are filler with an empty mask).
      prompt_slots, response_slots: p and t, the slots kept.
    """

    rows: np.ndarray
    real: int
    prompt_slots: int
    response_slots: int

    @property
    def padded_tokens(self) -> int:
        return len(self.rows) * (self.prompt_slots + self.response_slots)


def _round_up(n: int, multiple: int, cap: int) -> int:
    return min(cap, -(-max(n, 1) // multiple) * multiple)


def plan_micro_batches(
    prompt_lengths: np.ndarray,
    response_lengths: np.ndarray,
    *,
    prompt_slots: int,
    response_slots: int,
    token_budget: int,
    bucket: int = 8,
    row_multiple: int = 1,
) -> list[MicroBatchPlan]:
    """Pack rows of the given real lengths (``[B]`` each) into token-budget micro-batches.

    Every row appears in exactly one plan as a real row. Raises a ValueError if the budget
    cannot hold ``row_multiple`` rows of the longest length.
    """
    prompt_lengths, response_lengths = np.asarray(prompt_lengths), np.asarray(response_lengths)

    def capacity(p: int, t: int) -> int:  # rows of p + t slots in the budget, a multiple of row_multiple
        return token_budget // (p + t) // row_multiple * row_multiple

    order = np.argsort(-(prompt_lengths + response_lengths), kind="stable")
    plans, start = [], 0
    while start < len(order):
        chosen: list[int] = []
        p = t = 0
        for index in order[start:]:
            wider_p = max(p, _round_up(int(prompt_lengths[index]), bucket, prompt_slots))
            wider_t = max(t, _round_up(int(response_lengths[index]), bucket, response_slots))
            if capacity(wider_p, wider_t) < len(chosen) + 1:
                break
            chosen.append(int(index))
            p, t = wider_p, wider_t
        if not chosen:
            need = row_multiple * (wider_p + wider_t)
            raise ValueError(
                f"learner.token_budget = {token_budget} cannot hold {row_multiple} row(s) of "
                f"{wider_p} + {wider_t} slots; allowed: >= {need}"
            )
        # Filler up to a power of two rows (a multiple of row_multiple, within the budget):
        # at most log2 row counts per slot bucket ever compile, and little is wasted.
        rows = min(capacity(p, t), _round_up(1 << (len(chosen) - 1).bit_length(), row_multiple, capacity(p, t)))
        filler = [chosen[0]] * (rows - len(chosen))
        plans.append(MicroBatchPlan(np.asarray(chosen + filler, np.int64), len(chosen), p, t))
        start += len(chosen)
    return plans


def take_micro_batch(batch: Any, plan: MicroBatchPlan) -> Any:
    """The rows of ``plan`` from a :class:`~asyncopd_jax.learner.LearnerBatch`, trimmed to
    its slots, filler rows' response masks emptied."""
    rows = plan.rows
    p, t = plan.prompt_slots, plan.response_slots

    def trim_rollout(r: RolloutBatch) -> RolloutBatch:
        fields: dict[str, Any] = {}
        for f in dataclasses.fields(r):
            value = getattr(r, f.name)
            if value is None:
                fields[f.name] = None
            elif RolloutBatch.axis(f.name) == "prompt":
                fields[f.name] = value[rows][:, value.shape[1] - p :]
            elif RolloutBatch.axis(f.name) == "row":
                fields[f.name] = value[rows]
            else:
                fields[f.name] = value[rows][:, :t]
        mask = np.arange(len(rows)) < plan.real
        fields["response_mask"] = fields["response_mask"] & mask[:, None]
        return RolloutBatch(**fields)

    def trim(tree: Any) -> Any:  # teacher cache, proximal log-probs: [B, T, ...]
        return jax.tree_util.tree_map(lambda x: x[rows][:, :t], tree)

    return dataclasses.replace(
        batch, rollout=trim_rollout(batch.rollout), cache=trim(batch.cache), proximal=trim(batch.proximal)
    )


__all__ = ["MicroBatchPlan", "plan_micro_batches", "take_micro_batch"]
