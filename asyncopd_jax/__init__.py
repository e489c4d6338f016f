"""asyncopd_jax: asynchronous on-policy distillation of language models in JAX.

Start at :mod:`asyncopd_jax.estimators` (pure KL estimators and stabilisers) and
:mod:`asyncopd_jax.cache` (the rollout / teacher-score data contracts).
"""

import logging as _logging

__version__ = "0.1.0"

# transformers (>= 5) greets every import without PyTorch with "PyTorch was not found. Models won't
# be available ...": an advisory for its PyTorch models, which this package never uses (its models
# are Flax; the train extra has no torch). Drop exactly that record, here because every module of
# the package that imports transformers runs this first. A filter on the "transformers" logger
# (where transformers/__init__.py logs it) rather than TRANSFORMERS_NO_ADVISORY_WARNINGS or the
# verbosity: those would also hide transformers' other advisories and warnings, and the
# environment variable would leak into every process started from here.
_TORCH_ADVISORY = "PyTorch was not found."


class _DropTorchAdvisory(_logging.Filter):
    def filter(self, record: _logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_TORCH_ADVISORY)


_logging.getLogger("transformers").addFilter(_DropTorchAdvisory())
