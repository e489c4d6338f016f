"""Multi-turn rollouts in the continuous engine: a turn that calls a tool parks, its
observation joins the trajectory without re-prefilling what the pages hold, and what is
recorded is what the model sampled over the whole trajectory, however the slots, pages,
chunks and weight swaps fell."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from asyncopd_jax.environments import EnvironmentPool, Observation
from asyncopd_jax.sampling import ContinuousSampler, SamplingParams, run_stream
from asyncopd_jax.sampling.episodes import Turns
from asyncopd_jax.sampling.schedule import Pages, Parked, evict, oldest_parked, park, take_pages
from tests.sampling.conftest import AHEAD_FAST_READ_FIRST_EXTENDED
from tests.tiny_models import tiny_decoder

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [15], [16, 17], [18, 19, 20, 21], [22], [23, 24], [25, 26, 27]]
PROMPT_SLOTS = 6
STOPS = (51, 54, 56, 58)
CALLS = tuple(range(10, 30))  # a third of the vocabulary opens a tool call: most turns call
MODELS = [nnx.split(tiny_decoder(seed, scale=0.7)) for seed in (0, 1)]
FIELDS = ["response_tokens", "response_mask", "environment_mask", "behavior_logp", "token_version", "candidate_ids"]


def _params(**changes) -> SamplingParams:
    base = dict(
        temperature=0.8,
        max_new_tokens=40,
        num_candidates=2,
        student_topk=2,
        stop_token_ids=STOPS,
        chunk_steps=3,
        engine="continuous",
        slots=3,
        page_size=4,
        tool_call_ids=CALLS,
    )
    return SamplingParams(**{**base, **changes})


@functools.cache
def _engine(params: SamplingParams) -> ContinuousSampler:
    return ContinuousSampler(MODELS[0][0], params)


class Scripted:
    """An environment whose observation is a function of the turn: 1–3 ids from the turn's
    tokens; done after ``turns`` turns. ``seconds``: how long a step sleeps."""

    def __init__(self, turns: int = 3, seconds: float = 0.0, long: int = 0):
        self.turns, self.seconds, self.long, self.seen = turns, seconds, long, []

    def step(self, turn: str) -> Observation:
        ids = [int(x) for x in turn.split()]
        self.seen.append(ids)
        time.sleep(self.seconds)
        if len(self.seen) >= self.turns:
            return Observation(done=True, calls=1)
        size = self.long or 1 + sum(ids) % 3
        return Observation(ids=tuple(30 + (sum(ids) + k) % 20 for k in range(size)), calls=1)


def _turns(workers: int = 4) -> Turns:
    return Turns(
        pool=EnvironmentPool(workers=workers, timeout_s=60),
        text=lambda ids: " ".join(map(str, ids)),
        ids=lambda text: [int(x) for x in text.split()],
    )


def _rollout(params: SamplingParams, environments=None, weight_source=None, key: int = 0, slots=None):
    engine = _engine(params)
    environments = environments or [Scripted() for _ in PROMPTS]
    stream = engine.open_stream(MODELS[0][1], version=0, prompt_slots=PROMPT_SLOTS, slots=slots, turns=_turns())
    stream.submit(None, PROMPTS, jax.random.split(jax.random.key(key), len(PROMPTS)), environments)
    ((_, batch),) = run_stream(stream, weight_source)
    stream.turns.pool.close()
    return batch, stream, environments


def _forced_logp(model_state, batch, temperature: float) -> np.ndarray:
    """``[B, T]`` log-probs of each trajectory token under one plain forward of the whole
    trajectory (prompt, turns and observations)."""
    model = nnx.merge(MODELS[0][0], model_state)
    ids = np.concatenate([batch.prompt_tokens, batch.response_tokens], axis=1)
    mask = np.concatenate([batch.prompt_mask, batch.context_mask], axis=1)
    logits = np.asarray(model(ids, attention_mask=mask))[:, batch.prompt_tokens.shape[1] - 1 : -1]
    logp = jax.nn.log_softmax(logits / temperature, axis=-1)
    return np.take_along_axis(np.asarray(logp), np.asarray(batch.response_tokens)[..., None], axis=-1)[..., 0]


def _segments(mask: np.ndarray) -> int:
    """Runs of True in a row."""
    return len(_runs(mask))


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """The runs of True in a row, as ``(start, end)``."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


