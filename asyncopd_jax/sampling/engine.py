"""What every sampling engine offers, whatever its cache: the :class:`RolloutStream` protocol
that one rollout loop drives, and the :class:`Engine` base (``generate``, ``lower``, the
mesh's layout) that the static and the continuous engine share.

A stream takes groups of prompts and hands each back as one
:class:`~asyncopd_jax.cache.RolloutBatch` once all its answers have ended; between its
steps the caller may :meth:`~RolloutStream.swap` in newer weights. ``generate`` is one
group through a fresh stream; a rollout stage keeps one stream open across groups::

    stream = engine.open_stream(state, version=v, prompt_slots=P, slots=engine.decode_rows(G))
    while running:
        while stream.wants_prompts and <the capacity rule allows a group>:
            stream.submit(tag, prompts, prompt_keys(group_key, len(prompts)))
        for tag, batch in stream.step():     # the groups whose last answer ended
            ...
        if <a newer snapshot>: stream.swap(version, state)
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from asyncopd_jax.cache import RolloutBatch
from asyncopd_jax.models.decoder import Decoder, cast_floating
from asyncopd_jax.models.partitioning import Logical, logical_spec, mesh_context
from asyncopd_jax.sampling.decode import prompt_keys
from asyncopd_jax.sampling.distribution import SamplingParams
from asyncopd_jax.sampling.episodes import EpisodeStats, Turns
from asyncopd_jax.sampling.records import left_pad

Array = jax.Array

# Called between decode chunks with the version in use; returns (version, state) of
# newer weights to swap in, or None to keep going.
WeightSource = Callable[[int], "tuple[int, nnx.State] | None"]

# An engine's programs to lower, by name: the jitted function, its abstract arguments and its
# static keyword arguments (Engine.abstract_calls).
Calls = dict[str, tuple[Any, tuple, dict[str, Any]]]

# Every shape an engine's programs may compile for, by program: each shape the tuple of the
# sizes it is compiled at (Engine.program_shapes says which sizes).
ProgramShapes = dict[str, tuple[tuple[int, ...], ...]]


@dataclasses.dataclass(frozen=True)
class BatchFigures:
    """What ``asyncopd plan`` knows of one sampler's share of a rollout batch, for its engine
    to price (:meth:`Engine.batch_seconds`; asyncopd_jax/scale/balance.py)."""

    prompts: int  # the batch's prompts, all samplers together
    samplers: int  # the rollout stages sharing them
    rows: int  # the rows of one prefill / decode call (:meth:`Engine.decode_rows`)
    prompt_slots: int
    mean_answer: float  # answer tokens expected
    prefill: float  # roofline seconds of one compiled prefill call
    decode: float  # roofline seconds of one compiled decode step, over the whole cache
    # roofline seconds of one step of ``rows`` busy rows attending over a context of that
    # many tokens each, from the bytes it reads (:meth:`Engine.decode_cache`)
    step: Callable[[float], float]


@dataclasses.dataclass
class EngineStats:
    """What a stream did (an engine's last ``generate``: ``last_stats``)."""

    slots: int = 0  # rows one decode call holds at most
    decode_steps: int = 0  # decode steps run
    row_steps: int = 0  # rows decoded, summed over steps (a step decodes the slots in flight, bucketed)
    tokens: int = 0  # response tokens sampled (kept answers only)
    prefill_tokens: int = 0
    refills: int = 0  # prompts that entered a slot an earlier answer had left
    chunks: int = 0
    preemptions: int = 0
    peak_pages: int = 0  # most pages in use at once
    pool_pages: int = 0
    # the chunks that started with prompts waiting (the steady state of a stream, before the
    # last answers drain): their decoded rows and the tokens they sampled
    waiting_row_steps: int = 0
    waiting_tokens: int = 0
    # multi-turn: turns parked for a tool, continuations that found their pages, parked
    # sequences whose pages were taken back; the episodes' figures
    parks: int = 0
    resumes: int = 0
    evictions: int = 0
    episodes: EpisodeStats = dataclasses.field(default_factory=EpisodeStats)

    @property
    def utilisation(self) -> float:
        """Answer tokens kept per row decoded, over the whole stream (the last answers'
        drain included): 1.0 when no decoded row is an idle slot."""
        return self.tokens / max(self.row_steps, 1)

    @property
    def steady_utilisation(self) -> float:
        """Tokens sampled per row decoded while prompts were waiting for a slot: what a
        stream that never runs dry (a rollout stage under the capacity rule) keeps busy."""
        return self.waiting_tokens / max(self.waiting_row_steps, 1)


class RolloutStream(Protocol):
    """Groups of prompts through an engine, one decode chunk per :meth:`step`
    (:meth:`Engine.open_stream`).

    Each :meth:`step` reads the chunk in flight, dispatches the next one and returns the
    groups whose last answer ended in the chunk it read: the device decodes while the caller
    handles them (a group comes back from the step after the chunk it ended in). What a
    group records does not depend on when it is handed back: only :meth:`swap` and
    :meth:`submit` act on decoding, each from the next chunk the stream dispatches.
    """

    #: the policy version sampled with, recorded per token (:meth:`swap` sets it)
    version: int
    #: rows one decode call holds at most
    slots: int
    #: what the stream did so far
    stats: EngineStats

    @property
    def queued(self) -> int:
        """Prompts submitted and waiting for a row."""
        ...

    @property
    def pending_groups(self) -> int:
        """Groups submitted and not yet handed back: queued, decoding, or ended in the chunk
        in flight."""
        ...

    @property
    def idle(self) -> bool:
        """Nothing queued, decoding or in flight: :meth:`step` would do nothing, and a loop
        that has no group to submit may block until it has one (nothing runs meanwhile),
        while a stream that is not idle must be stepped."""
        ...

    @property
    def wants_prompts(self) -> bool:
        """Whether a group submitted now would start decoding at the next chunk: the
        continuous engine while fewer prompts wait than it has slots, the static engine when
        no group is in progress. A rollout loop submits while this holds, so that the
        engine never runs short of prompts and no group waits in a queue longer than it
        must (its staleness counts from its start)."""
        ...

    def submit(
        self, tag: Any, prompts: Sequence[Sequence[int]], keys: Array, environments: Sequence[Any] | None = None
    ) -> None:
        """Queue a group: ``G`` token lists (at most ``prompt_slots`` long each) and their
        keys ``[G]`` (prompt i's answer token t is drawn with ``fold_in(keys[i], t)``), and
        (multi-turn) each prompt's environment; :meth:`step` hands it back, tagged ``tag``,
        once every answer has ended."""
        ...

    def step(self) -> list[tuple[Any, RolloutBatch]]:
        """Run the stream a chunk further; the groups ``(tag, batch)`` that ended."""
        ...

    def swap(self, version: int, state: nnx.State) -> None:
        """Sample with ``state`` (policy ``version``) from the next chunk on: the keys and
        values of every answer in progress are rewritten under it first."""
        ...


def run_stream(stream: RolloutStream, weight_source: WeightSource | None = None) -> list[tuple[Any, RolloutBatch]]:
    """Step ``stream`` until idle, polling ``weight_source`` between chunks for newer
    weights to swap in; every group handed back, in the order they ended."""
    done: list[tuple[Any, RolloutBatch]] = []
    while not stream.idle:
        done += stream.step()
        if weight_source is not None and not stream.idle:
            update = weight_source(stream.version)
            if update is not None and update[0] != stream.version:
                stream.swap(*update)
    return done


class Programs:
    """What an engine's compiled programs are built from: the model's graph, the sampling
    parameters, the pad id and the mesh; the model merged from weights and the mesh's layout.

    Args:
      graphdef: ``nnx.split(model)[0]``; the state comes with each call, so a new
        snapshot of the same architecture needs no recompilation.
      params: sampling parameters (static).
      pad_id: id written into padding positions.
      mesh: the ``(data, fsdp, tensor)`` mesh to sample on (a rollout stage's); the
        weights come placed by the caller (``parameter_shardings``). None: the default
        device.
    """

    def __init__(
        self, graphdef: nnx.GraphDef, params: SamplingParams, pad_id: int = 0, mesh: jax.sharding.Mesh | None = None
    ):
        self.graphdef = graphdef
        self.mesh = mesh
        self.params = params
        self.pad_id = pad_id

    def _model(self, state: nnx.State) -> Decoder:
        """The decoder of ``state``, in ``params.compute_dtype`` when set (cast inside the
        compiled functions: the caller's weights stay as they are)."""
        return nnx.merge(self.graphdef, cast_floating(state, self.params.compute_dtype))

    def cache_dtype(self, compute: jnp.dtype) -> jnp.dtype:
        """The KV cache's dtype: ``params.kv_dtype``, else ``compute`` (the model's)."""
        return jnp.dtype(self.params.kv_dtype) if self.params.kv_dtype else jnp.dtype(compute)

    def _sharding(self, axes: Logical, shape: Sequence[int]) -> NamedSharding | None:
        """Where an array of ``shape`` laid out as ``axes`` lies on the mesh (None: no mesh)."""
        return None if self.mesh is None else NamedSharding(self.mesh, logical_spec(axes, shape, self.mesh))

    def put(self, x: Any, axes: Logical | None = None) -> Array:
        """``x`` (host or device) onto the mesh, laid out as ``axes`` (default: whole on
        every device); on the default device without a mesh."""
        axes = (None,) * x.ndim if axes is None else axes
        return jax.device_put(x, self._sharding(axes, x.shape))

    def placed(self, tree: Any, axes_of: Callable[[Sequence[Any], Any], Logical]) -> Any:
        """``tree``'s leaves as ``ShapeDtypeStruct`` s placed on the mesh as ``axes_of(path,
        leaf)`` lays them out (abstract arguments to lower a program with)."""
        return jax.tree_util.tree_map_with_path(
            lambda path, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._sharding(axes_of(path, x), x.shape)),
            tree,
        )


