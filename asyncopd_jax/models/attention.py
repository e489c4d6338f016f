"""Causal self-attention over a whole sequence (training, teacher scoring, prefill), in three
implementations behind :func:`causal_attention`.

Query position ``i`` attends key position ``j`` iff ``j <= i`` and both have the same segment
id; scores ``q·k / sqrt(D)`` and the softmax are fp32, the probabilities are cast to ``v``'s
dtype before the weighted sum, and query head ``h`` reads kv head ``h // (N_q // N_kv)``
(grouped-query attention). Every query attends at least itself, so no row is empty.

* ``"xla"``: the reference. It materialises ``[B, N_q, S, S]`` fp32 scores (and keeps the
  probabilities for the backward pass): right for short sequences, the oracle for the others.
* ``"blockwise"``: pure JAX for any backend. Flash attention: an online softmax over
  ``block × block`` tiles, key tiles above the diagonal skipped, and a hand-written backward
  pass (:func:`jax.custom_vjp`) that recomputes each tile from the saved log-sum-exp.
* ``"splash"``: the Pallas TPU splash-attention kernel (Pallas interpret mode elsewhere, which
  is slow and meant for tests).

The stage that runs a model picks one with :func:`resolve_implementation` from its devices'
platform.
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
from jax import Array
from jax.sharding import PartitionSpec

from asyncopd_jax.models.partitioning import target_platform

Implementation = Literal["xla", "blockwise", "splash"]
AttentionSetting = Literal["auto", "xla", "blockwise", "splash"]

IMPLEMENTATIONS: tuple[Implementation, ...] = ("xla", "blockwise", "splash")
SETTINGS: tuple[AttentionSetting, ...] = ("auto", *IMPLEMENTATIONS)

# Splash-attention tiles: 512 × 512 is what MaxText uses on v5e for S = 4096, D = 128 (the
# kernel's own default, 128, leaves the MXU under-fed); the Mosaic kernel needs multiples of
# 128 (the TPU's lane count), in the sequence and in the head dimension.
_LANES = 128
SPLASH_MAX_BLOCK = 512

_BATCH_MESH_AXES = ("data", "fsdp")
_HEAD_MESH_AXIS = "tensor"


def resolve_implementation(setting: AttentionSetting, platform: str) -> Implementation:
    """The implementation ``setting`` means on devices of ``platform`` (``device.platform``).

    ``"auto"`` is the Pallas kernel on TPU, the pure-JAX flash attention on GPU, and the
    plain reference on CPU (the demo's tiny models and short sequences, where it is the
    fastest). The platform is the stage's devices', not ``jax.default_backend()``: a plan
    compiles for TPU chips on a CPU host.
    """
    if setting == "auto":
        platform = platform.lower()
        if platform == "tpu":
            return "splash"
        if platform in ("gpu", "cuda", "rocm"):
            return "blockwise"
        return "xla"
    if setting not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation {setting!r}: expected one of {list(SETTINGS)}")
    return setting


def causal_attention(
    q: Array,
    k: Array,
    v: Array,
    segment_ids: Array,
    *,
    implementation: Implementation = "xla",
    block_size: int = 512,
    interpret: bool | None = None,
) -> Array:
    """Causal grouped-query self-attention over whole sequences.

    Args:
      q: queries ``[B, S, N_q, D]``.
      k: keys ``[B, S, N_kv, D]``, ``N_q`` a multiple of ``N_kv``.
      v: values ``[B, S, N_kv, D]``.
      segment_ids: ``[B, S]`` int; a query attends only earlier (or its own) positions of
        the same segment (the decoder passes the attention mask: padding 0, tokens 1).
      implementation: ``"xla"``, ``"blockwise"`` or ``"splash"`` (module docstring).
      block_size: the tile of ``"blockwise"`` (clipped to ``S``), and the largest tile
        ``"splash"`` may use (a multiple of 128).
      interpret: ``"splash"`` only: run the kernel in Pallas interpret mode. ``None``:
        interpret unless the kernel will run on a TPU: the platform of the mesh the caller
        traces under (``jax.set_mesh``), else JAX's default backend. Pass ``False`` to
        compile the Mosaic kernel for TPU devices from a CPU host without such a mesh.

    Returns:
      ``[B, S, N_q, D]`` in ``v``'s dtype.
    """
    _check_shapes(q, k, v, segment_ids)
    segment_ids = segment_ids.astype(jnp.int32)
    if implementation == "xla":
        return _xla_attention(q, k, v, segment_ids)
    if block_size < 1:
        raise ValueError(f"block_size={block_size}: expected a positive tile size")
    if implementation == "blockwise":
        return _blockwise_attention(q, k, v, segment_ids, block_size)
    if implementation == "splash":
        if block_size % _LANES:
            raise ValueError(f"block_size={block_size}: splash attention tiles are multiples of {_LANES}")
        if interpret is None:
            interpret = target_platform() != "tpu"
        return _splash_attention(q, k, v, segment_ids, min(block_size, SPLASH_MAX_BLOCK), interpret)
    raise ValueError(f"attention implementation {implementation!r}: expected one of {list(IMPLEMENTATIONS)}")


def _check_shapes(q: Array, k: Array, v: Array, segment_ids: Array) -> None:
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(
            f"causal_attention: expected q [B, S, N_q, D], k and v [B, S, N_kv, D]; got {q.shape=}, "
            f"{k.shape=}, {v.shape=}"
        )
    b, s, n_q, d = q.shape
    if k.shape[:2] != (b, s) or k.shape[3] != d or n_q % k.shape[2]:
        raise ValueError(f"causal_attention: k, v {k.shape} do not match q {q.shape} (same B, S, D; N_kv dividing N_q)")
    if segment_ids.shape != (b, s):
        raise ValueError(f"causal_attention: segment_ids {segment_ids.shape}, expected [B, S] = {(b, s)}")


def _mask(q_pos: Array, k_pos: Array, q_seg: Array, k_seg: Array) -> Array:
    """Which keys each query may attend: ``[B, Sq, Sk]`` from positions ``[Sq]``, ``[Sk]``
    and segment ids ``[B, Sq]``, ``[B, Sk]``."""
    return (q_pos[:, None] >= k_pos[None, :])[None] & (q_seg[:, :, None] == k_seg[:, None, :])


# --------------------------------------------------------------------------- xla


def _xla_attention(q: Array, k: Array, v: Array, segment_ids: Array) -> Array:
    """The reference: whole ``[B, N_kv, G, S, S]`` fp32 scores."""
    b, s, n_q, d = q.shape
    n_kv = k.shape[2]
    q = q.reshape(b, s, n_kv, n_q // n_kv, d)  # query head h = kv * G + g reads kv head h // G
    scores = jnp.einsum("bqkgd,bckd->bkgqc", q, k, preferred_element_type=jnp.float32)
    scores = scores / jnp.sqrt(jnp.float32(d))
    positions = jnp.arange(s)
    mask = _mask(positions, positions, segment_ids, segment_ids)[:, None, None]
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqc,bckd->bqkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, s, n_q, d).astype(v.dtype)


# --------------------------------------------------------------------------- padding


def _pad_sequence(x: Array, length: int, value: Array | int = 0) -> Array:
    """``x [B, S, ...]`` padded with ``value`` to ``[B, length, ...]``."""
    pad = length - x.shape[1]
    if pad == 0:
        return x
    if isinstance(value, int):
        return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=value)
    fill = jnp.broadcast_to(value, (x.shape[0], pad, *x.shape[2:])).astype(x.dtype)
    return jnp.concatenate([x, fill], axis=1)


def _pad_segment_ids(segment_ids: Array, length: int) -> Array:
    """``[B, S]`` → ``[B, length]``. Padded keys come after every real query, so causality
    alone hides them; the padded positions get a segment id no real position of their row
    has (one below the row's least), so each padded query attends only padded keys, itself
    included: no row of the softmax is empty (an empty one would be NaN, and a NaN
    probability poisons dK and dV even where its output row is sliced off)."""
    return _pad_sequence(segment_ids, length, jnp.min(segment_ids, axis=1, keepdims=True) - 1)


# --------------------------------------------------------------------------- blockwise


def _blockwise_attention(q: Array, k: Array, v: Array, segment_ids: Array, block_size: int) -> Array:
    """Flash attention in pure JAX: ``[B, S, N_q, D]`` in, ``[B, S, N_q, D]`` out.

    Both queries and keys are cut into tiles of ``block = min(block_size, S)`` positions
    (``S`` padded to a multiple), so the live fp32 scores are ``[B, N_q, block, block]``;
    key tiles wholly above the diagonal are skipped. Forward and backward hold the inputs,
    the output and an fp32 log-sum-exp ``[B, N_q, S]``, never a whole ``[S, S]``.
    """
    b, s, n_q, d = q.shape
    n_kv = k.shape[2]
    block = min(block_size, s)
    padded = -(-s // block) * block
    seg = _pad_segment_ids(segment_ids, padded)
    q, k, v = (_pad_sequence(x, padded) for x in (q, k, v))
    q = q.reshape(b, padded, n_kv, n_q // n_kv, d)  # query head h = kv * G + g reads kv head h // G
    out = _flash(q, k, v, seg, block)
    return out.reshape(b, padded, n_q, d)[:, :s]


# Why a custom VJP rather than jax.checkpoint of the tile bodies: autodiff of the loops keeps
# every tile's probabilities; checkpointed, it still keeps each key step's running fp32
# accumulator [B, N_q, block, D] for the query tile it differentiates (an fp32 copy of the
# whole output across the S / block steps), runs the forward once more, and cannot skip
# the tiles above the diagonal (reverse mode needs fixed trip counts: twice the FLOPs). The
# flash-attention backward needs only the output and its fp32 row log-sum-exp: each tile's
# probabilities are recomputed exactly as exp(s - lse), and both passes stop at the diagonal.
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q: Array, k: Array, v: Array, segment_ids: Array, block: int) -> Array:
    """``q [B, S, N_kv, G, D]``, ``k, v [B, S, N_kv, D]``, ``segment_ids [B, S]``, ``S`` a
    multiple of ``block`` → ``[B, S, N_kv, G, D]`` in ``v``'s dtype."""
    return _flash_forward(q, k, v, segment_ids, block)[0]


def _tile(x: Array, index: Array, block: int) -> Array:
    """Tile ``index`` of ``x``'s sequence axis (axis 1)."""
    return jax.lax.dynamic_slice_in_dim(x, index * block, block, axis=1)


def _tile_scores(qi: Array, kj: Array, mask: Array, scale: float) -> Array:
    """fp32 scores ``[B, N_kv, G, bq, bk]`` of query tile ``qi [B, bq, N_kv, G, D]`` against key
    tile ``kj [B, bk, N_kv, D]``; masked entries hold the most negative finite fp32 (not
    -inf: a row masked so far must not make ``m - m_new`` a NaN)."""
    scores = jnp.einsum("bqkgd,bckd->bkgqc", qi, kj, preferred_element_type=jnp.float32) * scale
    return jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)


