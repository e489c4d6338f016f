"""The continuous-batching engine: a fixed number of slots, each refilled with the next prompt
as soon as its answer ends, over a paged KV cache.

The static :class:`~asyncopd_jax.sampling.Sampler` decodes a batch until its longest answer
ends; on long-tailed answer lengths most of its decode work is padding. Here ``S`` slots
decode in one compiled loop, each its own sequence, their keys and values in pages of one
shared pool. The engine is two halves: the compiled programs, which schedule the slots and
pages on the device (:class:`~asyncopd_jax.sampling.paged.PagedPrograms`: a call of many
decode steps that admits queued prompts, takes and frees pages and preempts as it goes; the
rewrite of the pages in flight after a weight swap), and the host loop that hands prompts
in, reads finished answers out and keeps going across groups of prompts
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

from asyncopd_jax.sampling.carry import slots_axes
from asyncopd_jax.sampling.engine import BatchFigures, Calls, Engine, ProgramShapes
from asyncopd_jax.sampling.episodes import Turns
from asyncopd_jax.sampling.paged import PagedPrograms
from asyncopd_jax.sampling.stream import ContinuousStream


class ContinuousSampler(PagedPrograms, Engine):
    """Samples responses with continuous batching over a paged KV cache (module docstring;
    arguments: :class:`~asyncopd_jax.sampling.engine.Programs`).

    ``params.slots`` sequences decode at once (0: one per prompt of a group),
    ``params.kv_pages`` pages of ``params.page_size`` tokens hold their keys and values (0:
    enough for every slot's longest sequence).
    """

    def open_stream(
        self,
        state: nnx.State,
        *,
        version: int,
        prompt_slots: int,
        slots: int | None = None,
        turns: Turns | None = None,
    ) -> ContinuousStream:
        return ContinuousStream(self, state, version=version, prompt_slots=prompt_slots, slots=slots, turns=turns)

    def decode_rows(self, rows: int) -> int:
        return self.params.slots or rows

    @property
    def programs(self) -> dict[str, Any]:
        return {"run": self.run, "recompute": self.recompute}

    def program_shapes(self, rows: int, prompt_slots: int) -> ProgramShapes:
        """One shape each, ``(S,)`` slots: the run's admission widths and the attention's
        page-table widths are branches of one program (``lax.switch``), not shapes."""
        slots = (self.decode_rows(rows),)
        return {"run": (slots,), "recompute": (slots,)}

    def abstract_calls(self, abstract_state: Any, rows: int, prompt_slots: int) -> Calls:
        """For :meth:`lower`: :meth:`decode_rows` slots over a pool of :meth:`pool_pages`
        pages, their queue full; the prefill admitting a whole set of slots at once, one
        decode step of every slot over the full page table (the worst case of the
        attention's reads), and the recompute."""
        slots = self.decode_rows(rows)
        pool = self.pool_pages(slots, prompt_slots)
        carry = self.placed(
            jax.eval_shape(lambda s: self.empty(s, slots, prompt_slots, pool), abstract_state), slots_axes
        )
        whole = lambda path, x: (None,) * len(x.shape)  # noqa: E731
        version = self.placed(jax.ShapeDtypeStruct((), jnp.int32), whole)
        return {
            "prefill": (self.prefill, (abstract_state, carry), {}),
            "decode": (self.step, (abstract_state, carry, version), {}),
            "recompute": (self.recompute, (abstract_state, carry), {}),
        }

    def decode_cache(self, abstract_state: Any, rows: int, prompt_slots: int) -> tuple[Any, int]:
        """The pool of :meth:`pool_pages` pages: a step reads the pages its slots' contexts
        hold, not every column of the table the compiled step spans."""
        _, (_, carry, _), _ = self.abstract_calls(abstract_state, rows, prompt_slots)["decode"]
        return carry.slots.cache.pages, self.pool_pages(self.decode_rows(rows), prompt_slots) * self.params.page_size

    def batch_seconds(self, batch: BatchFigures) -> tuple[float, float, float]:
        """The stream outlives a batch, its ``rows`` slots refilled as answers end: a
        sampler's prompts cost their share of prefills of a whole set of slots and R̄ / S
        steps each, every slot busy (no tail) over the mean context a busy slot holds,
        c̄ = P + R̄ / 2; a swap rewrites the live slots' c̄ of the compiled worst case's P + T."""
        share = batch.prompts / batch.samplers
        context = batch.prompt_slots + batch.mean_answer / 2
        steps = share * batch.mean_answer / batch.rows
        prefill = batch.prefill * share / batch.rows
        return prefill, steps * batch.step(context), context / (batch.prompt_slots + self.params.max_new_tokens)
