"""The learner's jitted train step: micro-batched, exact token mean, sharded over a mesh.

A train step is one optimizer step on one mini-batch. The mini-batch ``[B, ...]`` is cut
into ``M`` micro-batches; each contributes its numerator of the loss divided by the
denominator of the whole mini-batch (:func:`~asyncopd_jax.estimators.normalized_loss`: for
the token mean, ``Σ_tokens loss / N`` with N the mini-batch's token count; the
sequence-level aggregation modes likewise), so the summed gradients are exactly those of
the mini-batch's loss, whatever M is.
The policy version is the optimizer-step count, ``TrainState.step``.

Faults (:mod:`asyncopd_jax.learner.faults`): rows with a NaN or inf in their teacher
scores or behaviour log-probs are dropped before the loss (metric ``nonfinite_rows``); a
step whose loss, gradient or update is not finite is not applied (the state comes back
unchanged, ``TrainState.step`` included) and its metrics show it, for the caller to stop.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import checkify

from asyncopd_jax.alignment import response_hidden
from asyncopd_jax.cache import RolloutBatch, StudentLogProbs, TeacherScoreCache
from asyncopd_jax.estimator_eval import evaluate_estimator, required_ids, student_logprobs
from asyncopd_jax.estimator_registry import EstimatorConfig
from asyncopd_jax.estimators import (
    Aggregation,
    loss_denominator,
    normalized_loss,
)
from asyncopd_jax.learner.faults import drop_nonfinite_rows
from asyncopd_jax.learner.lm_head import dense_kls_on_mesh, gather_on_mesh
from asyncopd_jax.learner.packing import plan_micro_batches, take_micro_batch
from asyncopd_jax.learner.sharding import batch_shardings, put, state_shardings
from asyncopd_jax.metrics import Metrics, combine, identity, weighted
from asyncopd_jax.models.decoder import Decoder, Remat, cast_floating
from asyncopd_jax.models.lora import join, split_adapters, with_dropout
from asyncopd_jax.models.partitioning import mesh_context

if TYPE_CHECKING:
    from asyncopd_jax.config import RunConfig

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Parameters, optimizer state and the policy version (optimizer steps taken).

    ``params`` is the whole model; the optimizer's state covers only what is trained
    (:func:`~asyncopd_jax.models.lora.split_adapters`): a student with LoRA adapters keeps
    moments for its adapters (and the modules it trains whole) alone, its base frozen."""

    params: nnx.State
    opt_state: optax.OptState
    step: Array  # int32 scalar


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LearnerBatch:
    """What one optimizer step consumes: rollouts, their teacher scores, proximal log-probs."""

    rollout: RolloutBatch
    cache: TeacherScoreCache | None = None
    proximal: StudentLogProbs | None = None


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
    """The distillation (or RL) loss: the configured estimator on the student's log-probs
    of the cached ids.

    Attributes:
      estimator: the estimator and its knobs (``estimator`` of the run's config).
      distill_coef: reward-driven RL only: β, the teacher's weight in the advantage
        (``rl.distill_coef``; see :func:`~asyncopd_jax.estimator_eval.evaluate_estimator`).
      temperature: the sampler's temperature: π_θ is scored at it, so that importance
        ratios compare the distribution the behaviour policy actually sampled from.
      chunk_size: rows per chunk of the fused LM-head gather.
      remat: what each decoder layer keeps for the backward pass (``learner.remat``;
        :data:`~asyncopd_jax.models.decoder.REMAT_POLICIES`).
      compute_dtype: the dtype the forward and backward run in (``learner.compute_dtype``;
        None: the parameters' own). The parameters, their gradients and the optimizer's
        moments stay in theirs: bf16 compute over fp32 master weights (:func:`loss_model`).
      teacher_heads: ``[H_q, V]`` each teacher's LM head on the learner's devices, in the
        run's order (zero rows padding them to the cache's hidden width), for an estimator
        that reads the teachers' hidden states (``needs_teacher_hidden``); () else.
      teacher_temperatures: each teacher's scoring temperature (its log-softmax from hidden
        states is taken at it, as the scorer's is).
    """

    estimator: EstimatorConfig
    distill_coef: float = 0.0
    temperature: float = 1.0
    chunk_size: int = 512
    remat: Remat = "none"
    compute_dtype: str | None = None
    teacher_heads: tuple[Array, ...] = ()
    teacher_temperatures: tuple[float, ...] = ()

    @classmethod
    def from_config(cls, cfg: RunConfig, teacher_heads: tuple[Array, ...] = ()) -> PolicyLoss:
        """The loss a run's config asks for (``teacher_heads``: see the attribute)."""
        learner = cfg.learner
        return cls(
            cfg.estimator,
            cfg.rl.distill_coef,
            cfg.sampling.temperature,
            learner.logprob_chunk,
            learner.remat,
            learner.compute_dtype,
            teacher_heads,
            tuple(t.scoring(cfg.scoring).temperature for t in cfg.teacher_sources) if teacher_heads else (),
        )

    @property
    def aggregation(self) -> Aggregation:
        """How per-token losses become the loss (``estimator.aggregation``, see
        :mod:`asyncopd_jax.estimators.reductions`)."""
        return self.estimator.aggregation

    @property
    def check_inputs(self) -> bool:
        """Whether the estimator checks its inputs (``checkify``: the step must be functionalised)."""
        return self.estimator.check_inputs

    @property
    def needs_proximal(self) -> bool:
        """Whether the estimator reads proximal log-probs (:func:`make_proximal_fn`), as its spec says."""
        return self.estimator.spec.needs_proximal

    def student(self, model: Decoder, batch: LearnerBatch) -> StudentLogProbs:
        """The student's log-probs on every id the estimator needs (one fused gather)."""
        hidden, head = response_hidden(model, batch.rollout, self.remat), model.lm_head_weight()
        ids = required_ids(self.estimator.name, batch.rollout, batch.cache)
        student = student_logprobs(  # the entropy comes from the same pass, almost free: a metric, or a bonus
            ids, lambda i: gather_on_mesh(hidden, head, i, self.chunk_size, self.temperature)
        )
        if not self.estimator.spec.needs_teacher_hidden:
            return student
        cache = batch.cache
        if cache is None or cache.hidden is None or not self.teacher_heads:
            raise ValueError(
                f"estimator {self.estimator.name!r} needs the teacher's hidden states (TeacherScoreCache.hidden) "
                "and its head (PolicyLoss.teacher_heads)"
            )
        mask = jnp.asarray(batch.rollout.response_mask, bool)
        forward = reverse = jnp.zeros(mask.shape, jnp.float32)
        for k, (teacher_head, teacher_temperature) in enumerate(zip(self.teacher_heads, self.teacher_temperatures)):
            # each teacher's head on the rows it scored (a pass each: the rows of the others are masked)
            rows = mask if cache.teacher_index is None else mask & (cache.teacher_index == k)
            vocab = min(head.shape[1], teacher_head.shape[1])  # the ids both heads have
            kls = dense_kls_on_mesh(
                hidden,
                head[:, :vocab],
                cache.hidden.astype(hidden.dtype),
                teacher_head[:, :vocab].astype(hidden.dtype),
                rows,
                self.chunk_size,
                (self.temperature, teacher_temperature),
            )
            forward, reverse = forward + kls[0], reverse + kls[1]
        return dataclasses.replace(student, forward_kl=forward, reverse_kl=reverse)

    def __call__(self, model: Decoder, batch: LearnerBatch, denominator: Array) -> tuple[Array, Metrics]:
        values, metrics = evaluate_estimator(
            self.estimator,
            batch.rollout,
            batch.cache,
            self.student(model, batch),
            proximal=batch.proximal,
            distill_coef=self.distill_coef,
        )
        return normalized_loss(values, batch.rollout.response_mask, denominator, self.aggregation), metrics


