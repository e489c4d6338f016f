"""asyncopd_jax: asynchronous on-policy distillation of language models in JAX.

Start at :mod:`asyncopd_jax.estimators` (pure KL estimators and stabilisers) and
:mod:`asyncopd_jax.cache` (the rollout / teacher-score data contracts).
"""

__version__ = "0.1.0"
