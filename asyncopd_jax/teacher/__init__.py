"""Teacher (and reference-policy) scoring into the finite score cache, and its on-disk form."""

from asyncopd_jax.teacher.persistence import load_arrays, save_arrays
from asyncopd_jax.teacher.scorer import ReferenceScorer, Scorers, ScoringParams, TeacherScorer, score_hidden

__all__ = ["ReferenceScorer", "Scorers", "ScoringParams", "TeacherScorer", "load_arrays", "save_arrays", "score_hidden"]