@dataclasses.dataclass(frozen=True)
class SFTLoss:
    """Negative log-likelihood of the response tokens (supervised fine-tuning)."""

    chunk_size: int = 512
    aggregation: Aggregation = "token-mean"
    check_inputs: bool = False
    compute_dtype: str | None = None

    def __call__(self, model: Decoder, batch: LearnerBatch, denominator: Array) -> tuple[Array, Metrics]:
        hidden, head = response_hidden(model, batch.rollout), model.lm_head_weight()
        logp, _ = gather_on_mesh(hidden, head, batch.rollout.response_tokens, self.chunk_size)
        return normalized_loss(-logp, batch.rollout.response_mask, denominator, self.aggregation), Metrics()


class LossFn(Protocol):
    """A part's share of the mini-batch's loss, and its metrics: ``(model, micro-batch, the whole
    mini-batch's denominator) → (loss, metrics)``, the loss aggregated as ``aggregation``
    says, each metric as its field of :class:`~asyncopd_jax.metrics.Metrics` says."""

    @property
    def aggregation(self) -> Aggregation: ...

    @property
    def check_inputs(self) -> bool:
        """The loss makes checkify checks: the step runs them and raises on the host."""
        ...

    @property
    def compute_dtype(self) -> str | None:
        """The dtype the model computes in (None: the parameters' own; :func:`loss_model`)."""
        ...

    def __call__(self, model: Decoder, batch: LearnerBatch, denominator: Array) -> tuple[Array, Metrics]: ...