@AHEAD_FAST_READ_FIRST_EXTENDED
def test_a_trajectory_records_what_the_model_sampled_over_its_observations(chunk_order):
    """Each student token's behaviour log-prob is the model's over the whole trajectory read
    at once: the observations' keys and values were written where they belong, and a
    resumed sequence's parked pages hold its prefix. The observations sit where the
    environment put them, outside the response mask; a turn without a call ends the
    episode, one with a call parks."""
    params = _params()
    batch, stream, environments = _rollout(params)
    student, environment = np.asarray(batch.response_mask), np.asarray(batch.environment_mask)
    assert not (student & environment).any()
    forced = _forced_logp(MODELS[0][1], batch, params.temperature)
    np.testing.assert_allclose(np.asarray(batch.behavior_logp)[student], forced[student], atol=2e-5)
    tokens = np.asarray(batch.response_tokens)
    for row, env in enumerate(environments):
        turns = _runs(student[row])
        observations = _runs(environment[row])
        assert len(turns) == len(observations) + 1
        for k, (a, b) in enumerate(turns):  # each turn as the environment read it, then its observation
            turn = tokens[row, a:b].tolist()
            parked = np.isin(turn, CALLS).any() and turn[-1] in STOPS and b < params.max_new_tokens
            assert parked == (k < len(env.seen)), (row, k)  # a turn that calls parks: its environment reads it
            if k < len(env.seen):
                assert env.seen[k] == turn
            if k < len(observations):
                a, b = observations[k]
                assert a == turns[k][1]
                np.testing.assert_array_equal(
                    tokens[row, a:b], [30 + (sum(turn) + j) % 20 for j in range(1 + sum(turn) % 3)]
                )
    episodes = stream.stats.episodes
    assert episodes.episodes == len(PROMPTS) and episodes.turns == sum(_segments(row) for row in student)
    assert stream.stats.parks == sum(len(e.seen) for e in environments) > 5
    # ample pages: every continuation finds its parked pages, unless more sequences parked at
    # once than the parked entries hold (2 S; the oldest is then evicted: rare, timing's)
    continuations, evicted = sum(_segments(row) for row in environment), stream.stats.evictions
    assert continuations - evicted <= stream.stats.resumes <= continuations and stream.stats.resumes > 5
    assert episodes.observation_tokens == environment.sum()
    assert episodes.tool_calls == stream.stats.parks
    if not evicted:  # without re-prefilling a prefix: the prompts, then per resume its stop token and observation
        prompts = sum(len(p) for p in PROMPTS)
        assert stream.stats.prefill_tokens == prompts + stream.stats.resumes + environment.sum()
    assert any(len(e.seen) == e.turns for e in environments)  # an episode the environment ended
    carry = stream.carry  # every parked sequence's pages came back
    assert not np.asarray(carry.parked.used).any()
    assert int(carry.pages.top) == carry.pages.free.shape[0]


@pytest.mark.extended  # ~9 s (two more streams, slow tools): CI's second step, the README command's margin
def test_trajectories_do_not_depend_on_slots_pages_or_evictions():
    """One slot; three with ample pages; three with a pool so short that parked sequences
    are evicted (re-prefilled whole) and busy ones preempted: the same trajectories."""
    want, _, _ = _rollout(_params())
    for params in (_params(slots=1), _params(kv_pages=14)):
        # slow tools keep sequences parked while the other prompts take the pages
        environments = [Scripted(seconds=0.2 if params.kv_pages else 0.0) for _ in PROMPTS]
        got, stream, _ = _rollout(params, environments)
        for field in FIELDS:
            np.testing.assert_allclose(np.asarray(getattr(got, field)), np.asarray(getattr(want, field)), atol=1e-5)
        if params.kv_pages:
            assert stream.stats.evictions > 0 and stream.stats.preemptions > 0


def test_a_trajectory_spanning_a_weight_swap_records_each_tokens_version():
    """Weights swapped mid-stream (between and within turns): every student token records
    the version that sampled it and has that model's log-prob over the whole trajectory
    (parked pages of the old weights are rewritten, not read); the trajectory is as stale
    as its oldest student token."""
    params = _params(chunk_steps=2)
    calls = {"n": 0}

    def weight_source(version):
        calls["n"] += 1
        return (1, MODELS[1][1]) if calls["n"] >= 4 else None

    batch, _, _ = _rollout(params, weight_source=weight_source)
    student = np.asarray(batch.response_mask)
    versions = np.asarray(batch.token_version)
    spanning = [r for r in range(len(PROMPTS)) if set(versions[r][student[r]]) == {0, 1}]
    assert spanning, "no trajectory spans the swap"
    across_turns = [
        r for r in spanning if _segments(student[r] & (versions[r] == 1)) >= 1 and _segments(student[r]) > 1
    ]
    assert across_turns
    logp = np.asarray(batch.behavior_logp)
    for version in (0, 1):
        forced = _forced_logp(MODELS[version][1], batch, params.temperature)
        mine = student & (versions == version)
        np.testing.assert_allclose(logp[mine], forced[mine], atol=2e-5)
    np.testing.assert_array_equal(np.asarray(batch.oldest_version)[spanning], 0)


