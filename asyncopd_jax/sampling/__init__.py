"""Jitted KV-cache sampling with exact behaviour log-probs and Monte-Carlo candidates: a
static engine (a batch decoded in lockstep) and a continuous-batching engine over a paged KV
cache, one sampling core (:mod:`~asyncopd_jax.sampling.records`,
:mod:`~asyncopd_jax.sampling.decode`) and one stream protocol
(:class:`~asyncopd_jax.sampling.engine.RolloutStream`) that a rollout loop drives whichever
engine samples.

Layout::

    distribution.py  SamplingParams; the sampling distribution's log-probs
    records.py       Records: what a row records per answer token; the RolloutBatch it becomes
    decode.py        sample_token: one decode step's draw, records and stop test (both engines);
                     per-prompt keys
    engine.py        Engine (generate, lower; its cost, for asyncopd plan) and the RolloutStream
                     protocol; EngineStats
    static.py        Sampler: a batch in lockstep over a dense KV cache; StaticStream
    paged.py         PagedPrograms: the continuous engine's compiled programs over a paged cache,
                     which admit, page, preempt, park and decode on the device
    carry.py         what those programs carry between calls, take in and hand out
    schedule.py      its bookkeeping as pure functions: the queue, the free-page stack, the
                     table, the parked sequences of multi-turn rollouts
    stream.py        ContinuousStream: the continuous engine's host side (prompts in, answers out)
    episodes.py      multi-turn episodes on the host: Turns (the environments' pool, the
                     student's text), each row's episode, their figures
    continuous.py    ContinuousSampler: the paged programs driven by a ContinuousStream
"""

from flax import nnx
from jax.sharding import Mesh

from asyncopd_jax.sampling.continuous import ContinuousSampler
from asyncopd_jax.sampling.decode import prompt_keys
from asyncopd_jax.sampling.distribution import SamplingParams, sampling_logprobs
from asyncopd_jax.sampling.engine import Engine, EngineStats, RolloutStream, WeightSource, run_stream
from asyncopd_jax.sampling.records import Records, left_pad
from asyncopd_jax.sampling.static import DecodeState, Sampler


def make_sampler(graphdef: nnx.GraphDef, params: SamplingParams, pad_id: int = 0, mesh: Mesh | None = None) -> Engine:
    """The engine ``params.engine`` names: :class:`Sampler` (``"static"``) or
    :class:`ContinuousSampler` (``"continuous"``); both offer the same :class:`Engine`
    interface. The one place that reads ``params.engine``."""
    engine = ContinuousSampler if params.engine == "continuous" else Sampler
    return engine(graphdef, params, pad_id=pad_id, mesh=mesh)


__all__ = [
    "ContinuousSampler",
    "DecodeState",
    "Engine",
    "EngineStats",
    "Records",
    "RolloutStream",
    "Sampler",
    "SamplingParams",
    "WeightSource",
    "left_pad",
    "make_sampler",
    "prompt_keys",
    "run_stream",
    "sampling_logprobs",
]