def loss_model(graphdef: nnx.GraphDef, params: nnx.State, compute_dtype: str | None) -> Decoder:
    """The model a loss sees: ``params`` (the master weights) cast to ``compute_dtype``.

    A decoder computes in its weights' dtype (:attr:`Decoder.compute_dtype`), so casting
    the weights is all mixed precision takes: the matmuls, activations and FSDP weight
    gathers run in bf16, and the gradient flows back through the cast to the fp32 master
    weights, where the optimizer's moments live too."""
    return nnx.merge(graphdef, cast_floating(params, compute_dtype))


def _checkified(fn: Callable, loss_fn: LossFn) -> Callable:
    """``fn`` with the loss's ``checkify`` checks functionalised: it returns ``(error, outputs)``
    (a no-op error when the loss makes no checks, so one code path serves both)."""
    if not loss_fn.check_inputs:
        return lambda *args: (None, fn(*args))
    return checkify.checkify(fn, errors=checkify.user_checks)


def _throw(error) -> None:
    """Raise a failed input check on the host (one line, naming the argument)."""
    if error is not None:
        error.throw()


def _denominator(loss_fn: LossFn, batch: LearnerBatch) -> Array:
    """The whole mini-batch's loss denominator (its token count for the token mean)."""
    return loss_denominator(batch.rollout.response_mask, loss_fn.aggregation)


