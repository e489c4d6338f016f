"""Input checks for the estimators: shapes at trace time (free under ``jit``), values on request.

Shapes are static under ``jit``, so every estimator checks the ranks and the agreement of
its arguments' shapes while it is traced, at no cost per step, and a wrong call fails with
one line naming the function, the argument and the shape it expected, with each size as
the caller passed it (``forward_kl_topk: teacher_logp has shape [2, 4, 7]; expected
[B, T, K] = [2, 4, 8] (K = 8 from student_logp)``). Leading axes are part of the contract:
to ``vmap`` an estimator, add an axis (as ``jax.vmap`` over a stack of batches does).

Values can only be checked at run time. With ``check_inputs=True`` an estimator checks
that its log-probability arguments are log-probabilities: no value above 0 and, for a
support of distinct ids, no more than probability 1 on it (positions a ``mask`` leaves
out are not checked). Raw logits passed by mistake fail these. The check works however
the function is called, and fails with one line naming the function and the argument:

* eagerly, it raises a ``ValueError`` at once;
* under ``jax.experimental.checkify.checkify`` (``checkify.checkify(jax.jit(f))`` or
  ``jax.jit(checkify.checkify(f))``), it is a ``checkify.check``: the error comes back as a
  value, ``err.throw()`` raises it (the learner does this when ``estimator.check_inputs``
  is set);
* under a plain ``jax.jit`` (the way most train steps call a loss), it is a
  ``jax.debug.callback`` that raises the ``ValueError`` on the host when the step runs;
  JAX passes it on as a ``JaxRuntimeError`` that carries the same message.

Why not ``checkify.check`` alone: under a plain ``jit`` it fails with checkify's own
"not functionalized" error, whatever the inputs, so ``check_inputs=True`` would break the
way most users call a loss, and optax-style code has no ``checkify`` wrapper. Why not the
callback alone: the learner (and anyone who already uses ``checkify``) gets the error as a
value, without an exception thrown out of a compiled step. Which of the two is staged is
decided while the function is traced, by whether ``checkify`` is tracing it (a
``jax._src.checkify`` frame on the Python stack). JAX reuses a ``jax.jit`` function's trace
for the same shapes, so call one jitted function either always or never under
``checkify``. Off by default: a check is a reduction over the inputs and a host round
trip per step.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Mapping
from typing import Any, overload

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

Array = jax.Array

# How far above 0 a log-probability (or a support's log-mass) may be from fp32 rounding.
LOGPROB_TOLERANCE = 1e-4


def under_checkify() -> bool:
    """Whether ``checkify.checkify`` is tracing the caller (a frame of JAX's checkify module
    is on the Python stack: its transform traces the function it wraps synchronously, with
    or without a ``jit`` in between)."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") == "jax._src.checkify":
            return True
        frame = frame.f_back
    return False


def _raise_unless(message: str, names: tuple[str, ...], ok, *values) -> None:
    """Host side of :func:`require` under a plain ``jit``: raise ``message`` formatted with
    the values of the first failing element (``vmap`` hands over a batch of them)."""
    ok = np.asarray(ok)
    if ok.all():
        return
    first = np.unravel_index(np.argmin(ok), ok.shape) if ok.ndim else ()
    raise ValueError(message.format(**{n: str(np.asarray(v)[first]) for n, v in zip(names, values)}))


def require(ok: Array, message: str, **values: Array) -> None:
    """Fail with ``message`` (a ``str.format`` template over ``values``, fp32 scalars) where
    the scalar ``ok`` is False: at once eagerly, as a ``checkify.check`` under ``checkify``,
    or from a ``jax.debug.callback`` under a plain ``jit`` (see the module)."""
    if under_checkify():
        check: Any = checkify.check  # its stub types the keyword arguments as `debug: bool`
        check(ok, message, **values)
        return
    try:
        concrete = bool(ok)
    except jax.errors.ConcretizationTypeError:  # traced: decided when the step runs
        names = tuple(values)
        jax.debug.callback(lambda o, *v: _raise_unless(message, names, o, *v), ok, *values.values())
        return
    if not concrete:
        raise ValueError(message.format(**{n: str(np.asarray(v)) for n, v in values.items()}))


def _pad(mask: Array, ndim: int) -> Array:
    """A ``[B, T]`` (or full-shape) mask with trailing axes added up to ``ndim``."""
    return mask.reshape(mask.shape + (1,) * (ndim - mask.ndim))


