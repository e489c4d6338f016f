"""The learner's jitted train step: micro-batched, exact token mean, sharded over a mesh.

A train step is one optimizer step on one mini-batch. The mini-batch ``[B, ...]`` is cut
into ``M`` micro-batches; each contributes ``Σ_tokens loss / N`` where N is the token
count of the whole mini-batch (:func:`~asyncopd_jax.estimators.normalized_token_sum`), so
the summed gradients are exactly those of the mini-batch token mean, whatever M is.
The policy version is the optimizer-step count, ``TrainState.step``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from asyncopd_jax.alignment import response_hidden
from asyncopd_jax.cache import RolloutBatch, StudentLogProbs, TeacherScoreCache
from asyncopd_jax.estimator_registry import EstimatorOptions, evaluate_estimator, required_ids, student_logprobs
from asyncopd_jax.estimators import gather_logprobs_from_hidden, normalized_token_sum
from asyncopd_jax.learner.sharding import batch_shardings, state_shardings
from asyncopd_jax.models.decoder import Decoder

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Parameters, optimizer state and the policy version (optimizer steps taken)."""

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
    """The distillation loss: a named estimator on the student's log-probs of cached ids.

    Attributes:
      estimator: a name from :data:`asyncopd_jax.estimator_registry.ESTIMATORS`.
      options: estimator knobs.
      temperature: the sampler's temperature: π_θ is scored at it, so that importance
        ratios compare the distribution the behaviour policy actually sampled from.
      chunk_size: rows per chunk of the fused LM-head gather.
    """

    estimator: str
    options: EstimatorOptions = EstimatorOptions()
    temperature: float = 1.0
    chunk_size: int = 512

    def student(self, model: Decoder, batch: LearnerBatch) -> StudentLogProbs:
        """The student's log-probs on every id the estimator needs (one fused gather)."""
        hidden, head = response_hidden(model, batch.rollout), model.lm_head_weight()
        ids = required_ids(self.estimator, batch.rollout, batch.cache)
        return student_logprobs(
            ids, lambda i: gather_logprobs_from_hidden(hidden, head, i, self.chunk_size, self.temperature)
        )

    def __call__(self, model: Decoder, batch: LearnerBatch, total_tokens: Array) -> tuple[Array, dict[str, Array]]:
        values, metrics = evaluate_estimator(
            self.estimator, batch.rollout, batch.cache, self.student(model, batch),
            proximal=batch.proximal, options=self.options,
        )
        return normalized_token_sum(values, batch.rollout.response_mask, total_tokens), metrics


@dataclasses.dataclass(frozen=True)
class SFTLoss:
    """Negative log-likelihood of the response tokens (supervised fine-tuning)."""

    chunk_size: int = 512

    def __call__(self, model: Decoder, batch: LearnerBatch, total_tokens: Array) -> tuple[Array, dict[str, Array]]:
        hidden, head = response_hidden(model, batch.rollout), model.lm_head_weight()
        logp = gather_logprobs_from_hidden(hidden, head, batch.rollout.response_tokens, self.chunk_size)
        nll = normalized_token_sum(-logp, batch.rollout.response_mask, total_tokens)
        return nll, {}


LossFn = Callable[[Decoder, LearnerBatch, Array], tuple[Array, dict[str, Array]]]


def _split_micro_batches(tree, micro_batches: int):
    """``[B, ...]`` leaves → ``[M, B / M, ...]``."""
    return jax.tree_util.tree_map(lambda x: x.reshape(micro_batches, x.shape[0] // micro_batches, *x.shape[1:]), tree)


def make_train_step(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    loss_fn: LossFn,
    *,
    micro_batches: int = 1,
    mesh: jax.sharding.Mesh | None = None,
    state_example: TrainState | None = None,
) -> Callable[[TrainState, LearnerBatch], tuple[TrainState, dict[str, Array]]]:
    """A jitted ``(state, batch) → (state, metrics)`` doing one optimizer step.

    Metrics are token-weighted means over the mini-batch (the estimator's metrics,
    ``loss``) plus ``grad_norm``; the state is donated. With ``mesh`` (and a
    ``state_example`` to derive shardings from) parameters and optimizer state are
    FSDP-sharded and the batch is split over ``(data, fsdp)``.
    """

    def step(state: TrainState, batch: LearnerBatch):
        mask = batch.rollout.response_mask
        total = jnp.sum(mask).astype(jnp.float32)

        def micro(carry, mb: LearnerBatch):
            grads_acc, loss_acc, metrics_acc = carry

            def objective(params):
                loss, metrics = loss_fn(nnx.merge(graphdef, params), mb, total)
                return loss, metrics

            (loss, metrics), grads = jax.value_and_grad(objective, has_aux=True)(state.params)
            # Each metric is a token mean over this micro-batch: weight it by its tokens.
            weight = jnp.sum(mb.rollout.response_mask) / jnp.maximum(total, 1.0)
            metrics_acc = {
                k: jnp.maximum(metrics_acc[k], v) if k.endswith("_max") else metrics_acc[k] + v * weight
                for k, v in metrics.items()
            }
            return (jax.tree_util.tree_map(jnp.add, grads_acc, grads), loss_acc + loss, metrics_acc), None

        micro_batched = _split_micro_batches(batch, micro_batches)
        first = jax.tree_util.tree_map(lambda x: x[0], micro_batched)
        metric_shapes = jax.eval_shape(
            lambda: loss_fn(nnx.merge(graphdef, state.params), first, total)[1]
        )
        zeros = (
            jax.tree_util.tree_map(jnp.zeros_like, state.params),
            jnp.zeros((), jnp.float32),
            {k: jnp.full(v.shape, -jnp.inf if k.endswith("_max") else 0.0, v.dtype) for k, v in metric_shapes.items()},
        )
        (grads, loss, metrics), _ = jax.lax.scan(micro, zeros, micro_batched)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {**metrics, "loss": loss, "grad_norm": optax.tree.norm(grads), "tokens": total}
        return TrainState(params=params, opt_state=opt_state, step=state.step + 1), metrics

    if mesh is None:
        return jax.jit(step, donate_argnums=(0,))
    if state_example is None:
        raise ValueError("make_train_step with a mesh needs state_example to derive the shardings")
    shardings = state_shardings(state_example, mesh)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    jitted = jax.jit(step, donate_argnums=(0,), out_shardings=(shardings, replicated))

    def sharded_step(state: TrainState, batch: LearnerBatch):
        return jitted(state, jax.device_put(batch, batch_shardings(batch, mesh)))

    return sharded_step


def create_train_state(
    model: Decoder, optimizer: optax.GradientTransformation, mesh: jax.sharding.Mesh | None = None
) -> tuple[nnx.GraphDef, TrainState]:
    """Split ``model`` into graph and parameters, initialise the optimizer, place on ``mesh``."""
    graphdef, params = nnx.split(model)
    state = TrainState(params=params, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32))
    if mesh is not None:
        state = jax.device_put(state, state_shardings(state, mesh))
    return graphdef, state


def make_proximal_fn(graphdef: nnx.GraphDef, loss: PolicyLoss) -> Callable[[nnx.State, LearnerBatch], StudentLogProbs]:
    """No-grad log-probs of the current weights on a batch's cached ids: π_prox of
    decoupled PPO, computed once per rollout batch before its first optimizer step."""

    @jax.jit
    def proximal(params: nnx.State, batch: LearnerBatch) -> StudentLogProbs:
        return jax.lax.stop_gradient(loss.student(nnx.merge(graphdef, params), batch))

    return proximal