def _split_micro_batches(tree, micro_batches: int):
    """``[B, ...]`` leaves → ``[M, B / M, ...]``."""
    return jax.tree_util.tree_map(lambda x: x.reshape(micro_batches, x.shape[0] // micro_batches, *x.shape[1:]), tree)


Accumulated = tuple[nnx.State, Array, Metrics]  # (gradients, loss, metrics) combined so far


def _micro_batch(
    graphdef: nnx.GraphDef,
    loss_fn: LossFn,
    params: nnx.State,
    mb: LearnerBatch,
    total: Array,
    denominator: Array,
    dropout_key: Array | None = None,
) -> Accumulated:
    """Gradients (of what is trained: the adapters of a LoRA student, else every weight),
    loss and metrics of one micro-batch as its share of the mini-batch: the loss is already
    normalised by the mini-batch's ``denominator``; the metrics are the micro-batch's
    :func:`~asyncopd_jax.metrics.weighted` share, its token means weighted by its share of
    the mini-batch's ``total`` tokens. ``dropout_key`` (None: none) drives the adapters'
    dropout."""
    trained, frozen = split_adapters(params)

    def objective(t):
        model = with_dropout(loss_model(graphdef, join(t, frozen), loss_fn.compute_dtype), dropout_key)
        return loss_fn(model, mb, denominator)

    (loss, metrics), grads = jax.value_and_grad(objective, has_aux=True)(trained)
    weight = jnp.sum(mb.rollout.response_mask) / jnp.maximum(total, 1.0)
    return grads, loss, weighted(metrics, weight)


def _add(acc: Accumulated, part: Accumulated) -> Accumulated:
    grads, loss, metrics = acc
    return (
        jax.tree_util.tree_map(jnp.add, grads, part[0]),
        loss + part[1],
        combine(metrics, part[2]),
    )


def _apply(optimizer: optax.GradientTransformation, state: TrainState, acc: Accumulated, total: Array):
    """The optimizer step on the summed gradients; the step's metrics.

    A loss, gradient norm or update norm that is not finite leaves the whole state as it
    was (parameters, optimizer moments, step count): a diverged step must never reach the
    weights, which the caller may checkpoint or publish. The caller sees it in the
    metrics (:func:`asyncopd_jax.learner.faults.step_is_finite`) and stops. The update
    norm is checked too because a finite loss can still give a non-finite update (e.g. an
    infinite learning rate), which would only show in the next step's loss.

    A mini-batch with no tokens to learn from (``total`` = 0: every row dropped as
    non-finite) is not a fault but must not move the weights either: Adam's momentum alone
    would. Its parameters and moments stay, its step counts (the policy version advances
    with the same weights), and it reports ``update_norm`` 0.
    """
    grads, loss, parts = acc
    trained, frozen = split_adapters(state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, trained)
    params = optax.apply_updates(trained, updates)
    grad_norm, update_norm = optax.tree.norm(grads), optax.tree.norm(updates)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & jnp.isfinite(update_norm)
    has_tokens = total > 0
    params, opt_state = jax.tree_util.tree_map(
        lambda new, old: jnp.where(finite & has_tokens, new, old), (params, opt_state), (trained, state.opt_state)
    )
    params = join(params, frozen)
    update_norm = jnp.where(has_tokens, update_norm, 0.0)  # a non-finite norm with tokens is kept: it stops the run
    metrics = {**parts.as_dict(), "loss": loss, "grad_norm": grad_norm, "update_norm": update_norm, "tokens": total}
    return TrainState(params=params, opt_state=opt_state, step=state.step + finite.astype(state.step.dtype)), metrics


def dropout_key(seed: int | None, step: Array | int, micro_batch: Array | int) -> Array | None:
    """The adapters' dropout key of one micro-batch of optimizer step ``step`` (None without
    dropout: ``seed`` None): a new mask every step and micro-batch, the same on a rerun."""
    if seed is None:
        return None
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), micro_batch)


def train_step_function(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    loss_fn: LossFn,
    *,
    micro_batches: int = 1,
    dropout_seed: int | None = None,
) -> Callable[[TrainState, LearnerBatch], tuple[checkify.Error | None, tuple[TrainState, dict[str, Array]]]]:
    """The train step as a pure function, to jit (:func:`make_train_step`) or to compile ahead
    of time at shapes only (:mod:`asyncopd_jax.scale.plan`): ``(state, batch) → (error,
    (state, metrics))``, ``error`` the loss's functionalised input checks (None if it makes none).
    ``dropout_seed`` (None: no dropout) seeds the adapters' dropout (:func:`dropout_key`)."""

    def step(state: TrainState, batch: LearnerBatch):
        batch, dropped = drop_nonfinite_rows(batch)  # before `total`: the mean is over the rows kept
        total = jnp.sum(batch.rollout.response_mask).astype(jnp.float32)
        denominator = _denominator(loss_fn, batch)
        micro_batched = _split_micro_batches(batch, micro_batches)
        first = jax.tree_util.tree_map(lambda x: x[0], micro_batched)

        def part(mb: LearnerBatch, index: Array | int) -> Accumulated:
            key = dropout_key(dropout_seed, state.step, index)
            return _micro_batch(graphdef, loss_fn, state.params, mb, total, denominator, key)

        shapes = jax.eval_shape(lambda: part(first, 0))
        zeros = (
            jax.tree_util.tree_map(jnp.zeros_like, shapes[0]),
            jnp.zeros((), jnp.float32),
            identity(shapes[2]),
        )
        acc, _ = jax.lax.scan(
            lambda acc, item: (_add(acc, part(*item)), None), zeros, (micro_batched, jnp.arange(micro_batches))
        )
        state, metrics = _apply(optimizer, state, acc, total)
        return state, {**metrics, "nonfinite_rows": jnp.sum(dropped)}

    return _checkified(step, loss_fn)


