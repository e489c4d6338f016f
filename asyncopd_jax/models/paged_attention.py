"""Attention over a paged KV cache: each sequence's keys and values live in fixed-size pages
of one shared pool, found through its row of a page table.

Layout, per layer, by implementation::

    "ragged"     pages [num_pages, page_size, 2·N_kv, D]   keys at even "heads", values at odd
                                                           ones (what the TPU kernel reads)
    "reference"  pages [2, num_pages, N_kv, page_size, D]  keys, then values, heads-major in a
                                                           page: a gather of either copies whole
                                                           [page_size, D] blocks into the
                                                           [S, N_kv, L, D] the scores' matmul
                                                           reads (on CPU the interleaved pool
                                                           costs 1.8x per decode step)
    page_table [S, M]      sequence s's token j lives in page page_table[s, j // page_size],
                           row j % page_size

A call runs ``Q`` query rows per sequence (``Q = 1``: a decode step; ``Q > 1``: a chunk of a
prompt, or of a whole sequence rewritten after a weight swap). Sequence ``s`` has ``start[s]``
tokens in the cache already and writes ``count[s] ≤ Q`` new ones at token positions
``start[s] .. start[s] + count[s] − 1``; query ``i`` attends the tokens ``≤ start[s] + i``.
Query rows ``i ≥ count[s]`` are padding: their keys and values are not written (the write
goes to a page index past the pool, which a ``mode="drop"`` scatter drops) and their output
is garbage that no caller reads.

Two implementations, tested equal:

* ``"reference"``: plain JAX for any backend. It gathers each sequence's pages in blocks,
  only those its own length covers, into ``[N_kv, L, D]`` views and merges the blocks'
  softmaxes per sequence: the cost of a dense cache as long as each sequence (what the CPU
  demo and tests run).
* ``"ragged"``: the Pallas TPU kernel, which reads only the pages a sequence's length covers;
  TPU only (Pallas's interpret modes fail inside this kernel on JAX 0.10.2), so the tests
  hold the reference to the kernel's own pure-JAX reference and compile the kernel for TPU
  chips with XLA's TPU compiler.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax import Array
from jax.sharding import PartitionSpec

from asyncopd_jax.models.partitioning import target_platform

PagedImplementation = Literal["reference", "ragged"]
PAGED_IMPLEMENTATIONS: tuple[PagedImplementation, ...] = ("reference", "ragged")


def pool_shape(
    implementation: PagedImplementation, num_pages: int, page_size: int, kv_heads: int, head_dim: int
) -> tuple[int, ...]:
    """One layer's pool in the layout ``implementation`` reads (module docstring)."""
    if implementation == "ragged":
        return (num_pages, page_size, 2 * kv_heads, head_dim)
    return (2, num_pages, kv_heads, page_size, head_dim)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """Per layer, the pool's pages in the layout of an implementation (:func:`pool_shape`)."""

    pages: tuple[Array, ...]

    @classmethod
    def empty(
        cls,
        implementation: PagedImplementation,
        layers: int,
        kv_heads: int,
        head_dim: int,
        num_pages: int,
        page_size: int,
        dtype: jnp.dtype,
    ) -> PagedKVCache:
        shape = pool_shape(implementation, num_pages, page_size, kv_heads, head_dim)
        return cls(tuple(jnp.zeros(shape, dtype) for _ in range(layers)))

    @property
    def bytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in self.pages)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedWrite:
    """Where one call's tokens go: per sequence its pages, the tokens already written
    before the call and the tokens the call writes.

    Attributes:
      page_table: ``[S, M]`` int32 page ids; entries past a sequence's length may name any
        page (they are read only under the causal mask, never written).
      start: ``[S]`` int32 tokens in the cache before this call (the first query's position).
      count: ``[S]`` int32 tokens this call writes, ``0 ≤ count ≤ Q`` (0: the sequence idles).
    """

    page_table: Array
    start: Array
    count: Array


