"""A table of sample answers for the sinks: what the student wrote and where its teacher
disagreed, token by token.

Each row is one answer of the batch just learned: the prompt, the answer, and the
per-token teacher KL signal ``log μ(y_t) − log q(y_t)`` on the sampled tokens (the
behaviour policy's log-probability minus the teacher's: the single-sample estimate of
the reverse KL at each position), with its mean over the answer.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from transformers import PreTrainedTokenizerBase

from asyncopd_jax.pipeline.staleness import RolloutGroup

COLUMNS = ("prompt", "answer", "kl_mean", "kl_per_token")


def sample_table(groups: Sequence[RolloutGroup], tokenizer: PreTrainedTokenizerBase, rows: int) -> list[list]:
    """The first ``rows`` answers of ``groups`` as rows of :data:`COLUMNS`.

    ``kl_per_token``: the tokens of the answer with their KL signal, ``token(kl)`` separated
    by spaces; empty where the row has no per-token teacher score (a teacher of another
    tokenizer scores spans; unscored runs)."""
    table: list[list] = []
    for group in groups:
        batch = group.batch
        prompts, prompt_masks = np.asarray(batch.prompt_tokens), np.asarray(batch.prompt_mask, bool)
        answers, masks = np.asarray(batch.response_tokens), np.asarray(batch.response_mask, bool)
        cache = group.cache
        gap = None  # unscored, or scored by spans: no per-token score
        if cache is not None and cache.span_end is None:
            gap = np.asarray(batch.behavior_logp) - np.asarray(cache.token_logp)
        for row in range(group.size):
            if len(table) == rows:
                return table
            ids = answers[row][masks[row]]
            kl = gap[row][masks[row]] if gap is not None else np.zeros(0)
            cells = " ".join(f"{tokenizer.decode([int(t)])}({k:.3f})" for t, k in zip(ids, kl))
            table.append(
                [
                    tokenizer.decode([int(t) for t in prompts[row][prompt_masks[row]]]),
                    tokenizer.decode([int(t) for t in ids], skip_special_tokens=True),
                    float(kl.mean()) if kl.size else float("nan"),
                    cells,
                ]
            )
    return table