def jit_train_step(step: Callable, mesh: jax.sharding.Mesh | None = None, state_example: TrainState | None = None):
    """:func:`train_step_function`'s step jitted with the state donated; on ``mesh``, the state
    comes back FSDP-sharded as ``state_example`` is (:func:`state_shardings`) and the
    metrics and error replicated."""
    if mesh is None:
        return jax.jit(step, donate_argnums=(0,))
    if state_example is None:
        raise ValueError("a train step on a mesh needs state_example to derive the shardings")
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.jit(
        step, donate_argnums=(0,), out_shardings=(replicated, (state_shardings(state_example, mesh), replicated))
    )


def make_train_step(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    loss_fn: LossFn,
    *,
    micro_batches: int = 1,
    mesh: jax.sharding.Mesh | None = None,
    state_example: TrainState | None = None,
    dropout_seed: int | None = None,
) -> Callable[[TrainState, LearnerBatch], tuple[TrainState, dict[str, Array]]]:
    """A jitted ``(state, batch) → (state, metrics)`` doing one optimizer step.

    Metrics are those of the whole mini-batch, whatever the micro-batches: the loss's
    (:class:`~asyncopd_jax.metrics.Metrics`: token means, token-weighted over micro-batches;
    maxima, the max over them) and ``loss``, plus ``grad_norm``, ``update_norm``, ``tokens`` (the tokens trained on) and
    ``nonfinite_rows`` (rows dropped for a NaN / inf in their scores, see
    :func:`~asyncopd_jax.learner.faults.drop_nonfinite_rows`); the state is donated, and
    comes back unchanged if the loss, gradient or update is not finite. With ``mesh`` (and a
    ``state_example`` to derive shardings from) parameters and optimizer state are
    FSDP-sharded and the batch is split over ``(data, fsdp)``. ``dropout_seed``: the
    adapters' dropout (:func:`dropout_key`; None: none).
    """
    function = train_step_function(graphdef, optimizer, loss_fn, micro_batches=micro_batches, dropout_seed=dropout_seed)
    jitted = jit_train_step(function, mesh, state_example)

    def place(batch: LearnerBatch) -> LearnerBatch:
        return batch if mesh is None else put(batch, batch_shardings(batch, mesh))

    def train_step(state: TrainState, batch: LearnerBatch):
        with mesh_context(mesh):  # traced under the mesh: activation constraints, Pallas kernels' shard_map
            error, out = jitted(state, place(batch))
        _throw(error)
        return out

    return train_step


