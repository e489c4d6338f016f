"""Wrong inputs fail with one line naming the argument: shapes at trace time, values with
``check_inputs`` (checkify), eagerly and under jit."""

from __future__ import annotations

import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import asyncopd_jax.estimators as est

B, T, K, N, V = 2, 4, 8, 5, 11


def _logp(*shape, seed=0):
    """Log-probs of the first ``shape[-1]`` of V ids (a top-K support), ``shape[:-1]`` positions."""
    probs = np.random.default_rng(seed).dirichlet(np.ones(V), size=shape[:-1])
    return jnp.log(jnp.asarray(probs, jnp.float32))[..., : shape[-1]]


def _named(argument: str) -> str:
    """A pattern for a message that starts with ``argument`` ("estimator: argument"), alone
    or as the ValueError a host callback's error carries."""
    return rf"(^|ValueError: ){argument}"


def _one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text, text
    return text


@pytest.mark.parametrize(
    "call,message",
    [
        # [B, T] where [B, T, K] is expected (it used to return [B] silently)
        (
            lambda: est.forward_kl_topk(_logp(B, T, K), _logp(B, T, K)[..., 0]),
            r"forward_kl_topk: teacher_logp has shape \[2, 4\]; expected \[B, T, K\] = \[2, 4, 8\]$",
        ),
        (
            lambda: est.forward_kl_topk(_logp(B, T, K)[..., 0], _logp(B, T, K)[..., 0]),
            r"forward_kl_topk: student_logp has shape \[2, 4\]; expected \[B, T, K\] \(rank 3\)$",
        ),
        # a K mismatch names the K passed (it used to say K + 1: the hidden tail bucket)
        (
            lambda: est.forward_kl_topk(_logp(B, T, K), _logp(B, T, 7)),
            r"forward_kl_topk: teacher_logp has shape \[2, 4, 7\]; expected \[B, T, K\] = \[2, 4, 8\] "
            r"\(K = 8 from student_logp\)$",
        ),
        (
            lambda: est.reverse_kl_topk(_logp(B, T, K), _logp(B, T, 3)),
            r"reverse_kl_topk: teacher_logp .*\(K = 8 from student_logp\)",
        ),
        (
            lambda: est.forward_kl_mc(_logp(B, T, N), _logp(B, T, N)[:1]),
            r"forward_kl_mc: teacher_logp has shape \[1, 4, 5\]; expected \[B, T, N\] = \[2, 4, 5\] "
            r"\(B = 2 from student_logp\)",
        ),
        (
            lambda: est.reverse_kl_mc(_logp(B, T, N), _logp(B, T, N), _logp(B, T, 4)),
            r"reverse_kl_mc: teacher_logp has shape \[2, 4, 4\]; expected \[B, T, N\] = \[2, 4, 5\] \(N = 5",
        ),
        (
            lambda: est.reverse_kl_mc_loo(_logp(B, T, N), _logp(B, T), _logp(B, T, N)),
            r"reverse_kl_mc_loo: behavior_logp",
        ),
        (
            lambda: est.reverse_kl_hybrid(
                _logp(B, T, K),
                _logp(B, T, K),
                jnp.zeros((B, T, 3), jnp.int32),
                _logp(B, T, N),
                _logp(B, T, N),
                _logp(B, T, N),
                jnp.zeros((B, T, N), jnp.int32),
            ),
            r"reverse_kl_hybrid: support_ids has shape \[2, 4, 3\]; expected \[B, T, K\] = \[2, 4, 8\]",
        ),
        (lambda: est.forward_kl_dense(jnp.zeros((B, T, V)), jnp.zeros((B, V))), r"forward_kl_dense: teacher_logits"),
        (
            lambda: est.ppo_clip_loss(_logp(B, T), _logp(B, T), jnp.zeros((B,))),
            r"ppo_clip_loss: advantages has shape \[2\]; expected \[2, 4\] like logp",
        ),
        (
            lambda: est.ppo_clip_loss(_logp(B, T)[0, 0], _logp(B, T)[0, 0], jnp.zeros(())),
            r"ppo_clip_loss: logp has shape \[\]; expected \[B, T\] or \[B, T, N\]",
        ),
        (
            lambda: est.decoupled_ppo_loss(_logp(B, T), _logp(B, T, 1), _logp(B, T), jnp.zeros((B, T))),
            r"decoupled_ppo_loss: proximal_logp",
        ),
        (lambda: est.truncated_is_loss(_logp(B, T), _logp(B, T), jnp.zeros((T, B))), r"truncated_is_loss: advantages"),
        (
            lambda: est.m2po_loss(_logp(B, T), _logp(B, T), jnp.zeros((B, T)), jnp.ones((B, 3), bool)),
            r"m2po_loss: mask",
        ),
        (
            lambda: est.gspo_loss(_logp(B, T, N), _logp(B, T, N), jnp.zeros((B, T, N)), jnp.ones((B, T, N), bool)),
            r"gspo_loss: logp has shape \[2, 4, 5\]; expected \[B, T\] \(rank 2\)",
        ),
        (
            lambda: est.aggregate(jnp.zeros((B, T)), jnp.ones((B, T + 1), bool), "seq-mean-token-mean"),
            r"loss_numerator \(seq-mean-token-mean\): mask has shape \[2, 5\]; expected \[B, T\] = \[2, 4\]",
        ),
        (lambda: est.reference_kl(_logp(B, T), _logp(B, T, 1)), r"reference_kl: reference_logp"),
        (lambda: est.reference_kl(_logp(B, T), _logp(B, T), mask=np.ones((B, T + 1), bool)), r"reference_kl: mask"),
        (
            lambda: est.forward_kl_mc(_logp(B, T, N), _logp(B, T, N), mask=jnp.ones((1, T), bool)),
            r"forward_kl_mc: mask has shape \[1, 4\]; expected \[B, T\] = \[2, 4\]",
        ),
        (
            lambda: est.reverse_kl_dense(jnp.zeros((B, V)), jnp.zeros((B, T, V))),
            r"reverse_kl_dense: student_logits has shape \[2, 11\]",
        ),
        (
            lambda: est.gspo_loss(_logp(B, T), _logp(B, T), jnp.zeros((1, T)), jnp.ones((B, T), bool)),
            r"gspo_loss: advantages has shape \[1, 4\]; expected \[B, T\] = \[2, 4\]",
        ),
        (
            lambda: est.with_distillation(jnp.zeros((B, T)), _logp(B, T, 1), _logp(B, T), 0.5),
            r"with_distillation: teacher_logp",
        ),
        (
            lambda: est.with_distillation(jnp.zeros(B), _logp(B, T), _logp(B, T, 1), 0.5),
            r"with_distillation: student_logp",
        ),
    ],
)
def test_a_wrong_shape_names_the_argument_and_the_expected_shape(call, message):
    with pytest.raises(ValueError, match=message) as err:
        call()
    _one_line(err)
    with pytest.raises(ValueError, match=message.rstrip("$")):  # at trace time, under jit as well
        jax.jit(call)()


