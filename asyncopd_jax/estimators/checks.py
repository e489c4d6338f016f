"""Input checks for the estimators: shapes at trace time (free under ``jit``), values on request.

Shapes are static under ``jit``, so every estimator checks the ranks and the agreement of
its arguments' shapes while it is traced, at no cost per step, and a wrong call fails with
one line naming the function, the argument and the shape it expected, with each size as
the caller passed it (``forward_kl_topk: teacher_logp has shape [2, 4, 7]; expected
[B, T, K] = [2, 4, 8] (K = 8 from student_logp)``). Leading axes are part of the contract:
to ``vmap`` an estimator, add an axis (as ``jax.vmap`` over a stack of batches does).

Values can only be checked at run time. With ``check_inputs=True`` an estimator adds
``checkify`` checks that its log-probability arguments are log-probabilities: no value
above 0 and, for a support of distinct ids, no more than probability 1 on it. Raw logits
passed by mistake fail these. Eagerly the check raises at once; under ``jit`` wrap the
function in ``jax.experimental.checkify.checkify`` and call ``err.throw()`` (the learner
does this when ``estimator.check_inputs`` is set). Off by default: a check is a reduction
over the inputs and a host round trip per step.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax.experimental import checkify

Array = jax.Array

# How far above 0 a log-probability (or a support's log-mass) may be from fp32 rounding.
LOGPROB_TOLERANCE = 1e-4


def check_shapes(fn: str, arrays: Mapping[str, tuple[Array | None, str]]) -> dict[str, int]:
    """Check that each array has the named dimensions, the same name meaning the same size.

    Args:
      fn: the estimator's name, for the message.
      arrays: argument name → (array or None to skip, dims such as ``"B T K"``). A size is
        bound by the first argument (in order) that has the dim.

    Returns:
      dim name → size.

    Raises:
      ValueError: one line naming ``fn``, the argument, its shape and the expected one.
    """
    sizes: dict[str, tuple[int, str]] = {}
    for name, (array, dims) in arrays.items():
        if array is None:
            continue
        names, shape = dims.split(), tuple(jnp.shape(array))
        expected = "[" + ", ".join(names) + "]"
        if len(shape) != len(names):
            known = all(d in sizes for d in names)
            want = f" = {[sizes[d][0] for d in names]}" if known else f" (rank {len(names)})"
            raise ValueError(f"{fn}: {name} has shape {list(shape)}; expected {expected}{want}")
        for dim, size in zip(names, shape):
            if dim in sizes and sizes[dim][0] != size:
                wanted = [sizes[d][0] if d in sizes else s for d, s in zip(names, shape)]
                raise ValueError(
                    f"{fn}: {name} has shape {list(shape)}; expected {expected} = {wanted} "
                    f"({dim} = {sizes[dim][0]} from {sizes[dim][1]})"
                )
            sizes.setdefault(dim, (size, name))
    return {dim: size for dim, (size, _) in sizes.items()}


def check_same_shape(fn: str, arrays: Mapping[str, Array | None], ranks: tuple[int, ...] = (2, 3)) -> None:
    """Elementwise functions: every array has the first one's shape, of rank ``[B, T]`` (2)
    or ``[B, T, N]`` (3)."""
    first, first_array = next(((n, a) for n, a in arrays.items() if a is not None), (None, None))
    if first_array is None:
        return
    lead = tuple(jnp.shape(first_array))
    if len(lead) not in ranks:
        allowed = " or ".join("[" + ", ".join("BTN"[:r]) + "]" for r in ranks)
        raise ValueError(f"{fn}: {first} has shape {list(lead)}; expected {allowed}")
    for name, array in arrays.items():
        if array is not None and tuple(jnp.shape(array)) != lead:
            raise ValueError(f"{fn}: {name} has shape {list(jnp.shape(array))}; expected {list(lead)} like {first}")


def check_logprobs(fn: str, arrays: Mapping[str, Array | None], supports: tuple[str, ...] = ()) -> None:
    """``checkify`` checks (see the module) that each array holds log-probabilities; for the
    names in ``supports`` (distinct ids on the last axis) also that their mass is at most 1.
    Positions at −inf (zero probability) pass."""
    for name, array in arrays.items():
        if array is None:
            continue
        x = jnp.asarray(array, jnp.float32)
        top = jnp.max(jnp.where(jnp.isnan(x), jnp.inf, x))
        checkify.check(
            top <= LOGPROB_TOLERANCE,
            f"{fn}: {name} holds values up to {{top}}; expected log-probabilities (<= 0): raw logits?",
            top=top,
        )
        if name in supports:
            mass = jnp.max(jax.nn.logsumexp(x, axis=-1))
            checkify.check(
                mass <= LOGPROB_TOLERANCE,
                f"{fn}: {name} puts probability exp({{mass}}) > 1 on its ids; expected log-probabilities "
                "of distinct ids: raw logits, or a log-softmax over another axis?",
                mass=mass,
            )