def test_an_observation_past_the_answers_room_ends_its_episode():
    """An observation that leaves no column for another student token ends the episode
    (truncated): it is not written, and the parked pages are freed."""
    environments = [Scripted(turns=5, long=38) for _ in PROMPTS]
    batch, stream, _ = _rollout(_params(), environments)
    assert stream.stats.episodes.truncated > 0
    assert np.asarray(batch.response_mask).any()
    assert int(stream.carry.pages.top) == stream.carry.pages.free.shape[0]


def test_multi_turn_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="sampling.engine = continuous"):
        SamplingParams(engine="static", tool_call_ids=(3,))
    engine = _engine(_params())
    with pytest.raises(ValueError, match="tool_call_ids and the environments"):
        engine.open_stream(MODELS[0][1], version=0, prompt_slots=PROMPT_SLOTS)
    single = _engine(_params(tool_call_ids=()))
    with pytest.raises(ValueError, match="tool_call_ids is empty"):
        single.open_stream(MODELS[0][1], version=0, prompt_slots=PROMPT_SLOTS, turns=_turns())
    stream = engine.open_stream(MODELS[0][1], version=0, prompt_slots=PROMPT_SLOTS, turns=_turns())
    with pytest.raises(ValueError, match="one environment a prompt"):
        stream.submit(None, PROMPTS, jax.random.split(jax.random.key(0), len(PROMPTS)))
    busy = _turns()
    busy.pool.submit(0, Scripted(seconds=1.0), "1 2")  # another stream's step, still running
    with pytest.raises(ValueError, match="still runs 1 steps of another stream"):
        engine.open_stream(MODELS[0][1], version=0, prompt_slots=PROMPT_SLOTS, turns=busy)
    busy.pool.close()


def test_the_oldest_parked_sequence_is_evicted_first_and_its_pages_come_back():
    """Two slots park, then a third: the pages move to parked rows of the table, the slots
    hold none; short of pages, the one parked first goes (its pages back on the stack)."""
    slots, entries, pool = 3, 4, 20
    pages = Pages.empty(slots + entries, 4, pool)
    pages = take_pages(pages, jnp.arange(slots), jnp.asarray([2, 1, 3], jnp.int32))
    parked = Parked.empty(entries)
    rows, written = jnp.asarray([7, 8, 9], jnp.int32), jnp.asarray([5, 3, 9], jnp.int32)
    pages, parked, evicted = park(
        pages, parked, jnp.asarray([False, True, True]), rows, written, jnp.int32(0), jnp.int32(0)
    )
    pages, parked, _ = park(pages, parked, jnp.asarray([True, False, False]), rows, written, jnp.int32(0), jnp.int32(2))
    assert int(evicted) == 0 and np.asarray(pages.owned[:slots]).tolist() == [0, 0, 0]
    assert sorted(np.asarray(parked.row[parked.used]).tolist()) == [7, 8, 9]
    first = np.asarray(oldest_parked(parked, jnp.int32(2)))
    assert sorted(np.asarray(parked.row)[first].tolist()) == [8, 9]  # parked in the first call
    top = int(pages.top)
    pages, parked = evict(pages, parked, jnp.asarray(first))
    assert int(pages.top) == top + 1 + 3 and np.asarray(parked.row[parked.used]).tolist() == [7]


def test_a_lone_trajectorys_tool_time_is_all_blocked_time():
    """One prompt: while its tool sleeps the stream has nothing to decode, so each row's
    blocked seconds are its environment seconds, counted per step (not what the stream
    waited before the step was asked)."""
    environment = Scripted(turns=3, seconds=0.05)
    engine = _engine(_params(slots=1))
    stream = engine.open_stream(MODELS[0][1], version=0, prompt_slots=PROMPT_SLOTS, turns=_turns())
    stream.submit(None, PROMPTS[3:4], jax.random.split(jax.random.key(1), 1), [environment])
    ((_, batch),) = run_stream(stream)
    stream.turns.pool.close()
    assert len(environment.seen) == 3  # three steps of 50 ms
    seconds, blocked = float(batch.environment_seconds[0]), float(batch.environment_blocked_seconds[0])
    assert seconds >= 0.15 and 0.8 * seconds <= blocked <= seconds + 0.01, (seconds, blocked)