LOGITS = jnp.asarray(np.random.default_rng(1).normal(scale=3.0, size=(B, T, K)) + 4.0, jnp.float32)


# (call, "the estimator: the argument" its message names)
CHECKED_CALLS = [
    (lambda lp, bad: est.forward_kl_topk(lp, bad, check_inputs=True), "forward_kl_topk: teacher_logp"),
    (lambda lp, bad: est.reverse_kl_topk(bad, lp, check_inputs=True), "reverse_kl_topk: student_logp"),
    (lambda lp, bad: est.forward_kl_mc(lp, bad, check_inputs=True), "forward_kl_mc: teacher_logp"),
    (lambda lp, bad: est.reverse_kl_mc(lp, bad, lp, check_inputs=True), "reverse_kl_mc: behavior_logp"),
    (lambda lp, bad: est.reverse_kl_mc_loo(lp, lp, bad, check_inputs=True), "reverse_kl_mc_loo: teacher_logp"),
    (
        lambda lp, bad: est.reverse_kl_hybrid(
            lp,
            lp,
            jnp.broadcast_to(jnp.arange(K), (B, T, K)),
            lp,
            bad,
            lp,
            jnp.zeros((B, T, K), jnp.int32),
            check_inputs=True,
        ),
        "reverse_kl_hybrid: candidate_behavior_logp",
    ),
    (lambda lp, bad: est.ppo_clip_loss(bad, lp, lp, check_inputs=True), "ppo_clip_loss: logp"),
    (lambda lp, bad: est.decoupled_ppo_loss(lp, bad, lp, lp, check_inputs=True), "decoupled_ppo_loss: proximal_logp"),
    (lambda lp, bad: est.truncated_is_loss(lp, bad, lp, check_inputs=True), "truncated_is_loss: behavior_logp"),
    (
        lambda lp, bad: est.m2po_loss(lp, bad, lp, jnp.ones(lp.shape, bool), check_inputs=True),
        "m2po_loss: behavior_logp",
    ),
    (
        lambda lp, bad: est.gspo_loss(lp[..., 0], bad[..., 0], lp[..., 0], jnp.ones((B, T), bool), check_inputs=True),
        "gspo_loss: behavior_logp",
    ),
    (lambda lp, bad: est.reference_kl(lp, bad, check_inputs=True), "reference_kl: reference_logp"),
    (lambda lp, bad: est.reference_kl(bad, lp, "k2", check_inputs=True), "reference_kl: logp"),
]