def _flash_forward(q: Array, k: Array, v: Array, segment_ids: Array, block: int) -> tuple[Array, Array]:
    """The output ``[B, S, N_kv, G, D]`` and the fp32 row log-sum-exp ``[B, N_kv, G, S]``."""
    b, s, n_kv, g, d = q.shape
    scale = 1.0 / math.sqrt(d)
    offsets = jnp.arange(block)
    neg = jnp.finfo(jnp.float32).min

    def query_tile(i, carry):
        out, lse = carry
        qi, q_seg, q_pos = _tile(q, i, block), _tile(segment_ids, i, block), i * block + offsets

        def key_tile(j, state):  # online softmax: running max m, denominator, numerator acc
            m, denom, acc = state
            mask = _mask(q_pos, j * block + offsets, q_seg, _tile(segment_ids, j, block))
            scores = _tile_scores(qi, _tile(k, j, block), mask, scale)
            m_new = jnp.maximum(m, scores.max(axis=-1))
            p = jnp.where(mask[:, None, None], jnp.exp(scores - m_new[..., None]), 0.0)
            correction = jnp.exp(m - m_new)
            pv = jnp.einsum(
                "bkgqc,bckd->bkgqd", p.astype(v.dtype), _tile(v, j, block), preferred_element_type=jnp.float32
            )
            return m_new, denom * correction + p.sum(axis=-1), acc * correction[..., None] + pv

        state = (
            jnp.full((b, n_kv, g, block), neg),
            jnp.zeros((b, n_kv, g, block), jnp.float32),
            jnp.zeros((b, n_kv, g, block, d), jnp.float32),
        )
        m, denom, acc = jax.lax.fori_loop(0, i + 1, key_tile, state)  # tiles j > i are all masked
        oi = jnp.einsum("bkgqd->bqkgd", acc / denom[..., None]).astype(v.dtype)
        out = jax.lax.dynamic_update_slice_in_dim(out, oi, i * block, axis=1)
        lse = jax.lax.dynamic_update_slice_in_dim(lse, m + jnp.log(denom), i * block, axis=3)
        return out, lse

    init = (jnp.zeros(q.shape, v.dtype), jnp.zeros((b, n_kv, g, s), jnp.float32))
    return jax.lax.fori_loop(0, s // block, query_tile, init)


def _flash_fwd(q, k, v, segment_ids, block):
    out, lse = _flash_forward(q, k, v, segment_ids, block)
    return out, (q, k, v, segment_ids, out, lse)


def _flash_bwd(block, residuals, d_out):
    """Flash-attention backward, one pass: for each key tile j, the query tiles i >= j
    recompute ``p = exp(s - lse)`` and add their parts of dK_j and dV_j (carried in fp32) and
    of dQ_i (an fp32 ``[B, S, N_kv, G, D]`` accumulator, as FlashAttention-2 keeps)."""
    q, k, v, segment_ids, out, lse = residuals
    b, s, n_kv, g, d = q.shape
    scale = 1.0 / math.sqrt(d)
    offsets = jnp.arange(block)
    tiles = s // block
    # delta_i = sum_d dO_i · O_i = sum_j P_ij dP_ij: the softmax's Jacobian term, per row
    delta = jnp.einsum("bskgd,bskgd->bkgs", d_out, out, preferred_element_type=jnp.float32)

    def key_tile(j, carry):
        dq, dk, dv = carry
        kj, vj, k_seg, k_pos = _tile(k, j, block), _tile(v, j, block), _tile(segment_ids, j, block), j * block + offsets

        def query_tile(i, state):
            dq, dkj, dvj = state
            qi, doi = _tile(q, i, block), _tile(d_out, i, block)
            mask = _mask(i * block + offsets, k_pos, _tile(segment_ids, i, block), k_seg)
            scores = _tile_scores(qi, kj, mask, scale)
            lse_i = jax.lax.dynamic_slice_in_dim(lse, i * block, block, axis=3)
            p = jnp.where(mask[:, None, None], jnp.exp(scores - lse_i[..., None]), 0.0)
            dvj = dvj + jnp.einsum("bkgqc,bqkgd->bckd", p.astype(doi.dtype), doi, preferred_element_type=jnp.float32)
            dp = jnp.einsum("bqkgd,bckd->bkgqc", doi, vj, preferred_element_type=jnp.float32)
            delta_i = jax.lax.dynamic_slice_in_dim(delta, i * block, block, axis=3)
            ds = (p * (dp - delta_i[..., None]) * scale).astype(q.dtype)
            dqi = jnp.einsum("bkgqc,bckd->bqkgd", ds, kj, preferred_element_type=jnp.float32)
            dq = jax.lax.dynamic_update_slice_in_dim(dq, _tile(dq, i, block) + dqi, i * block, axis=1)
            dkj = dkj + jnp.einsum("bkgqc,bqkgd->bckd", ds, qi, preferred_element_type=jnp.float32)
            return dq, dkj, dvj

        zeros = jnp.zeros((b, block, n_kv, d), jnp.float32)
        dq, dkj, dvj = jax.lax.fori_loop(j, tiles, query_tile, (dq, zeros, zeros))  # tiles i < j: all masked
        dk = jax.lax.dynamic_update_slice_in_dim(dk, dkj.astype(dk.dtype), j * block, axis=1)
        dv = jax.lax.dynamic_update_slice_in_dim(dv, dvj.astype(dv.dtype), j * block, axis=1)
        return dq, dk, dv

    init = (jnp.zeros(q.shape, jnp.float32), jnp.zeros_like(k), jnp.zeros_like(v))
    dq, dk, dv = jax.lax.fori_loop(0, tiles, key_tile, init)
    return dq.astype(q.dtype), dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# --------------------------------------------------------------------------- splash


def _splash_block(length: int, max_block: int) -> int:
    """The largest tile of 512, 256 or 128 (at most ``max_block``) dividing ``length`` (a
    multiple of 128): padding ``S`` to 128 and taking a smaller tile wastes less than
    padding it to a multiple of 512."""
    return next(t for t in (512, 256, 128) if t <= max_block and length % t == 0)


def _splash_attention(q: Array, k: Array, v: Array, segment_ids: Array, max_block: int, interpret: bool) -> Array:
    """The Pallas TPU kernel on ``[B, S, N, D]`` arrays of any ``S`` and ``D``.

    ``D`` is zero-padded to a multiple of 128 (zeros add nothing to ``q·k``; the padded value
    columns are sliced off) and ``S`` to a multiple of 128 (:func:`_pad_segment_ids`); the
    query is scaled by ``1/sqrt(D)`` of the original ``D``, as the kernel does not scale.
    """
    b, s, n_q, d = q.shape
    n_kv = k.shape[2]
    length = -(-s // _LANES) * _LANES
    head_dim = -(-d // _LANES) * _LANES
    block = _splash_block(length, max_block)
    seg = _pad_segment_ids(segment_ids, length)
    scaled = (q.astype(jnp.float32) / math.sqrt(d)).astype(q.dtype)

    def heads_major(x: Array) -> Array:  # [B, S, N, D] → [B, N, S_pad, D_pad], the kernel's layout
        x = jnp.pad(x, [(0, 0), (0, length - s), (0, 0), (0, head_dim - d)])
        return jnp.swapaxes(x, 1, 2)

    qh, kh, vh = heads_major(scaled), heads_major(k), heads_major(v)

    mesh = jax.sharding.get_abstract_mesh()
    kernel = functools.partial(_splash_local, block=block, interpret=interpret)
    if mesh.empty:
        out = kernel(qh, kh, vh, seg)
    else:
        batch_spec, head_spec = _splash_partition(mesh, b, n_kv)
        qkv = PartitionSpec(batch_spec, head_spec, None, None)
        # A Pallas call is opaque to the partitioner: each device runs the kernel on its own
        # examples and heads. check_vma=False: the kernel's pallas_call declares its outputs
        # without the varying-manual-axes type that shard_map checks (it refuses them).
        out = jax.shard_map(
            kernel, in_specs=(qkv, qkv, qkv, PartitionSpec(batch_spec, None)), out_specs=qkv, check_vma=False
        )(qh, kh, vh, seg)
    return jnp.swapaxes(out, 1, 2)[:, :s, :, :d].astype(v.dtype)


def _splash_partition(mesh: jax.sharding.AbstractMesh, batch: int, kv_heads: int) -> tuple:
    """The mesh axes splitting the batch (those of ``data``, ``fsdp`` the mesh has) and the
    heads (``tensor``, if it has it) for :func:`jax.shard_map`; axes already manual (the
    caller is inside a ``shard_map`` over them) are left alone."""
    free = [a for a in mesh.axis_names if a not in mesh.manual_axes]
    batch_axes = tuple(a for a in _BATCH_MESH_AXES if a in free)
    head_axis = _HEAD_MESH_AXIS if _HEAD_MESH_AXIS in free else None
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    split = math.prod(sizes[a] for a in batch_axes)
    if batch % split:
        raise ValueError(f"splash attention: batch {batch} does not split over mesh axes {batch_axes} ({split} ways)")
    if head_axis is not None and kv_heads % sizes[head_axis]:
        raise ValueError(
            f"splash attention: {kv_heads} kv heads do not split over mesh axis {head_axis!r} ({sizes[head_axis]} ways)"
        )
    return (batch_axes or None), head_axis


def _splash_local(q: Array, k: Array, v: Array, segment_ids: Array, *, block: int, interpret: bool) -> Array:
    """One device's share: ``q [B, N_q, S, D]``, ``k, v [B, N_kv, S, D]``, ``segment_ids [B, S]``
    (``S``, ``D`` multiples of 128) → ``[B, N_q, S, D]``.

    GQA: neither the MQA kernel vmapped over kv heads (MaxText) nor the MHA kernel on
    repeated kv heads, but the MHA kernel given the ``N_kv`` heads themselves: it reads kv
    head ``h // (N_q / N_kv)`` for query head ``h`` in its index maps and sums dK, dV over each
    group in its backward. K and V are held once (repeating them would copy them, and their
    gradients, G times), with no regrouping of q.
    """
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    n_q, length = q.shape[1], q.shape[2]
    mask = masks.MultiHeadMask([masks.CausalMask((length, length))] * n_q)
    tiles = splash.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block,
        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
        block_q_dq=block, block_kv_dq=block,
    )  # fmt: skip
    kernel = splash.make_splash_mha(mask, block_sizes=tiles, head_shards=1, q_seq_shards=1, interpret=interpret)

    def example(q, k, v, seg):
        return kernel(q, k, v, segment_ids=splash.SegmentIds(q=seg, kv=seg))

    return jax.vmap(example)(q, k, v, segment_ids)
