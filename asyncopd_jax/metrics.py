"""The learner's scalar metrics, typed by how the parts of a batch combine into the whole.

A train step evaluates its loss on parts of the mini-batch (micro-batches, or token-budget
micro-batches when packed) and reports the metrics of the whole mini-batch. How a metric
combines is a property of the metric: the producer declares it by the field it puts the
metric in, and the accumulation asks the field, never the metric's name.

- ``means``: token means over the part's response tokens. The whole batch's value is
  ``Σ_parts w_p · mean_p`` with ``w_p = tokens_p / tokens_batch``: exact, as the loss
  (:mod:`asyncopd_jax.estimators.reductions`), not a mean of per-part means.
- ``maxes``: maxima over the part's response tokens; the whole batch's is the max over parts.

As the train step uses them: each part's :func:`weighted` share, folded with
:func:`combine` from :func:`identity`, then :meth:`Metrics.as_dict` for metrics.jsonl.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Metrics:
    """Scalar metrics of a batch or a part of one, by their reduction over parts.

    Attributes:
      means: ``{name: [] fp32}`` token means over the response tokens (combine: weighted sum).
      maxes: ``{name: []}`` maxima over the response tokens (combine: max).
    """

    means: dict[str, Array] = dataclasses.field(default_factory=dict)
    maxes: dict[str, Array] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, Array]:
        """Every metric by its name, as metrics.jsonl shows it (a name in both fields is a ValueError)."""
        both = sorted(self.means.keys() & self.maxes.keys())
        if both:
            raise ValueError(f"metrics {both} are both means and maxes: a metric has one reduction")
        return {**self.means, **self.maxes}


# Fields named explicitly: the base install's JAX floor (0.4.34) has no field inference.
jax.tree_util.register_dataclass(Metrics, data_fields=["means", "maxes"], meta_fields=[])


def weighted(metrics: Metrics, weight: ArrayLike) -> Metrics:
    """A part's share of the whole batch's metrics: ``means`` times ``weight`` (the part's
    share of the batch's tokens, ``[]``), ``maxes`` as they are."""
    return Metrics({k: v * weight for k, v in metrics.means.items()}, dict(metrics.maxes))


def combine(a: Metrics, b: Metrics) -> Metrics:
    """Two shares as one: ``means`` add, ``maxes`` keep the larger (same names in both)."""
    return Metrics(
        jax.tree_util.tree_map(jnp.add, a.means, b.means),
        jax.tree_util.tree_map(jnp.maximum, a.maxes, b.maxes),
    )


def identity(like: Metrics) -> Metrics:
    """The neutral element of :func:`combine` at ``like``'s shapes and dtypes (arrays or
    ``jax.ShapeDtypeStruct``): 0 for each mean, −inf for each max."""
    return Metrics(
        {k: jnp.zeros(v.shape, v.dtype) for k, v in like.means.items()},
        {k: jnp.full(v.shape, -jnp.inf, v.dtype) for k, v in like.maxes.items()},
    )