@pytest.mark.parametrize("call,argument", CHECKED_CALLS)
def test_check_inputs_catches_raw_logits(call, argument):
    good = _logp(B, T, K)
    with pytest.raises(Exception, match=_named(argument) + " holds values up to .*; expected log-probabilities"):
        call(good, LOGITS)  # eagerly: at once
    error, _ = checkify.checkify(jax.jit(call))(good, LOGITS)  # under jit: functionalised
    with pytest.raises(Exception, match=_named(argument) + " holds values up to"):
        error.throw()
    error, out = checkify.checkify(jax.jit(call))(good, good)  # log-probs pass
    assert error.get() is None and np.all(np.isfinite(out))
    call(good, good)  # and eagerly


def test_a_support_carrying_more_than_probability_one_fails():
    """Logits shifted to be all negative pass the sign check but not the mass check on a
    support of distinct ids (a log-softmax over the wrong axis does the same)."""
    negative = jnp.full((B, T, K), -0.5)  # every id at probability 0.61: 4.9 in all
    squashed = jax.nn.log_softmax(jnp.asarray(np.random.default_rng(2).normal(size=(B, T, K)), jnp.float32), axis=0)
    for bad in (negative, squashed):
        assert float(jnp.max(bad)) <= 0
        with pytest.raises(Exception, match=r"forward_kl_topk: teacher_logp puts probability exp\(.*\) > 1 on its ids"):
            est.forward_kl_topk(_logp(B, T, K), bad, check_inputs=True)
    est.forward_kl_topk(_logp(B, T, K), _logp(B, T, K), check_inputs=True)


def test_without_check_inputs_nothing_is_checked():
    """The default: no checkify check is staged (so plain jit works) and logits go through."""
    good = _logp(B, T, K)
    assert jax.jit(lambda a, b: est.forward_kl_topk(a, b))(good, LOGITS).shape == (B, T)


@pytest.mark.parametrize("call,argument", CHECKED_CALLS)
def test_check_inputs_works_under_a_plain_jit(call, argument):
    """The way most train steps call a loss: ``jax.jit`` without ``checkify``. It used to fail
    with checkify's own "not functionalized" error, on good inputs too; now good inputs pass
    and bad ones raise the same one-line message from the step (a host callback)."""
    good = _logp(B, T, K)
    step = jax.jit(lambda a, b: call(a, b))  # a fresh function: no trace made under checkify
    assert np.all(np.isfinite(step(good, good)))
    with pytest.raises(Exception, match=_named(argument) + " holds values up to .*; expected log-probabilities"):
        jax.block_until_ready(step(good, LOGITS))


# LOGITS fail two checks of a log-prob argument (values > 0, and a top-K whose mass is > 1).
# Under a plain jit each is a host callback, and XLA runs unordered callbacks in an order of
# its choosing (ordered ones are refused under vmap): the step raises whichever ran first,
# each naming the estimator and the argument (seen: the mass one, once in a full run).
BAD_TEACHER = r"forward_kl_topk: teacher_logp (holds values up to|puts probability exp\(.*\) > 1 on its ids)"


