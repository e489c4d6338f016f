"""A small, realistic learner batch shared by the learner tests (and their subprocesses)."""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx

from asyncopd_jax.learner import LearnerBatch
from asyncopd_jax.sampling import Sampler, SamplingParams
from asyncopd_jax.teacher import ScoringParams, TeacherScorer
from tests.tiny_models import tiny_decoder

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [15], [16, 17], [18, 19, 20, 21], [22], [23, 24]]


@functools.cache  # ~7-11 s to sample and score; immutable (frozen, JAX arrays): built once per process
def make_learner_batch() -> LearnerBatch:
    """8 rollouts of uneven lengths from a student, scored by a different teacher
    (deterministic: the same batch in every process that builds it)."""
    student, teacher = tiny_decoder(0, scale=0.7), tiny_decoder(1, scale=0.7)
    graphdef, state = nnx.split(student)
    free = Sampler(graphdef, SamplingParams(max_new_tokens=8, num_candidates=4)).generate(
        state, PROMPTS, jax.random.key(0)
    )
    stop = int(free.response_tokens[0, 2])
    params = SamplingParams(max_new_tokens=8, num_candidates=4, student_topk=3, stop_token_ids=(stop,))
    rollout = Sampler(graphdef, params).generate(state, PROMPTS, jax.random.key(0))
    lengths = np.asarray(rollout.response_mask.sum(1))
    assert len(set(lengths.tolist())) > 1  # uneven: a mean of micro-batch means would differ
    cache = TeacherScorer(teacher, ScoringParams(topk=4, num_samples=3)).score(rollout, jax.random.key(1))
    return LearnerBatch(rollout=rollout, cache=cache)