@overload
def as_mask(mask: None) -> None: ...


@overload
def as_mask(mask: Any) -> Array: ...


def as_mask(mask: Any) -> Array | None:
    """A mask as the estimators take it (bool, 0/1 or float weights; any array-like, a
    Python list too) → a bool array, True on the positions kept; ``None`` stays ``None``."""
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    return mask if mask.dtype == jnp.bool_ else mask != 0


def keep(x: Array, mask: Array | None, fill: float = 0.0) -> Array:
    """``x`` where ``mask`` (broadcast over ``x``'s trailing axes) is True, ``fill`` elsewhere.

    The estimators apply it to every input *before* any arithmetic (the "double where"):
    whatever a masked-out position holds (NaN, ±inf), neither the values nor the gradients
    see it, because the gradient of ``where`` is exactly 0 on the branch not taken, while
    ``0 · ∂f(NaN)`` in the backward pass of an ``f`` computed on the raw input would be NaN.
    ``fill`` must be a point where every later operation is finite (0 for log-probs and
    logits). ``mask`` None: ``x`` unchanged.
    """
    if mask is None:
        return x
    x = jnp.asarray(x)
    return jnp.where(_pad(mask, x.ndim), x, jnp.asarray(fill, x.dtype))


def check_mask(fn: str, mask: Array | None, like: str, shape: tuple[int, ...]) -> None:
    """An elementwise function's optional ``mask``: the shape of ``like`` (``shape``) or, for a
    ``[B, T, N]`` one, ``[B, T]`` (the per-token mask, broadcast over ``N``)."""
    if mask is None:
        return
    allowed = [list(shape)] + ([list(shape[:2])] if len(shape) == 3 else [])
    if list(np.shape(mask)) not in allowed:
        want = " or ".join(str(a) for a in allowed)
        raise ValueError(f"{fn}: mask has shape {list(np.shape(mask))}; expected {want} like {like}")


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
        names, shape = dims.split(), tuple(np.shape(array))
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
    lead = tuple(np.shape(first_array))
    if len(lead) not in ranks:
        allowed = " or ".join("[" + ", ".join("BTN"[:r]) + "]" for r in ranks)
        raise ValueError(f"{fn}: {first} has shape {list(lead)}; expected {allowed}")
    for name, array in arrays.items():
        if array is not None and tuple(np.shape(array)) != lead:
            raise ValueError(f"{fn}: {name} has shape {list(np.shape(array))}; expected {list(lead)} like {first}")


def check_logprobs(
    fn: str, arrays: Mapping[str, Array | None], supports: tuple[str, ...] = (), mask: Array | None = None
) -> None:
    """Value checks (see the module) that each array holds log-probabilities; for the names
    in ``supports`` (distinct ids on the last axis) also that their mass is at most 1.
    Positions at −inf (zero probability) pass; NaN fails. ``mask`` (``[B, T]`` or an array's
    own shape, bool): only the positions it keeps are checked."""
    for name, array in arrays.items():
        if array is None:
            continue
        x = keep(jnp.asarray(array, jnp.float32), mask, -jnp.inf)
        top = jnp.max(x)  # NaN if any: it fails and says so
        require(
            top <= LOGPROB_TOLERANCE,
            f"{fn}: {name} holds values up to {{top}}; expected log-probabilities (<= 0): raw logits?",
            top=top,
        )
        if name in supports:
            mass = jnp.max(jax.nn.logsumexp(x, axis=-1))
            require(
                mass <= LOGPROB_TOLERANCE,
                f"{fn}: {name} puts probability exp({{mass}}) > 1 on its ids; expected log-probabilities "
                "of distinct ids: raw logits, or a log-softmax over another axis?",
                mass=mass,
            )


def check_ids(fn: str, name: str, ids: Array, vocab: int, source: str, mask: Array | None = None) -> None:
    """Value check that integer ``ids`` lie in ``[0, vocab)`` (on the positions ``mask``
    keeps), failing with one line naming ``fn``, the argument and the vocabulary size (and
    the array it comes from, ``source``)."""
    ids = keep(jnp.asarray(ids), mask, 0)
    if ids.size == 0:
        return
    low, high = jnp.min(ids), jnp.max(ids)
    require(
        (low >= 0) & (high < vocab),
        f"{fn}: {name} holds ids from {{low}} to {{high}}; expected ids in [0, V) with the vocabulary "
        f"size V = {vocab} ({source})",
        low=low,
        high=high,
    )
