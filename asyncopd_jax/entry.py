"""The ``asyncopd`` command's entry point: the training stack first, then :mod:`asyncopd_jax.cli`.

``pip install asyncopd-jax`` brings only JAX and NumPy, all that
:mod:`asyncopd_jax.estimators` needs; the command needs the ``train`` extra (Flax, Optax,
Orbax, TensorStore, transformers, …). Without it the command says so in one line instead
of failing on the first import deep inside.
"""

from __future__ import annotations

import importlib.util
import sys

# import name → distribution, for the modules the training stack imports
TRAINING_STACK: dict[str, str] = {
    "flax": "flax",
    "optax": "optax",
    "orbax.checkpoint": "orbax-checkpoint",
    "transformers": "transformers",
    "tensorstore": "tensorstore",
    "safetensors": "safetensors",
    "yaml": "pyyaml",
    "matplotlib": "matplotlib",
    "tokenizers": "tokenizers",
    "tqdm": "tqdm",
}


def missing_training_stack() -> list[str]:
    """The distributions of the training stack that cannot be imported here."""
    missing = []
    for module, distribution in TRAINING_STACK.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a parent package (orbax) is missing
            found = False
        if not found:
            missing.append(distribution)
    return missing


def main(argv: list[str] | None = None) -> int:
    missing = missing_training_stack()
    if missing:
        print(
            f"asyncopd: the training stack is not installed (missing: {', '.join(missing)}); install the train "
            "extra: pip install 'asyncopd-jax[train]' (from a checkout: pip install -e '.[train]')",
            file=sys.stderr,
        )
        return 2
    from asyncopd_jax.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
