"""The mixture-of-experts MLP of Qwen3-MoE: a router sends each token to ``k`` of ``E``
SwiGLU experts and sums their outputs, weighted by the router's probabilities.

Per token ``x [H]``::

    p       = softmax(x · W_router)                  [E]   (fp32, as transformers does)
    top, ids = the k largest of p (ties: the lower expert id first)
    w       = top / Σ top   if norm_topk_prob, else top
    y       = Σ_j w_j · down_ids[j](silu(gate_ids[j](x)) · up_ids[j](x))

The experts run as grouped matmuls (:func:`jax.lax.ragged_dot`): the ``T·k`` (token,
expert) assignments are sorted by expert, each expert multiplies its contiguous run of
rows, and the rows go back to their tokens. That is ``T·k·3·H·I`` multiply-adds, the
active experts' FLOPs (``k/E`` of running every expert on every token, the dense
formulation: 8/128 for Qwen3-30B-A3B), and ``[T·k, I]`` of activations. TPU and GPU compile
it to a grouped matmul; XLA:CPU has none and JAX lowers it there to a dense matmul over
every expert with the other experts' rows masked to zero (``E×`` the FLOPs): the CPU is for
the small models of the built-in task, which the plan's TPU figures do not come from.

Shapes: T tokens (the batch's rows and positions, flattened), H hidden, E experts, k
experts per token, I an expert's width (``moe_intermediate_size``). Parameter names follow
Hugging Face's checkpoints: ``mlp.gate`` is the router; the experts' weights are stacked
over E (``experts.gate_proj [E, H, I]``), where a checkpoint stores one tensor per expert
(``mlp.experts.{e}.gate_proj.weight [I, H]``; :mod:`asyncopd_jax.models.hf_checkpoint`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from asyncopd_jax.models.config import DecoderConfig
from asyncopd_jax.models.partitioning import PARAMETER_AXES, logical_spec, mesh_axes, target_platform

Array = jax.Array


def route(logits: Array, k: int, normalise: bool) -> tuple[Array, Array]:
    """The router's choice for each token.

    Args:
      logits: ``[T, E]`` router logits.
      k: experts per token.
      normalise: divide the chosen probabilities by their sum (``norm_topk_prob``).

    Returns:
      ``(weights [T, k] fp32, experts [T, k] int32)``, the most probable expert first; of
      equal probabilities the lower expert id (:func:`jax.lax.top_k`'s order, and
      ``torch.topk``'s on the CPU).
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if normalise:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


class Experts(nnx.Module):
    """``E`` SwiGLU MLPs, their weights stacked on a leading expert axis."""

    def __init__(self, config: DecoderConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        init = nnx.initializers.normal(0.02)
        self.gate_proj = nnx.Param(init(rngs.params(), (e, h, i), dtype))  # [E, H, I]
        self.up_proj = nnx.Param(init(rngs.params(), (e, h, i), dtype))  # [E, H, I]
        self.down_proj = nnx.Param(init(rngs.params(), (e, i, h), dtype))  # [E, I, H]

    def __call__(self, x: Array, weights: Array, experts: Array) -> Array:
        """``x [T, H]``, each token's ``experts [T, k]`` and ``weights [T, k]`` → ``[T, H]``;
        expert-parallel (:func:`expert_parallel`) where the stage's mesh splits the experts."""
        weights_ = (self.gate_proj[...], self.up_proj[...], self.down_proj[...])
        parallel = expert_parallel(x, weights, experts, *weights_)
        return parallel if parallel is not None else _grouped(x, weights, experts, *weights_)


def _grouped(x: Array, weights: Array, experts: Array, gate: Array, up: Array, down: Array) -> Array:
    """Every assignment on this device: ``x [T, H]`` through the experts ``gate, up [E, H, I]``,
    ``down [E, I, H]`` its ``experts [T, k]`` name, weighted by ``weights [T, k]`` → ``[T, H]``."""
    t, k = experts.shape
    flat = experts.reshape(-1)  # [T·k]: assignment a is token a // k's j = a % k-th choice
    order = jnp.argsort(flat, stable=True)  # the assignments grouped by expert
    sizes = jnp.bincount(flat, length=gate.shape[0]).astype(jnp.int32)  # [E] rows per expert
    out = _swiglu(jnp.take(x, order // k, axis=0), sizes, gate, up, down)  # [T·k, H]
    # back to (token, choice) order, then each token's k outputs weighted and summed (the
    # weights in the compute dtype, as transformers multiplies them)
    return _combine(jnp.zeros_like(out).at[order].set(out), weights)


def _swiglu(rows: Array, sizes: Array, gate: Array, up: Array, down: Array) -> Array:
    """``rows [M, H]`` grouped by expert (``sizes [E]`` rows each, rows past them unread)
    through their experts' SwiGLU MLPs → ``[M, H]``."""
    hidden = jax.nn.silu(jax.lax.ragged_dot(rows, gate, sizes)) * jax.lax.ragged_dot(rows, up, sizes)
    return jax.lax.ragged_dot(hidden, down, sizes)


def _combine(outputs: Array, weights: Array) -> Array:
    """``outputs [T·k, H]`` in (token, choice) order weighted by ``weights [T, k]`` and summed
    per token → ``[T, H]``."""
    t, k = weights.shape
    return jnp.sum(outputs.reshape(t, k, -1) * weights.astype(outputs.dtype)[..., None], axis=1)


def _axes(spec: PartitionSpec, dim: int) -> tuple[str, ...]:
    """The mesh axes ``spec`` splits dimension ``dim`` over (() for none)."""
    entry = spec[dim] if len(spec) > dim else None
    return () if entry is None else (entry if isinstance(entry, tuple) else (entry,))


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """How a mesh splits a mixture of experts' experts and its tokens (:func:`expert_layout`)."""

    experts: tuple[str, ...]  # the axes splitting E: the tokens are exchanged over them
    batch: tuple[str, ...]  # the axes splitting the tokens (the experts' among them)
    width: tuple[str, ...]  # the axes splitting an expert's MLP width: partial sums to add up
    devices: int  # D: devices the experts are spread over
    shards: int  # devices the tokens are spread over


def expert_layout(shape: tuple[int, ...], mesh: Mesh | AbstractMesh) -> ExpertLayout | None:
    """The layout the partition rules give experts ``[E, H, I]`` of ``shape`` on ``mesh``;
    None where no axis splits E (one device, or no fsdp axis dividing E)."""
    spec = logical_spec(PARAMETER_AXES[("experts", "gate_proj")], shape, mesh)
    experts, batch = _axes(spec, 0), mesh_axes("batch", mesh)
    if not experts:
        return None
    # the layout the exchange is written for (partitioning.RULES): tokens split over the
    # expert axes too, each expert's H whole
    assert set(experts) <= set(batch) and not _axes(spec, 1), (experts, batch, spec)
    sizes = dict(mesh.shape)
    return ExpertLayout(
        experts=experts,
        batch=batch,
        width=_axes(spec, 2),
        devices=math.prod(sizes[a] for a in experts),
        shards=math.prod(sizes[a] for a in batch),
    )


class ExchangeBytes(NamedTuple):
    """Bytes one device sends over its links in a forward (:func:`exchange_bytes`)."""

    uniform: float  # each token's experts spread evenly over the devices
    worst: float  # one device holds every token's experts: it receives and returns all rows


def exchange_bytes(config: DecoderConfig, tokens: int, devices: int, itemsize: int, routed: bool) -> ExchangeBytes:
    """What one device sends over its links in a forward of its ``tokens`` tokens on an
    expert-parallel mesh of ``devices`` (:func:`expert_parallel`), counted from one sparse
    layer's two trips (there and back) of its ``tokens·k`` rows of ``H``.

    ``routed`` (:func:`routed_exchange`): only the rows routed to another device travel:
    ``(D − 1) / D`` of them at uniform routing; where one device holds every token's experts
    it receives the rows of the ``D − 1`` others and sends them back. Padded: each trip
    sends ``D − 1`` whole chunks of ``c·k`` rows, padding included, whatever the routing: the
    routed worst case at every batch."""
    if devices <= 1:
        return ExchangeBytes(0.0, 0.0)
    sparse = sum(config.is_sparse(i) for i in range(config.num_hidden_layers))
    rows = sparse * 2 * tokens * config.num_experts_per_tok * config.hidden_size * itemsize
    worst = float(rows * (devices - 1))
    return ExchangeBytes(rows * (devices - 1) / devices if routed else worst, worst)


# Platforms whose compilers take jax.lax.ragged_all_to_all (XLA:TPU, XLA:GPU): there the
# exchange sends only the routed rows. XLA:CPU refuses the op ("HLO opcode
# `ragged-all-to-all` is not supported by XLA:CPU ThunkEmitter", JAX 0.10.2), so the CPU
# (the tests, the built-in task, the CPU proxy of a GPU plan) sends padded chunks.
ROUTED_EXCHANGE_PLATFORMS = frozenset({"tpu", "gpu", "cuda", "rocm"})


def routed_exchange(platform: str) -> bool:
    """Whether the experts' exchange on ``platform`` sends only routed rows (a ragged
    all-to-all) rather than padded chunks: the one place this is decided."""
    return platform in ROUTED_EXCHANGE_PLATFORMS


class Slices(NamedTuple):
    """The arguments of one :func:`jax.lax.ragged_all_to_all` on one device, ``[D]`` each:
    slice ``i`` (``operand[input_offsets[i]:][:send_sizes[i]]``) goes to device ``i``, where it
    is written at ``output_offsets[i]``; ``recv_sizes[i]`` rows arrive from device ``i``."""

    input_offsets: Array
    send_sizes: Array
    output_offsets: Array
    recv_sizes: Array


def exchange_slices(
    to_peers: Array, from_peers: Array, at_peers: Array, me: Array, capacity: int
) -> tuple[Slices, Slices]:
    """The two trips of one exchange of a device's rows sorted by expert (so by the device
    holding it: device ``d``'s rows contiguous, in order of ``d``).

    Args:
      to_peers: ``[D]`` rows this device sends to device ``d``.
      from_peers: ``[D]`` rows device ``s`` sends to this one.
      at_peers: ``[D]`` where device ``s``'s rows for this one begin among its sorted rows.
      me: this device's index over the expert axes.
      capacity: ``a``, the rows of one chunk: at most this many go to any one device.

    Returns:
      ``(there, back)``. There: this device's ``[a]`` sorted rows to their devices, each
      receiver keeping sender ``s``'s rows at ``s·a`` of its ``[D·a]`` (the layout of a padded
      exchange, so the rows past a sender's count are the output's zeros). Back: each
      receiver's rows from ``s`` return to ``s``, to the places they left from.
    """
    starts = jnp.cumsum(to_peers) - to_peers
    chunks = jnp.arange(to_peers.shape[0], dtype=to_peers.dtype) * capacity
    there = Slices(starts, to_peers, jnp.full_like(to_peers, me * capacity), from_peers)
    back = Slices(chunks, from_peers, at_peers, to_peers)
    return there, back


def padded_all_to_all(operand: Array, output: Array, slices: Slices, axes: tuple[str, ...], capacity: int) -> Array:
    """:func:`jax.lax.ragged_all_to_all`'s result from a dense :func:`jax.lax.all_to_all` of
    ``[D, capacity, ...]``, each slice padded to ``capacity`` rows: the same rows arrive, and
    ``D − 1`` whole chunks cross the links. For compilers without the ragged op (XLA:CPU).

    ``operand [N, ...]`` and ``output [M, ...]`` as the ragged op takes them; every slice
    at most ``capacity`` rows."""
    offsets, _, written, received = slices  # a slice's size: the receiver's recv_sizes
    row = jnp.arange(capacity)
    # [D, capacity]: each slice's rows, then whatever follows them (padding the receiver never writes)
    taken = (offsets[:, None] + row) % operand.shape[0]
    arrived = jax.lax.all_to_all(operand[taken], axes, 0, 0)  # [D, capacity, ...]: device s's slice for me
    at = jax.lax.all_to_all(written, axes, 0, 0, tiled=True)  # [D]: where device s writes it here
    target = jnp.where(row < received[:, None], at[:, None] + row, output.shape[0])  # past the end: dropped
    return output.at[target].set(arrived.astype(output.dtype), mode="drop")


# Tokens a device sends to the experts in one exchange (the rest wait for the next): its
# buffers are ``D·k·512·H`` each, 134 MB at Qwen3-30B-A3B's widths on 8 devices in bf16,
# where a whole 4,096-token row at once would take 1 GiB each.
EXPERT_CHUNK_TOKENS = 512


def expert_parallel(x: Array, weights: Array, experts: Array, gate: Array, up: Array, down: Array) -> Array | None:
    """The experts run where their weights lie, on a mesh whose rules split the expert axis
    (``RULES["expert"]``, the fsdp axis: ``D`` devices holding ``E / D`` experts each); None
    where the stage's mesh does not split them (one device, or ``D`` not dividing ``E``).

    Under :func:`jax.shard_map`, each device holds its share of the tokens (the batch is
    split over fsdp too) and, per token, the ``k`` choices of the router:

    1. its ``a = c·k`` assignments of a chunk of ``c`` tokens (:data:`EXPERT_CHUNK_TOKENS`,
       the chunks one after another), sorted by expert, go to the devices that hold their
       experts (:func:`exchange_slices`), after one small ``all_to_all`` of each device's
       rows per expert: on TPU and GPU a ``ragged_all_to_all`` sends only the routed rows;
       elsewhere every device sends every other a chunk of ``a`` rows, padding included
       (:func:`padded_all_to_all`; :func:`routed_exchange` decides);
    2. each device runs its ``E / D`` experts on the ``D·a`` rows it holds (sender ``s``'s at
       ``s·a``), grouped by expert (the grouped matmul of :func:`_swiglu`), a tensor axis
       splitting each expert's MLP width as in a dense MLP;
    3. the outputs go back to the rows they came from (the same trip reversed), where they
       are weighted and summed per token (and summed over the tensor axis).

    No token is dropped, whatever the routing: a receiver has room for all ``a`` rows of
    every sender, the case of every assignment sent to one expert device. The price is
    ``D·a·H`` of buffers per device and a grouped matmul compiled for ``D·a`` rows (GShard's
    capacity factor would bound both and drop the overflow, changing a teacher's scores).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    layout = expert_layout(gate.shape, mesh)
    if layout is None:
        return None
    e, ep, devices, partial = gate.shape[0], layout.experts, layout.devices, layout.width
    t = x.shape[0]
    own = -(-t // layout.shards)  # tokens per device, in exchanges of ``chunk`` at most 512
    exchanges = -(-own // EXPERT_CHUNK_TOKENS)
    chunk = -(-own // exchanges)
    padded = layout.shards * exchanges * chunk  # padding tokens (zeros) are cut off after
    pad = ((0, padded - t), (0, 0))
    rows = PartitionSpec(layout.batch)
    stacked = {"gate_proj": gate, "up_proj": up, "down_proj": down}  # each where the rules put it
    specs = tuple(logical_spec(PARAMETER_AXES["experts", name], w.shape, mesh) for name, w in stacked.items())
    routed, capacity = routed_exchange(target_platform()), chunk * experts.shape[1]  # a: an exchange's rows

    def trip(operand: Array, output: Array, slices: Slices) -> Array:
        """One trip of the exchange: only the routed rows, or padded chunks of ``a``."""
        if routed:
            return jax.lax.ragged_all_to_all(operand, output, *slices, axis_name=ep)
        return padded_all_to_all(operand, output, slices, ep, capacity)

    def exchange(x: Array, weights: Array, experts: Array, gate: Array, up: Array, down: Array) -> Array:
        """One chunk of this device's tokens through the experts, wherever they are."""
        t, k = experts.shape
        a, h, mine = t * k, x.shape[-1], gate.shape[0]  # mine: experts on this device
        flat = experts.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        counts = jnp.bincount(flat, length=e).astype(jnp.int32).reshape(devices, mine)  # [D, E/D]
        to_peers = jnp.sum(counts, axis=1)
        # each device's rows per expert of mine, and where its rows for me begin
        table = jnp.concatenate([counts, (jnp.cumsum(to_peers) - to_peers)[:, None]], axis=1)
        table = jax.lax.all_to_all(table, ep, 0, 0)  # [D, E/D + 1]
        arrived, at_peers = table[:, :-1], table[:, -1]
        there, back = exchange_slices(to_peers, jnp.sum(arrived, axis=1), at_peers, jax.lax.axis_index(ep), a)
        received = trip(jnp.take(x, order // k, axis=0), jnp.zeros((devices * a, h), x.dtype), there)
        # each received row's expert (rows past a sender's count: E/D, grouped last and unread)
        ends = jnp.cumsum(arrived, axis=1)  # [D, E/D]
        expert_of = jax.vmap(lambda end: jnp.searchsorted(end, jnp.arange(a), side="right"))(ends)
        grouped = jnp.argsort(expert_of.reshape(-1), stable=True)
        out = _swiglu(received[grouped], jnp.sum(arrived, axis=0), gate, up, down)
        out = jnp.zeros_like(out).at[grouped].set(out)  # [D·a, H]: sender s's rows at s·a
        returned = trip(out, jnp.zeros((a, h), out.dtype), back)  # [a, H]: my rows, sorted
        return _combine(jnp.zeros_like(returned).at[order].set(returned), weights)

    def local(x: Array, weights: Array, experts: Array, gate: Array, up: Array, down: Array) -> Array:
        """This device's tokens, ``chunk`` at a time (their buffers bounded), summed over tensor."""
        chunked = [v.reshape(-1, chunk, *v.shape[1:]) for v in (x, weights, experts)]
        y = jax.lax.map(lambda c: exchange(c[0], c[1], c[2], gate, up, down), tuple(chunked)).reshape(x.shape)
        return jax.lax.psum(y, partial) if partial else y

    y = jax.shard_map(
        local,
        in_specs=(rows, rows, rows, *specs),
        out_specs=rows,
    )(jnp.pad(x, pad), jnp.pad(weights, pad), jnp.pad(experts, pad), *stacked.values())
    return y[:t]


class SparseMoE(nnx.Module):
    """The MLP of a sparse layer: ``mlp.gate`` (the router, no bias) and ``mlp.experts``."""

    def __init__(self, config: DecoderConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.gate = nnx.Linear(
            config.hidden_size,
            config.num_experts,
            use_bias=False,
            dtype=None,
            param_dtype=dtype,
            kernel_init=nnx.initializers.normal(0.02),
            rngs=rngs,
        )
        self.experts = Experts(config, dtype, rngs)
        self.k, self.normalise = config.num_experts_per_tok, config.norm_topk_prob

    def router_logits(self, x: Array) -> Array:
        """``x [..., H]`` → ``[..., E]`` in the compute dtype (transformers' ``F.linear``)."""
        return self.gate(x)

    def __call__(self, x: Array) -> Array:
        """``x [..., H]`` → ``[..., H]``."""
        flat = x.reshape(-1, x.shape[-1])
        weights, experts = route(self.router_logits(flat), self.k, self.normalise)
        return self.experts(flat, weights, experts).reshape(x.shape)