def make_packed_train_step(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    loss_fn: LossFn,
    *,
    token_budget: int,
    bucket: int = 8,
    mesh: jax.sharding.Mesh | None = None,
    state_example: TrainState | None = None,
    dropout_seed: int | None = None,
) -> Callable[[TrainState, LearnerBatch], tuple[TrainState, dict[str, Array]]]:
    """As :func:`make_train_step`, with dynamic batching: the mini-batch is cut into
    token-budget micro-batches of similar-length rows, each trimmed to its own slots
    (:mod:`asyncopd_jax.learner.packing`); one jitted gradient per micro-batch (compiled
    once per bucketed shape), then one jitted optimizer step on their sum. The metrics
    add ``micro_batches`` and ``padding_fraction`` (padded slots / all slots computed).
    Dropped non-finite rows (``nonfinite_rows``) are still packed, with no response
    tokens: they cost their prompt slots and weigh nothing."""
    rows_per_device = 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]
    gradients = jax.jit(_checkified(functools.partial(_micro_batch, graphdef, loss_fn), loss_fn))
    add = jax.jit(_add, donate_argnums=(0,))
    drop = jax.jit(drop_nonfinite_rows)  # one dispatch, not one per field
    apply = jax.jit(functools.partial(_apply, optimizer), donate_argnums=(0,))
    if mesh is not None:  # keep parameters and moments FSDP-sharded as create_train_state placed them
        if state_example is None:
            raise ValueError("make_packed_train_step with a mesh needs state_example to derive the shardings")
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        apply = jax.jit(
            functools.partial(_apply, optimizer),
            donate_argnums=(0,),
            out_shardings=(state_shardings(state_example, mesh), replicated),
        )

    def step(state: TrainState, batch: LearnerBatch):
        batch, dropped = drop(batch)  # before planning: dropped rows have no tokens
        prompt_mask, response_mask = np.asarray(batch.rollout.prompt_mask), np.asarray(batch.rollout.response_mask)
        context = np.asarray(batch.rollout.context_mask)  # a trajectory's slots: its student and environment tokens
        plans = plan_micro_batches(
            prompt_mask.sum(1),
            context.sum(1),
            prompt_slots=prompt_mask.shape[1],
            response_slots=response_mask.shape[1],
            token_budget=token_budget,
            bucket=bucket,
            row_multiple=rows_per_device,
        )
        total = jnp.asarray(response_mask.sum(), jnp.float32)
        denominator = _denominator(loss_fn, batch)  # of the untrimmed mini-batch: its T is the horizon
        acc = None
        for index, plan in enumerate(plans):
            mb = take_micro_batch(batch, plan)
            if mesh is not None:
                mb = jax.device_put(mb, batch_shardings(mb, mesh))
            key = dropout_key(dropout_seed, state.step, index)
            with mesh_context(mesh):
                error, part = gradients(state.params, mb, total, denominator, key)
            _throw(error)
            acc = part if acc is None else add(acc, part)
        state, metrics = apply(state, acc, total)
        slots = sum(p.padded_tokens for p in plans)
        real = int(prompt_mask.sum() + context.sum())
        return state, {
            **metrics,
            "micro_batches": len(plans),
            "padding_fraction": 1 - real / slots,
            "nonfinite_rows": int(np.sum(np.asarray(dropped))),
        }

    return step


def create_train_state(
    model: Decoder, optimizer: optax.GradientTransformation, mesh: jax.sharding.Mesh | None = None
) -> tuple[nnx.GraphDef, TrainState]:
    """Split ``model`` into graph and parameters and initialise the optimizer (for what is
    trained: :func:`~asyncopd_jax.models.lora.split_adapters`), on ``mesh``.

    With a mesh the parameters are placed by :func:`state_shardings` (a no-op for weights
    loaded there already) and the optimizer state is created there by a jitted ``init``
    whose outputs are sharded the same way: no moment is ever whole on one device."""
    graphdef, params = nnx.split(model)
    if mesh is None:
        return graphdef, initial_state(params, optimizer)
    params = jax.device_put(params, state_shardings(params, mesh))
    initial = functools.partial(initial_state, optimizer=optimizer)
    init = jax.jit(initial, out_shardings=state_shardings(jax.eval_shape(initial, params), mesh))
    return graphdef, init(params)


def initial_state(params: nnx.State, optimizer: optax.GradientTransformation) -> TrainState:
    """Step 0: ``params`` and the optimizer's state of what is trained (a LoRA student's
    adapters alone: :func:`~asyncopd_jax.models.lora.split_adapters`)."""
    return TrainState(params=params, opt_state=optimizer.init(split_adapters(params)[0]), step=jnp.zeros((), jnp.int32))


def make_proximal_fn(
    graphdef: nnx.GraphDef, loss: PolicyLoss, mesh: jax.sharding.Mesh | None = None
) -> Callable[[nnx.State, LearnerBatch], StudentLogProbs]:
    """No-grad log-probs of the current weights on a batch's cached ids: π_prox of
    decoupled PPO, computed once per rollout batch before its first optimizer step (on
    ``mesh``, the learner's, where the weights are)."""

    @jax.jit
    def jitted(params: nnx.State, batch: LearnerBatch) -> StudentLogProbs:
        # in the loss's compute dtype: π_prox and π_θ must agree exactly before the first step
        return jax.lax.stop_gradient(loss.student(loss_model(graphdef, params, loss.compute_dtype), batch))

    def proximal(params: nnx.State, batch: LearnerBatch) -> StudentLogProbs:
        with mesh_context(mesh):
            return jitted(params, batch)

    return proximal
