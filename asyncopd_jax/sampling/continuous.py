"""The continuous-batching engine: a fixed number of slots, each refilled with the next prompt
as soon as its answer ends, over a paged KV cache.

The static :class:`~asyncopd_jax.sampling.Sampler` decodes a batch until its longest answer
ends; on long-tailed answer lengths most of its decode work is padding. Here ``S`` slots
decode in one compiled loop, each its own sequence, their keys and values in pages of one
shared pool. The engine is two halves: the compiled programs
(:class:`~asyncopd_jax.sampling.paged.PagedPrograms`: prefill into pages, a chunk of decode
steps, the rewrite of the pages in flight after a weight swap) and the host loop that hands
out slots and pages, refills finished slots and keeps going across groups of prompts
(:class:`~asyncopd_jax.sampling.stream.ContinuousStream`). ``generate`` runs one group
through a fresh stream.

Randomness is per prompt (:mod:`asyncopd_jax.sampling.decode`), whichever slot a prompt runs
in and whenever it was admitted: an answer equals the one that prompt gets alone, or from the
static engine, with the same key. Everything a rollout records is what the static engine
records (:class:`~asyncopd_jax.cache.RolloutBatch`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from asyncopd_jax.sampling.engine import Calls, Engine, ProgramShapes
from asyncopd_jax.sampling.paged import Admission, PagedPrograms, slots_axes
from asyncopd_jax.sampling.stream import ContinuousStream, buckets


class ContinuousSampler(PagedPrograms, Engine):
    """Samples responses with continuous batching over a paged KV cache (module docstring;
    arguments: :class:`~asyncopd_jax.sampling.engine.Programs`).

    ``params.slots`` sequences decode at once (0: one per prompt of a group),
    ``params.kv_pages`` pages of ``params.page_size`` tokens hold their keys and values (0:
    enough for every slot's longest sequence).
    """

    def open_stream(
        self, state: nnx.State, *, version: int, prompt_slots: int, slots: int | None = None
    ) -> ContinuousStream:
        return ContinuousStream(self, state, version=version, prompt_slots=prompt_slots, slots=slots)

    def decode_rows(self, rows: int) -> int:
        return self.params.slots or rows

    @property
    def programs(self) -> dict[str, Any]:
        return {"prefill": self.admit, "decode": self.decode, "recompute": self.recompute, "evict": self.evict}

    def program_shapes(self, rows: int, prompt_slots: int) -> ProgramShapes:
        """With ``S`` slots and ``M`` pages per sequence: the prefill at ``(R, C)``, R prompts
        admitted at once and C page-table columns read (each a power of two below S or M,
        or S or M: :func:`~asyncopd_jax.sampling.stream.bucket`); the decode at ``(W, C)``,
        W slots decoded; the recompute at ``(C,)``; the eviction at ``(S,)``."""
        widths = buckets(self.decode_rows(rows))
        columns = buckets(self.pages_per_sequence(prompt_slots))
        return {
            "prefill": tuple((r, c) for r in widths for c in columns),
            "decode": tuple((w, c) for w in widths for c in columns),
            "recompute": tuple((c,) for c in columns),
            "evict": ((self.decode_rows(rows),),),
        }

    def abstract_calls(self, abstract_state: Any, rows: int, prompt_slots: int) -> Calls:
        """For :meth:`lower`: :meth:`decode_rows` slots over a pool of :meth:`pool_pages`
        pages, the page table at full width (the worst case of the attention's reads), the
        prefill admitting a whole set of slots at once and the decode running every slot."""
        slots = self.decode_rows(rows)
        columns = self.pages_per_sequence(prompt_slots)
        pool = self.pool_pages(slots, prompt_slots)
        whole = lambda path, x: (None,) * len(x.shape)  # noqa: E731
        carry = self.placed(
            jax.eval_shape(lambda s: self.empty(s, slots, prompt_slots, pool), abstract_state), slots_axes
        )
        table = self.placed(jax.ShapeDtypeStruct((slots, columns), jnp.int32), whole)
        new = self.placed(
            jax.eval_shape(
                lambda: Admission(
                    slot=jnp.zeros((slots,), jnp.int32),
                    prompts=jnp.zeros((slots, prompt_slots), jnp.int32),
                    prompt_len=jnp.zeros((slots,), jnp.int32),
                    keys=jax.random.split(jax.random.key(0), slots),
                )
            ),
            whole,
        )
        scalar = self.placed(jax.ShapeDtypeStruct((), jnp.int32), whole)
        every = self.placed(jax.ShapeDtypeStruct((slots,), jnp.int32), whole)  # every slot: the widest decode
        static = {"columns": columns}
        return {
            "prefill": (self.admit, (abstract_state, carry, new, table), static),
            "decode": (self.decode, (abstract_state, carry, table, every, scalar, scalar), static),
            "recompute": (self.recompute, (abstract_state, carry, table), static),
        }