def test_check_inputs_under_jit_of_grad_and_vmap():
    good = _logp(B, T, K)

    def loss(a, b):
        return jnp.sum(est.forward_kl_topk(a, b, check_inputs=True))

    grad = jax.jit(jax.grad(loss))
    assert np.all(np.isfinite(grad(good, good)))
    with pytest.raises(Exception, match=BAD_TEACHER):
        jax.block_until_ready(grad(good, LOGITS))
    batched = jax.jit(jax.vmap(loss))
    stack = jnp.stack([good, good])
    assert np.all(np.isfinite(batched(stack, stack)))
    with pytest.raises(Exception, match=BAD_TEACHER):
        jax.block_until_ready(batched(stack, jnp.stack([good, LOGITS])))  # only the second is bad


def test_check_inputs_skips_the_positions_the_mask_leaves_out():
    """Padding may hold anything (NaN, logits): with the mask it is not checked; without the
    mask the NaN fails, named as such."""
    mask = np.ones((B, T), bool)
    mask[1, 2:] = False
    padded = jnp.where(mask[..., None], _logp(B, T, K), jnp.nan)
    padded = padded.at[1, 3].set(LOGITS[1, 3])
    est.forward_kl_topk(_logp(B, T, K), padded, mask=mask, check_inputs=True)
    jax.block_until_ready(
        jax.jit(lambda a, b: est.forward_kl_topk(a, b, mask=mask, check_inputs=True))(_logp(B, T, K), padded)
    )
    error, _ = checkify.checkify(jax.jit(lambda a, b: est.reverse_kl_mc(a, b, b, mask=mask, check_inputs=True)))(
        _logp(B, T, K), padded
    )
    assert error.get() is None
    with pytest.raises(ValueError, match=r"forward_kl_topk: teacher_logp holds values up to nan"):
        est.forward_kl_topk(_logp(B, T, K), padded, check_inputs=True)  # no mask: the padding is checked
    # the sequence-level and the regulariser's checks skip it too
    lp, padded_lp = _logp(B, T, K)[..., 0], padded[..., 0]
    est.gspo_loss(lp, padded_lp, jnp.zeros((B, T)), mask, check_inputs=True)
    est.reference_kl(lp, padded_lp, mask=mask, check_inputs=True)


# --- every argument of every estimator: its shape contract, dimension by dimension ------------

SIZES = {"B": B, "T": T, "K": K, "N": N, "V": V}
# estimator → (its array arguments: name, dims, positional?), as its docstring gives them.
# Stabilisers take [B, T] (or [B, T, N]) arrays that must all share logp's shape.
CONTRACTS = {
    est.forward_kl_dense: [("student_logits", "B T V", 1), ("teacher_logits", "B T V", 1), ("mask", "B T", 0)],
    est.reverse_kl_dense: [("student_logits", "B T V", 1), ("teacher_logits", "B T V", 1), ("mask", "B T", 0)],
    est.forward_kl_topk: [("student_logp", "B T K", 1), ("teacher_logp", "B T K", 1), ("mask", "B T", 0)],
    est.forward_kl_topk_renormalized: [("student_logp", "B T K", 1), ("teacher_logp", "B T K", 1), ("mask", "B T", 0)],
    est.reverse_kl_topk: [("student_logp", "B T K", 1), ("teacher_logp", "B T K", 1), ("mask", "B T", 0)],
    est.forward_kl_mc: [("student_logp", "B T N", 1), ("teacher_logp", "B T N", 1), ("mask", "B T", 0)],
    est.reverse_kl_mc: [
        ("student_logp", "B T N", 1),
        ("behavior_logp", "B T N", 1),
        ("teacher_logp", "B T N", 1),
        ("mask", "B T", 0),
    ],
    est.reverse_kl_mc_loo: [
        ("student_logp", "B T N", 1),
        ("behavior_logp", "B T N", 1),
        ("teacher_logp", "B T N", 1),
        ("mask", "B T", 0),
    ],
    est.reverse_kl_hybrid: [
        ("support_student_logp", "B T K", 1),
        ("support_teacher_logp", "B T K", 1),
        ("support_ids", "B T K", 1),
        ("candidate_student_logp", "B T N", 1),
        ("candidate_behavior_logp", "B T N", 1),
        ("candidate_teacher_logp", "B T N", 1),
        ("candidate_ids", "B T N", 1),
        ("mask", "B T", 0),
    ],
    est.ppo_clip_loss: [("logp", "B T", 1), ("behavior_logp", "B T", 1), ("advantages", "B T", 1), ("mask", "B T", 0)],
    est.decoupled_ppo_loss: [
        ("logp", "B T", 1),
        ("proximal_logp", "B T", 1),
        ("behavior_logp", "B T", 1),
        ("advantages", "B T", 1),
        ("mask", "B T", 0),
    ],
    est.truncated_is_loss: [
        ("logp", "B T", 1),
        ("behavior_logp", "B T", 1),
        ("advantages", "B T", 1),
        ("mask", "B T", 0),
    ],
    est.gspo_loss: [("logp", "B T", 1), ("behavior_logp", "B T", 1), ("advantages", "B T", 1), ("mask", "B T", 1)],
    est.m2po_mask: [("logp", "B T", 1), ("behavior_logp", "B T", 1), ("mask", "B T", 1)],
    est.m2po_loss: [("logp", "B T", 1), ("behavior_logp", "B T", 1), ("advantages", "B T", 1), ("mask", "B T", 1)],
    est.second_moment_clip_range: [
        ("logp", "B T", 1),
        ("behavior_logp", "B T", 1),
        ("advantages", "B T", 1),
        ("mask", "B T", 1),
    ],
    est.second_moment_clip_loss: [
        ("logp", "B T", 1),
        ("behavior_logp", "B T", 1),
        ("advantages", "B T", 1),
        ("mask", "B T", 1),
    ],
    est.reference_kl: [("logp", "B T", 1), ("reference_logp", "B T", 1), ("mask", "B T", 0)],
}


