"""Random keys for a model built as shapes only (under ``nnx.eval_shape``).

``nnx.Rngs`` counts its draws in a variable; under ``eval_shape`` that count is a tracer,
and every draw's update asks it for its ``sharding``, which a tracer answers with an error
whose message is built by scanning the whole trace so far (jax 0.10, flax 0.12). Building a
model of n weights that way is quadratic in n: 2.5 s for Qwen3-8B's shapes, every time a
plan, a checkpoint load or a stage builds one. Shapes do not depend on the keys' values, so
:func:`shape_keys` draws one key every time, and counts nothing (0.6 s)."""

from __future__ import annotations

from typing import cast

import jax
from flax import nnx


class _ShapeKeys:
    """``params()``: the same key every time (all a model's constructors draw)."""

    def params(self) -> jax.Array:
        return jax.random.key(0)


def shape_keys() -> nnx.Rngs:
    """What to give a model's constructor inside ``nnx.eval_shape``: its weights' shapes and
    dtypes are those ``nnx.Rngs(0)`` gives; their values, which ``eval_shape`` never
    computes, would differ."""
    return cast(nnx.Rngs, _ShapeKeys())
