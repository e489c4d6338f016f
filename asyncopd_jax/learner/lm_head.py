"""The LM head's fused log-prob gather on the learner's mesh: each device its own rows.

:func:`~asyncopd_jax.estimators.gather_logprobs_and_entropy_from_hidden` scans chunks of
positions through ``hidden @ lm_head``. Left to XLA's partitioner on an FSDP mesh, every
device walks every chunk of every row, and each chunk's ``[chunk, V]`` fp32 logits are
all-reduced (the head being split along H): compiled for a v5e 2×2 at Qwen3-1.7B's width, two
``all-reduce f32[512,151936]`` inside the scan bodies.

Here the gather runs under :func:`jax.shard_map` instead, *row-parallel*: the ``[B, T]``
positions are split over every mesh axis (rows over ``data`` and ``fsdp``, as the batch
lies; positions over ``tensor``, the :data:`~asyncopd_jax.models.partitioning.RULES`
``positions`` entry), the head is whole on every device (gathered once, in the compute
dtype), each device scans only its own positions, and its ``[H, V]`` gradient is a local
partial sum until the end of the gather's backward, where it is reduced over the mesh once
(one ``all-reduce bf16[2048,151936]`` in the same compile). Memory: the head and one fp32
``[H, V]`` accumulator per device, for one collective per micro-batch.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import PartitionSpec

from asyncopd_jax.estimators import dense_kls_from_hidden, gather_logprobs_and_entropy_from_hidden
from asyncopd_jax.models.partitioning import logical_spec

Array = jax.Array


def gather_on_mesh(
    hidden: Array, lm_head: Array, ids: Array, chunk_size: int, temperature: float = 1.0
) -> tuple[Array, Array]:
    """``(log-probs, entropy)`` of :func:`gather_logprobs_and_entropy_from_hidden` with its
    positions split over the mesh being traced under (``jax.set_mesh``); on no mesh, or
    one device, that function itself. Same values and gradients either way.

    Args:
      hidden: ``[B, T, H]`` final hidden states, target-aligned.
      lm_head: ``[H, V]``.
      ids: ``[B, T]`` or ``[B, T, K]``.
      chunk_size: rows per chunk of each device's scan.
      temperature: ``τ > 0``.

    Returns:
      ``[B, T]`` or ``[B, T, K]`` log-probs and ``[B, T]`` entropies, fp32, laid out as
      ``hidden``'s rows and positions.
    """
    gather = functools.partial(
        gather_logprobs_and_entropy_from_hidden, chunk_size=chunk_size, temperature=float(temperature)
    )
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return gather(hidden, lm_head, ids)
    rows = logical_spec(("batch", "positions"), hidden.shape[:2], mesh)
    # check_vma=False: the gather's custom VJP returns the head's cotangent as a per-device
    # partial sum (it varies over the mesh) for an input that is the same on every device;
    # shard_map's transpose reduces it to the input's layout, over the devices that split the
    # positions (tests/learner/test_lm_head.py checks the sum, split or not).
    return jax.shard_map(gather, in_specs=(rows, PartitionSpec(), rows), out_specs=(rows, rows), check_vma=False)(
        hidden, lm_head, ids
    )


def dense_kls_on_mesh(
    hidden: Array,
    lm_head: Array,
    teacher_hidden: Array,
    teacher_head: Array,
    mask: Array,
    chunk_size: int,
    temperatures: tuple[float, float],
) -> tuple[Array, Array]:
    """``(KL(q ‖ π), KL(π ‖ q))`` ``[B, T]`` of
    :func:`~asyncopd_jax.estimators.dense_kls_from_hidden`, row-parallel on the mesh being
    traced under as :func:`gather_on_mesh` is: each device its own positions, both heads
    whole on every device, the student head's gradient reduced once. ``temperatures``:
    ``(τ_π, τ_q)``."""
    student_t, teacher_t = temperatures

    def kls(h, w, t_h, t_w, m):
        return dense_kls_from_hidden(
            h, w, t_h, t_w, student_temperature=student_t, teacher_temperature=teacher_t, chunk_size=chunk_size, mask=m
        )

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return kls(hidden, lm_head, teacher_hidden, teacher_head, mask)
    rows = logical_spec(("batch", "positions"), hidden.shape[:2], mesh)
    whole = PartitionSpec()
    return jax.shard_map(kls, in_specs=(rows, whole, rows, whole, rows), out_specs=(rows, rows), check_vma=False)(
        hidden, lm_head, teacher_hidden, teacher_head, mask
    )