def _arguments(contract, wrong: str | None = None, axis: int = 0, mask_row: int | None = None):
    """Valid positional and keyword arguments for ``contract``, but argument ``wrong`` one
    longer on ``axis``; with ``mask_row``, the mask leaves that row's last position out."""
    args, kwargs = [], {}
    for i, (name, dims, positional) in enumerate(contract):
        shape = [SIZES[d] for d in dims.split()]
        if name == wrong:
            shape[axis] += 1
        if name == "mask":
            value = np.ones(shape, bool)
            if mask_row is not None:
                value[mask_row, -1] = False
            value = jnp.asarray(value)
        elif name.endswith("_ids"):
            value = jnp.broadcast_to(jnp.arange(shape[-1]), shape)  # distinct ids per position
        elif name.endswith("logits") or name == "advantages":
            value = jnp.asarray(np.random.default_rng(i).normal(size=shape), jnp.float32)
        else:
            value = _logp(*shape, seed=i) if len(shape) == 3 else _logp(*shape, 1, seed=i)[..., 0]
        if positional:
            args.append(value)
        else:
            kwargs[name] = value
    return args, kwargs


SHAPE_CASES = [
    (fn, name, axis)
    for fn, contract in CONTRACTS.items()
    for name, dims, _ in contract
    for axis in range(len(dims.split()))
]


@pytest.mark.parametrize(
    "fn,wrong,axis", SHAPE_CASES, ids=[f"{fn.__name__}-{name}-{axis}" for fn, name, axis in SHAPE_CASES]
)
def test_every_dimension_of_every_argument_is_checked_and_named(fn, wrong, axis):
    """One dimension of one argument off by one fails at trace time, with one line that
    starts with the estimator's name and names only the estimator's own arguments, the
    wrong one among them."""
    contract = CONTRACTS[fn]
    args, kwargs = _arguments(contract, wrong, axis)
    with pytest.raises(ValueError) as err:
        fn(*args, **kwargs)
    message = _one_line(err)
    assert message.startswith(f"{fn.__name__}: "), message
    named = set(re.findall(r"(\w+) has shape|like (\w+)|from (\w+)\)", message))
    named = {n for group in named for n in group if n}
    assert wrong in named and named <= {name for name, _, _ in contract}, message


# Not here: second_moment_clip_range returns the clip range (a scalar, nothing per position),
# and second_moment_clip_loss's loss is on every token by design (the mask only chooses
# the range; test_stabilisers.py checks what it does outside the mask).
PER_POSITION = [fn for fn in CONTRACTS if fn not in (est.second_moment_clip_range, est.second_moment_clip_loss)]


