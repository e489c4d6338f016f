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

* ``"reference"``: plain JAX for any backend. It gathers each sequence's ``M`` pages into a
  ``[S, N_kv, M·page_size, D]`` view and masks the softmax, the cost of a dense cache of
  ``M·page_size`` slots per sequence (what the CPU demo and tests run).
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


def _reference(q: Array, pages: Array, where: PagedWrite) -> Array:
    """Gather each sequence's ``M`` pages into ``[S, N_kv, L, D]`` keys and values (``L =
    M·page_size``, heads-major: the scores and the weighted sum are one batched matmul per
    sequence and head, which XLA:CPU runs 1.5-2x faster than the same contraction over the
    gathered ``[S, M, N_kv, page, D]`` blocks) and mask: key ``j`` is visible to query ``i``
    iff ``j ≤ start + i``."""
    s, nq_len, n_q, d = q.shape
    n_kv, page_size = pages.shape[2], pages.shape[3]
    group, length = n_q // n_kv, where.page_table.shape[1] * page_size

    def gathered(which: Array) -> Array:
        blocks = which[where.page_table]  # [S, M, N_kv, page, D]
        return blocks.transpose(0, 2, 1, 3, 4).reshape(s, n_kv, length, d)

    # read in the compute dtype (the query's): a narrower pool rounds what is stored only
    keys, values = gathered(pages[0]).astype(q.dtype), gathered(pages[1]).astype(q.dtype)
    # a key/value head's queries: its group of query heads at each of the Q positions
    grouped = q.reshape(s, nq_len, n_kv, group, d).transpose(0, 2, 1, 3, 4).reshape(s, n_kv, nq_len * group, d)
    scores = jnp.einsum("skqd,skld->skql", grouped, keys, preferred_element_type=jnp.float32)
    scores = scores / jnp.sqrt(jnp.float32(d))
    query = where.start[:, None] + jnp.repeat(jnp.arange(nq_len), group)[None]  # [S, Q·g] each row's position
    visible = jnp.arange(length)[None, None] <= query[..., None]  # [S, Q·g, L]
    scores = jnp.where(visible[:, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
    out = jnp.einsum("skql,skld->skqd", probs, values, preferred_element_type=jnp.float32)
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