def interleave(k: Array, v: Array) -> Array:
    """``k, v [..., N_kv, D]`` → ``[..., 2·N_kv, D]`` with keys at even and values at odd heads."""
    return jnp.stack([k, v], axis=-2).reshape(*k.shape[:-2], 2 * k.shape[-2], k.shape[-1])


def write_pages(pages: Array, k: Array, v: Array, where: PagedWrite) -> Array:
    """``pages`` (either layout) with the new keys and values ``k, v [S, Q, N_kv, D]`` written
    at token positions ``start .. start + count − 1`` of each sequence (padding rows dropped)."""
    q = k.shape[1]
    split = pages.ndim == 5
    num_pages, page_size = (pages.shape[1], pages.shape[3]) if split else pages.shape[:2]
    position = where.start[:, None] + jnp.arange(q)[None]  # [S, Q]
    column = jnp.minimum(position // page_size, where.page_table.shape[1] - 1)
    page = jnp.take_along_axis(where.page_table, column, axis=1)
    page = jnp.where(jnp.arange(q)[None] < where.count[:, None], page, num_pages)  # past the pool: dropped
    row = position % page_size
    if split:
        pages = pages.at[0, page, :, row].set(k.astype(pages.dtype), mode="drop")
        return pages.at[1, page, :, row].set(v.astype(pages.dtype), mode="drop")
    return pages.at[page, row].set(interleave(k, v).astype(pages.dtype), mode="drop")


def paged_attention(
    q: Array,
    k: Array,
    v: Array,
    pages: Array,
    where: PagedWrite,
    *,
    implementation: PagedImplementation = "reference",
) -> tuple[Array, Array]:
    """Write ``k, v`` into ``pages``, then causal grouped-query attention of ``q`` over each
    sequence's tokens.

    Args:
      q: queries ``[S, Q, N_q, D]`` (rotated), ``N_q`` a multiple of ``N_kv``.
      k, v: the new tokens' keys and values ``[S, Q, N_kv, D]`` (rows ``≥ count`` ignored).
      pages: one layer's pool, in ``implementation``'s layout (:func:`pool_shape`).
      where: the sequences' page tables, ``start`` and ``count`` (:class:`PagedWrite`).
      implementation: ``"reference"`` or ``"ragged"`` (module docstring).

    Returns:
      ``(out [S, Q, N_q, D] in v's dtype, updated pages)``; scores ``q·k / √D`` and the softmax
      are fp32, probabilities cast to the cache's dtype for the weighted sum.
    """
    pages = write_pages(pages, k, v, where)
    if implementation == "reference":
        return _reference(q, pages, where).astype(v.dtype), pages
    if implementation == "ragged":
        return _ragged(q, pages, where).astype(v.dtype), pages
    raise ValueError(
        f"paged attention implementation {implementation!r}: expected one of {list(PAGED_IMPLEMENTATIONS)}"
    )


# Tokens of a block the reference reads at once: its work follows each sequence's length to
# within a block, in one program whatever the lengths.
REFERENCE_BLOCK_TOKENS = 64

# On a CPU, the keys and values one iteration of the reference's loop gathers: a few items
# at a time, so that what the gather writes is still in cache when the two matmuls read it.
# At Qwen3-0.6B's widths (8 key/value heads of 128, fp32: 512 KiB an item) and 64 slots at a
# mean context of 200, a decode step's attention takes 8 ms a layer at 2 MiB against 32 ms
# with every slot's item in one iteration (16 MiB) (docs/results.md). Other backends take
# ``S`` items an iteration: they want the width, and their caches are not the CPU's.
REFERENCE_CPU_ITERATION_BYTES = 2 << 20


def items_per_iteration(slots: int, item_bytes: int) -> int:
    """How many (sequence, block) items one iteration of the reference's loop works on."""
    if target_platform() != "cpu":
        return slots
    return max(1, min(slots, REFERENCE_CPU_ITERATION_BYTES // item_bytes))


def _reference(q: Array, pages: Array, where: PagedWrite) -> Array:
    """Each sequence's pages read in blocks of :data:`REFERENCE_BLOCK_TOKENS` tokens, only
    the blocks its own length covers (split-K, as FlashDecoding): the ``W`` (sequence, block)
    items of the call are worked through ``n`` at a time (:func:`items_per_iteration`) in a
    loop of dynamic trip count, each giving its block's softmax max, sum and weighted
    values, and then merged per sequence. An item gathers its pages into ``[N_kv, L, D]``
    keys and values (heads-major: the scores and the weighted sum are one batched matmul per
    item and head, which XLA:CPU runs 1.5-2x faster than the same contraction over the
    gathered ``[B, N_kv, page, D]`` pages) and masks: key ``j`` is visible to query ``i`` iff
    ``j ≤ start + i``."""
    s, nq_len, n_q, d = q.shape
    n_kv, page_size = pages.shape[2], pages.shape[3]
    group, columns = n_q // n_kv, where.page_table.shape[1]
    per_block = max(1, min(REFERENCE_BLOCK_TOKENS // page_size, columns))  # pages a block reads
    blocks = -(-columns // per_block)
    # the last block's columns past the table repeat its last page: read under the mask only
    table = jnp.pad(where.page_table, ((0, 0), (0, blocks * per_block - columns)), mode="edge")
    length, rows = per_block * page_size, nq_len * group
    # a key/value head's queries: its group of query heads at each of the Q positions
    grouped = q.reshape(s, nq_len, n_kv, group, d).transpose(0, 2, 1, 3, 4).reshape(s, n_kv, rows, d)
    query = where.start[:, None] + jnp.repeat(jnp.arange(nq_len), group)[None]  # [S, Q·g] each row's position
    floor = jnp.finfo(jnp.float32).min
    # the items: sequence r's blocks 0 .. covers[r] − 1, sequence by sequence
    covers = jnp.clip((where.start + nq_len + length - 1) // length, 1, blocks)  # [S]
    ends = jnp.cumsum(covers)
    n = items_per_iteration(s, 2 * n_kv * length * d * pages.dtype.itemsize)
    capacity = -(-s * blocks // n) * n  # items at most, in whole iterations
    item = jnp.arange(capacity)
    owner = jnp.searchsorted(ends, item, side="right").astype(jnp.int32)  # [capacity], S past the last item
    block_of = item - (ends - covers)[jnp.minimum(owner, s - 1)]

    def gathered(which: Array, ids: Array) -> Array:
        blocks_of = which[ids]  # [n, B, N_kv, page, D]
        # read in the compute dtype (the query's): a narrower pool rounds what is stored only
        return blocks_of.transpose(0, 2, 1, 3, 4).reshape(n, n_kv, length, d).astype(q.dtype)

    def body(step: Array, parts: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
        tops, totals, sums = parts  # per item: [capacity, N_kv, Q·g] max and sum, [.., D] weighted sum
        at = step * n
        mine = jax.lax.dynamic_slice_in_dim(jnp.minimum(owner, s - 1), at, n)  # [n] the items' sequences
        block = jax.lax.dynamic_slice_in_dim(block_of, at, n)
        ids = jnp.take_along_axis(table[mine], block[:, None] * per_block + jnp.arange(per_block)[None], axis=1)
        ids = jnp.minimum(ids, pages.shape[1] - 1)
        keys, values = gathered(pages[0], ids), gathered(pages[1], ids)
        scores = jnp.einsum("skqd,skld->skql", grouped[mine], keys, preferred_element_type=jnp.float32)
        scores = scores / jnp.sqrt(jnp.float32(d))
        visible = (block[:, None, None] * length + jnp.arange(length)[None, None]) <= query[mine][..., None]
        visible = visible[:, None]  # [n, 1, Q·g, L]
        top = jnp.where(visible, scores, floor).max(-1)
        probs = jnp.where(visible, jnp.exp(scores - top[..., None]), 0.0)  # a query that sees none: 0
        weighted = jnp.einsum("skql,skld->skqd", probs.astype(values.dtype), values, preferred_element_type=jnp.float32)
        put = functools.partial(jax.lax.dynamic_update_slice_in_dim, start_index=at, axis=0)
        return put(tops, top), put(totals, probs.sum(-1)), put(sums, weighted)

    parts = (
        jnp.full((capacity, n_kv, rows), floor, jnp.float32),
        jnp.zeros((capacity, n_kv, rows), jnp.float32),
        jnp.zeros((capacity, n_kv, rows, d), jnp.float32),
    )
    tops, totals, sums = jax.lax.fori_loop(0, -(-ends[-1] // n), body, parts)
    # merge each sequence's items (items past the last belong to sequence S: dropped)
    top = jax.ops.segment_max(tops, owner, num_segments=s)  # [S, N_kv, Q·g]
    scale = jnp.exp(tops - top[jnp.minimum(owner, s - 1)])
    total = jax.ops.segment_sum(totals * scale, owner, num_segments=s)
    out = jax.ops.segment_sum(sums * scale[..., None], owner, num_segments=s) / total[..., None]
    return out.reshape(s, n_kv, nq_len, group, d).transpose(0, 2, 1, 3, 4).reshape(s, nq_len, n_q, d)


# Tiles of the TPU kernel, given explicitly: its own tuned table asks the local device for
# its TPU generation, which a plan compiling for TPU chips from a CPU host does not have.
_KV_PAGES_PER_BLOCK = 16
_QUERIES_PER_BLOCK = 32


def _ragged(q: Array, pages: Array, where: PagedWrite) -> Array:
    """The Pallas TPU kernel (``ragged_paged_attention``). Every sequence is given all its
    ``Q`` query rows and ``kv_len = start + Q`` (padding rows included), so query ``i`` sits
    at position ``start + i`` as the reference has it; the kernel's causal mask hides from
    the real rows every key after their own.

    On a mesh with a ``tensor`` axis each device runs the kernel on its own heads (a Pallas
    call is opaque to the partitioner: :func:`jax.shard_map`): its query heads and the
    key/value pairs they read, the metadata whole."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    s, nq_len, n_q, d = q.shape
    pages_per_seq = where.page_table.shape[1]
    kernel = functools.partial(
        ragged_paged_attention,
        sm_scale=1.0 / float(d) ** 0.5,
        num_kv_pages_per_block=min(_KV_PAGES_PER_BLOCK, pages_per_seq),
        num_queries_per_block=min(_QUERIES_PER_BLOCK, nq_len),
    )
    args = (
        q.reshape(s * nq_len, n_q, d),
        pages,
        (where.start + nq_len).astype(jnp.int32),
        where.page_table.astype(jnp.int32),
        (jnp.arange(s + 1) * nq_len).astype(jnp.int32),
        jnp.array([s], jnp.int32),
    )
    mesh = jax.sharding.get_abstract_mesh()
    free = [] if mesh.empty else [a for a in mesh.axis_names if a not in mesh.manual_axes]
    if "tensor" in free and dict(zip(mesh.axis_names, mesh.axis_sizes))["tensor"] > 1:
        heads = PartitionSpec(None, "tensor", None)
        whole = PartitionSpec()
        # check_vma=False: the pallas_call declares its output without the varying-manual-axes
        # type that shard_map checks
        kernel = jax.shard_map(
            kernel,
            in_specs=(heads, PartitionSpec(None, None, "tensor", None), whole, whole, whole, whole),
            out_specs=heads,
            check_vma=False,
        )
    return kernel(*args).reshape(s, nq_len, n_q, d)