class Engine(Programs, abc.ABC):
    """A sampler of responses from a :class:`Decoder` given as ``(graphdef, state)``: the
    static engine (:class:`~asyncopd_jax.sampling.Sampler`) or the continuous one
    (:class:`~asyncopd_jax.sampling.ContinuousSampler`); :func:`~asyncopd_jax.sampling.make_sampler`
    builds the one the configuration names (arguments: :class:`Programs`).
    """

    def __init__(
        self, graphdef: nnx.GraphDef, params: SamplingParams, pad_id: int = 0, mesh: jax.sharding.Mesh | None = None
    ):
        super().__init__(graphdef, params, pad_id, mesh)
        self.last_stats = EngineStats()

    # --- what each engine defines --------------------------------------------------------

    @abc.abstractmethod
    def open_stream(
        self,
        state: nnx.State,
        *,
        version: int,
        prompt_slots: int,
        slots: int | None = None,
        turns: Turns | None = None,
    ) -> RolloutStream:
        """A stream sampling with ``state`` (policy ``version``) for prompts of up to
        ``prompt_slots`` tokens, decoding up to ``slots`` rows at once (the continuous
        engine's slots, default ``params.slots``; the static engine decodes each group as
        one batch of its own size); multi-turn with ``turns`` (the continuous engine only)."""

    @abc.abstractmethod
    def decode_rows(self, rows: int) -> int:
        """Rows one decode call holds when groups have ``rows`` prompts."""

    @property
    @abc.abstractmethod
    def programs(self) -> dict[str, Any]:
        """The engine's jitted programs, by the names :meth:`program_shapes` uses."""

    @abc.abstractmethod
    def program_shapes(self, rows: int, prompt_slots: int) -> ProgramShapes:
        """Every shape each program may be compiled at, for groups of ``rows`` prompts of up
        to ``prompt_slots`` tokens (at one set of weights' layout): the bound on what a
        stream compiles, whatever its prompts, answers and swaps."""

    @abc.abstractmethod
    def abstract_calls(self, abstract_state: Any, rows: int, prompt_slots: int) -> Calls:
        """:meth:`lower`'s programs: by name, the jitted function, its abstract arguments and
        its static keyword arguments."""

    # --- what it costs (``asyncopd plan``'s balance: asyncopd_jax/scale/balance.py) ------

    @abc.abstractmethod
    def decode_cache(self, abstract_state: Any, rows: int, prompt_slots: int) -> tuple[Any, int] | None:
        """Where a decode step's cost follows the context its rows hold: the KV cache
        :meth:`abstract_calls` places for groups of ``rows`` prompts of up to
        ``prompt_slots`` tokens (shapes) and the tokens it holds, whose bytes per token
        :attr:`BatchFigures.step` reads. None where every step reads the whole cache, as
        the compiled step does."""

    @abc.abstractmethod
    def batch_seconds(self, batch: BatchFigures) -> tuple[float, float, float]:
        """One sampler's share of a rollout batch (answers of at most ``params.max_new_tokens``)
        as this engine runs it: ``(prefill seconds, decode seconds, the share of a compiled
        recompute a weight swap costs)``."""

    # --- shared --------------------------------------------------------------------------

    def generate(
        self,
        state: nnx.State,
        prompts: Sequence[Sequence[int]],
        key: Array | None,
        *,
        version: int = 0,
        weight_source: WeightSource | None = None,
        prompt_slots: int | None = None,
        keys: Array | None = None,
    ) -> RolloutBatch:
        """Sample one response per prompt: one group through a fresh stream.

        Args:
          state: model parameters (``nnx.split(model)[1]``) of policy ``version``, on
            :attr:`mesh` (laid out as the caller likes: ``parameter_shardings``).
          prompts: token id lists (any lengths).
          key: PRNG key: prompt ``i`` samples with ``fold_in(key, i)``
            (:func:`~asyncopd_jax.sampling.prompt_keys`); same key, weights and prompts →
            same responses, from either engine.
          version: policy version of ``state``, recorded on every token it samples.
          weight_source: polled between chunks of ``params.chunk_steps`` decode steps;
            when it returns ``(new_version, new_state)`` the keys and values of the answers
            in progress are recomputed under the new weights and decoding continues with them.
          prompt_slots: pad prompts to this many slots (fixed shapes → no recompiles).
          keys: ``[len(prompts)]`` the prompts' keys, instead of ones derived from ``key``.

        Returns:
          A :class:`RolloutBatch` in the prompts' order (``[B, T]`` with T =
          ``max_new_tokens``, prompts left-padded to ``prompt_slots``; candidates and top-K
          ids when configured). :attr:`last_stats` says what it took.
        """
        ids, _ = left_pad(prompts, self.pad_id, prompt_slots)  # checks the prompts; the batch's width
        if keys is None:
            if key is None:
                raise ValueError("generate needs a key or the prompts' keys")
            keys = prompt_keys(key, len(prompts))
        stream = self.open_stream(
            state, version=version, prompt_slots=ids.shape[1], slots=self.decode_rows(len(prompts))
        )
        stream.submit(None, prompts, keys)
        ((_, batch),) = run_stream(stream, weight_source)
        self.last_stats = stream.stats
        return batch

    @property
    def compiled(self) -> dict[str, int]:
        """Shapes each program has been compiled at so far, by name (the jit caches)."""
        return {name: fn._cache_size() for name, fn in self.programs.items()}

    @property
    def last_steps(self) -> int:
        """Decode steps the last :meth:`generate` ran (an early exit included)."""
        return self.last_stats.decode_steps

    def lower(self, abstract_state: Any, rows: int, prompt_slots: int) -> dict[str, jax.stages.Lowered]:
        """The engine's programs lowered (not compiled) for groups of ``rows`` prompts of up
        to ``prompt_slots`` tokens (:meth:`decode_rows` rows per decode), at weights
        ``abstract_state`` (``ShapeDtypeStruct`` s placed on :attr:`mesh` as a rollout
        stage receives them); nothing is allocated. For ``asyncopd plan``: compile them for
        a topology and read their memory.

        Returns:
          ``"prefill"`` (the prompts into the cache), ``"decode"`` (one chunk of decode
          steps) and ``"recompute"`` (the cache's rewrite after a weight swap: one program
          whatever the answers' lengths, whose buffers are those of its worst case).
        """
        with mesh_context(self.mesh):
            calls = self.abstract_calls(abstract_state, rows, prompt_slots)
            return {name: fn.lower(*args, **static) for name, (fn, args, static) in calls.items()}
