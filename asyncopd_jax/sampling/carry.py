"""What the continuous engine's compiled programs carry between calls and hand the host:
the slots (:class:`Slots`), the whole carry (:class:`Scheduled`: slots, pages, queue and
parked sequences), a call's inbox (:class:`Incoming`) and outbox (:class:`Finished`,
:class:`Counts`), and how they lie on a mesh (:func:`slots_axes`).

Shapes: S slots, C context slots (P prompt slots; multi-turn ``P + T``), T = max_new_tokens,
M pages per sequence, Q = 2S queue entries, F = 2S outbox rows, Z parked entries (``2 S``
multi-turn, else 0), V vocabulary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from asyncopd_jax.models.paged_attention import PagedKVCache
from asyncopd_jax.models.partitioning import Logical, constrain
from asyncopd_jax.sampling.records import Records
from asyncopd_jax.sampling.schedule import Pages, Parked, Queue

Array = jax.Array


def slots_axes(path: Sequence[Any], x: Any) -> Logical:
    """The layout of a leaf of :class:`Scheduled`: the pool's key/value heads over ``tensor``
    (either layout: the head axis is the third), every other array whole on each device."""
    if any(getattr(key, "name", None) == "cache" for key in path):
        return (None, None, "act_heads") + (None,) * (len(x.shape) - 3)
    return (None,) * len(x.shape)


def constrain_slots(tree: Any) -> Any:
    """``tree`` laid out by :func:`slots_axes` on the mesh traced under (none: unchanged)."""
    return jax.tree_util.tree_map_with_path(lambda path, x: constrain(x, slots_axes(path, x)), tree)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Slots:
    """``S`` slots: the sequences decoding, their records and the shared pool."""

    cache: PagedKVCache
    # [S, C] int32 each slot's context from position 0: its prompt, then (multi-turn) the
    # turns and observations before its current turn
    prompts: Array
    prompt_len: Array  # [S] int32
    begin: Array  # [S] int32 the answer column the current turn starts at (the context past the prompt)
    keys: Array  # [S] PRNG keys of the slots' prompts
    row: Array  # [S] int32 the stream row each slot holds
    admitted: Array  # [S] int32 the admission that filled the slot last (1, 2, ...; 0: never)
    written: Array  # [S] int32 tokens in the cache (prompt + response tokens fed back)
    active: Array  # [S] bool: holds a sequence still decoding
    called: Array  # [S] bool: the current turn sampled one of `tool_call_ids` (multi-turn)
    next_logits: Array  # [S, V] fp32: the distribution of each slot's next token
    records: Records  # [S, T, ...] (past a slot's length: an earlier occupant's, never read)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Scheduled:
    """Everything the loop carries between calls (donated): the slots, the pages, the queue."""

    slots: Slots
    pages: Pages  # table rows: the S slots', then the Z parked entries'
    queue: Queue
    parked: Parked  # Z = 0 single-turn
    admissions: Array  # scalar int32: admissions so far
    parks: Array  # scalar int32: turns parked so far


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Counts:
    """What one call did (scalars int32), for :class:`~asyncopd_jax.sampling.EngineStats`."""

    steps: Array  # decode steps run
    rows: Array  # rows decoded, summed over the steps (each step's width: decode_widths)
    sampled: Array  # tokens sampled (every busy slot's, each step)
    waiting_steps: Array  # steps with prompts still queued after admission
    waiting_sampled: Array  # tokens sampled in those steps
    refills: Array  # admissions into a slot an earlier sequence had held
    preemptions: Array
    prefill_tokens: Array
    peak_pages: Array  # most pages in use at once
    parks: Array  # turns that called a tool and parked
    resumes: Array  # continuations admitted onto their parked pages (the rest are prefilled whole)
    evictions: Array  # parked sequences whose pages were taken back

    @classmethod
    def zero(cls) -> Counts:
        return cls(*(jnp.int32(0) for _ in dataclasses.fields(cls)))

    def add(self, **more: Array) -> Counts:
        return dataclasses.replace(self, **{k: getattr(self, k) + v for k, v in more.items()})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Finished:
    """What a call hands the host, in one transfer: the answers that ended in it, in the
    order they ended, and what it did."""

    records: Records  # [F, T, ...] answer i of the call in row i (rows ≥ count: unused)
    row: Array  # [F] int32 their stream rows
    parked: Array  # [F] bool: the turn called a tool; the sequence waits for its observation
    count: Array  # scalar int32
    counts: Counts


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Incoming:
    """Prompts handed in with a call: the first ``count`` of ``Q`` rows. A multi-turn
    continuation is one too: its context is the whole trajectory so far, ``begin`` the
    answer column its next turn starts at."""

    prompts: Array  # [Q, C] int32 contexts from position 0
    prompt_len: Array  # [Q] int32
    begin: Array  # [Q] int32
    keys: Array  # [Q] PRNG keys
    row: Array  # [Q] int32 stream rows
    count: Array  # scalar int32
    release: Array  # [Q] int32 stream rows whose parked pages to free (episode over; -1: none)
