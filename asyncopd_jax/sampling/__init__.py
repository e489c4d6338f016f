"""Jitted KV-cache sampling with exact behaviour log-probs and Monte-Carlo candidates: a
static-batch sampler and a continuous-batching engine over a paged KV cache."""

from flax import nnx
from jax.sharding import Mesh

from asyncopd_jax.sampling.continuous import ContinuousSampler, EngineStats, prompt_keys
from asyncopd_jax.sampling.distribution import SamplingParams, sampling_logprobs
from asyncopd_jax.sampling.sampler import DecodeState, Sampler, WeightSource, left_pad


def make_sampler(
    graphdef: nnx.GraphDef, params: SamplingParams, pad_id: int = 0, mesh: Mesh | None = None
) -> Sampler | ContinuousSampler:
    """The engine ``params.engine`` names: :class:`Sampler` (``"static"``) or
    :class:`ContinuousSampler` (``"continuous"``); both offer the same ``generate``."""
    engine = ContinuousSampler if params.engine == "continuous" else Sampler
    return engine(graphdef, params, pad_id=pad_id, mesh=mesh)


__all__ = [
    "ContinuousSampler",
    "DecodeState",
    "EngineStats",
    "Sampler",
    "SamplingParams",
    "WeightSource",
    "left_pad",
    "make_sampler",
    "prompt_keys",
    "sampling_logprobs",
]