@pytest.mark.parametrize("fn", PER_POSITION, ids=[fn.__name__ for fn in PER_POSITION])
def test_every_estimator_is_zero_where_the_mask_leaves_a_position_out(fn):
    args, kwargs = _arguments(CONTRACTS[fn], mask_row=1)
    out = np.asarray(fn(*args, **kwargs))
    assert out.ndim >= 2, f"{fn.__name__} returns shape {list(out.shape)}: not per position"
    assert out[1, -1] == 0 if out.ndim == 2 else np.all(out[1, -1] == 0)
    assert np.any(out[0] != 0) or np.any(out[1, :-1] != 0)  # not zero everywhere: the check can fail


VALUE_CASES = [
    (fn, name)
    for fn, contract in CONTRACTS.items()
    if "check_inputs" in inspect.signature(fn).parameters
    for name, _, _ in contract
    if name.endswith("logp")
]


def _with_value(contract, args, kwargs, name: str, value: float, where=(slice(None), slice(None))):
    """``args`` / ``kwargs`` with argument ``name`` set to ``value`` at ``where``."""
    positional = [n for n, _, p in contract if p]
    position = positional.index(name) if name in positional else None
    old = args[position] if position is not None else kwargs[name]
    new = old.at[where].set(value)
    if position is not None:
        args = [*args[:position], new, *args[position + 1 :]]
    else:
        kwargs = {**kwargs, name: new}
    return args, kwargs


@pytest.mark.parametrize("fn,name", VALUE_CASES, ids=[f"{fn.__name__}-{name}" for fn, name in VALUE_CASES])
def test_check_inputs_checks_every_logprob_argument_where_the_mask_keeps_it(fn, name):
    """A positive "log-prob" in any one log-prob argument fails, naming that argument; the
    same value where the mask leaves the position out passes."""
    contract = CONTRACTS[fn]
    args, kwargs = _arguments(contract, mask_row=1)
    bad_args, bad_kwargs = _with_value(contract, args, kwargs, name, 3.0, (0, 1))
    with pytest.raises(ValueError, match=rf"^{fn.__name__}: {name} holds values up to 3.0; expected log-probabilities"):
        fn(*bad_args, **bad_kwargs, check_inputs=True)
    masked_args, masked_kwargs = _with_value(contract, args, kwargs, name, 3.0, (1, -1))
    fn(*masked_args, **masked_kwargs, check_inputs=True)  # left out by the mask: not checked


SUPPORT_CASES = [
    (est.forward_kl_topk, "student_logp"),
    (est.forward_kl_topk, "teacher_logp"),
    (est.reverse_kl_topk, "student_logp"),
    (est.reverse_kl_topk, "teacher_logp"),
    (est.reverse_kl_hybrid, "support_student_logp"),
    (est.reverse_kl_hybrid, "support_teacher_logp"),
]


@pytest.mark.parametrize("fn,name", SUPPORT_CASES, ids=[f"{fn.__name__}-{name}" for fn, name in SUPPORT_CASES])
def test_check_inputs_checks_the_mass_of_every_top_k_support(fn, name):
    """Every id at probability 1/2 (all values ≤ 0, but K/2 > 1 in all) fails the mass check
    of that argument, by name."""
    contract = CONTRACTS[fn]
    args, kwargs = _arguments(contract)
    bad_args, bad_kwargs = _with_value(contract, args, kwargs, name, float(np.log(0.5)))
    with pytest.raises(ValueError, match=rf"^{fn.__name__}: {name} puts probability exp\(.*\) > 1 on its ids"):
        fn(*bad_args, **bad_kwargs, check_inputs=True)


def test_gather_logprobs_names_itself_and_keeps_nan_logits_at_masked_positions_out_of_the_gradient():
    logits = jnp.asarray(np.random.default_rng(3).normal(size=(B, T, V)), jnp.float32)
    ids = jnp.zeros((B, T), jnp.int32)
    with pytest.raises(ValueError, match=r"^gather_logprobs: mask has shape \[2, 5\]"):
        est.gather_logprobs(logits, ids, mask=jnp.ones((B, T + 1), bool))
    mask = jnp.asarray(np.arange(T)[None] < np.array([T, 2])[:, None])
    poisoned = jnp.where(mask[..., None], logits, jnp.nan)

    def loss(x):
        return jnp.sum(est.gather_logprobs(x, ids, mask=mask))

    grad = jax.grad(loss)(poisoned)
    assert np.isfinite(np.asarray(grad)).all()
    np.testing.assert_allclose(grad, jax.grad(loss)(logits), rtol=1e-6)
