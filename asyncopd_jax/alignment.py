"""The one alignment convention: response-local, target-aligned hidden states.

A rollout is ``P`` left-padded prompt slots followed by ``T`` response slots. Row t of
every per-position array describes the distribution of response token t given the prompt
and the response tokens before it, so it comes from sequence position ``P − 1 + t``: the
first response token is predicted by the last prompt position, the final (EOS) token by
the position just before it. Student (learner) and teacher (scorer) both use these two
functions; a test shifts the teacher by one position and sees the estimators break.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from asyncopd_jax.cache import RolloutBatch
from asyncopd_jax.models.decoder import Decoder, Remat

Array = jax.Array


def response_aligned(hidden: Array, prompt_slots: int, response_len: int) -> Array:
    """``[B, P + T, H]`` states of prompt + response → ``[B, T, H]``, row t predicting token t."""
    return jax.lax.slice_in_dim(hidden, prompt_slots - 1, prompt_slots - 1 + response_len, axis=1)


def response_hidden(model: Decoder, batch: RolloutBatch, remat: Remat = "none") -> Array:
    """Run ``model`` over prompt + response; ``[B, T, H]`` target-aligned hidden states
    (``remat``: what each layer keeps for a backward pass, see :meth:`Decoder.forward`)."""
    ids = jnp.concatenate([batch.prompt_tokens, batch.response_tokens], axis=1)
    mask = jnp.concatenate([batch.prompt_mask, batch.context_mask], axis=1)  # environment tokens: context
    hidden = model.hidden_states(ids, attention_mask=mask, remat=remat)
    return response_aligned(hidden, batch.prompt_tokens.shape[1], batch.response_tokens.shape[1])
