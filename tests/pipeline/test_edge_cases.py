"""The pipeline's core modules at their edges: what ``asyncopd train`` prints of a layout, a
snapshot reader that can never pin a version, a wait on a store nothing was published to,
what a finished group records.

Written for mutants of ``asyncopd_jax/pipeline/{placement,snapshots,producer}.py`` that
survived the sampled mutation run of 2026-11-26 (docs/log/mutation-history.md, "Sampled scores of the
newer areas (2026-11-26)").
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from asyncopd_jax.cache import RolloutBatch
from asyncopd_jax.pipeline.layout import Layout, SnapshotChannel, StagePlan, describe
from asyncopd_jax.pipeline.producer import GroupProducer
from asyncopd_jax.pipeline.reward_stage import RewardStage
from asyncopd_jax.pipeline.snapshots import DiskSnapshotStore, InMemorySnapshotStore
from asyncopd_jax.pipeline.trace import Tracer


def test_describe_names_each_stages_process_devices_and_cores():
    """Bug guarded: the line ``asyncopd train`` prints per stage saying something else than
    where the stage runs (an unpinned stage's cores printed as anything but ``any``, a
    stage on the default devices as anything but ``default``)."""
    layout = Layout(
        placement="processes",
        stages=(
            StagePlan("learner", 0, "learner", (0, 1), (0, 1)),
            StagePlan("rollout", 0, "rollout-0", (2,), ()),
            StagePlan("rollout", 1, "rollout-1", (), (3,)),
        ),
        snapshots=SnapshotChannel(in_memory=False, directory="/s", format="safetensors", keep=3, temporary=False),
        group_size=4,
        seed=0,
        trace_origin=0.0,
    )
    assert describe(layout) == [
        "  learner-0: process learner, devices 0,1, cores 0,1",
        "  rollout-0: process rollout-0, devices 2, cores any",
        "  rollout-1: process rollout-1, devices default, cores 3",
    ]


def test_a_reader_that_can_never_pin_a_listed_version_gives_up_with_a_reason(tmp_path, monkeypatch):
    """Bug guarded: the errors of a reader whose versions are retired between listing and
    pinning losing their message (``LookupError(None)``): version 3 is listed but never on
    disk, so every one of the 100 attempts finds it gone."""
    store = DiskSnapshotStore(tmp_path, {"w": jnp.zeros(3)}, read_only=True, format="safetensors")
    monkeypatch.setattr(store, "committed_versions", lambda: [3])
    with pytest.raises(LookupError, match=r"^could not pin a snapshot under .*: versions retired faster than read$"):
        store.load()
    with pytest.raises(LookupError, match=r"^snapshot 3 was removed while it was being opened$"):
        store.load(3)


def test_waiting_on_a_store_nothing_was_published_to_times_out_naming_the_version():
    """Bug guarded: the wait's condition failing on an empty store (``max(…, default=None)
    >= version`` raises a TypeError) instead of waiting until the timeout and saying which
    version never came."""
    store = InMemorySnapshotStore()
    with pytest.raises(TimeoutError, match=r"^policy snapshot 0 was not published within 0.05 s \(newest: None\)"):
        store.wait_for(0, timeout=0.05)


def _batch(versions: list[list[int]], mask: list[list[bool]]) -> RolloutBatch:
    versions_, mask_ = np.asarray(versions, np.int32), np.asarray(mask, bool)
    return RolloutBatch(
        prompt_tokens=np.ones((len(versions), 2), np.int32),
        prompt_mask=np.ones((len(versions), 2), bool),
        response_tokens=np.ones_like(versions_),
        response_mask=mask_,
        behavior_logp=np.zeros(versions_.shape, np.float32),
        token_version=versions_,
    )


def test_a_finished_group_spans_the_versions_of_its_answer_tokens_and_traces_its_reward():
    """Bug guarded: ``GroupProducer.finish`` recording another version span than that of
    the tokens in the answers (padding's versions counted, the start version lost when no
    token was sampled) or its reward under another span name than ``reward``, the name the
    run's trace and its summary's ``stage_seconds`` show."""
    tracer = Tracer()
    producer = GroupProducer(
        sampler=None,
        snapshots=None,
        prompts=None,
        reward=RewardStage(lambda problems, batch: [float(p) for p in problems]),
        group_size=2,
        seed=0,
        prompt_slots=2,
        tracer=tracer,
    )
    group = producer.finish(_batch([[3, 4, 9], [5, 5, 0]], [[True, True, False], [True, True, False]]), [1, 0], 3, None)
    assert (group.oldest_version, group.newest_version, group.cache) == (3, 5, None)
    np.testing.assert_array_equal(group.rewards, np.asarray([1.0, 0.0], np.float32))
    empty = producer.finish(_batch([[9, 9]], [[False, False]]), [0], 7, None)
    assert (empty.oldest_version, empty.newest_version) == (7, 7)
    assert set(tracer.totals()) == {"reward"} and len(tracer.events()) == 2


@pytest.mark.parametrize("stopped", [True, False])
def test_a_stage_process_whose_run_stopped_under_it_exits_cleanly(tmp_path, monkeypatch, stopped):
    """A stage started by hand outlives the learner's join: once the run has stopped (STOP
    written), the learner removes the snapshot directory under it. An error then is the end
    of the run, exit 0; the same error while the run goes on is a failure, exit 1."""
    from asyncopd_jax.pipeline import stage_main
    from asyncopd_jax.pipeline.exchange import Exchange

    def read(self):
        if stopped:
            self.stop()
        raise FileNotFoundError("the snapshot directory was removed while the run was using it")

    monkeypatch.setattr(Exchange, "read", read)
    assert stage_main.run_stage(tmp_path, "rollout", 0) == (0 if stopped else 1)


def test_a_rollout_pools_join_waits_its_timeout_for_all_threads_together():
    """``join(timeout)`` bounds the whole wait, not each thread's: three threads that never
    end are given up on after ~0.3 s, not 0.9 s."""
    import threading
    import time

    from asyncopd_jax.pipeline.placements.threads import RolloutPool
    from asyncopd_jax.pipeline.staleness import StalenessBuffer

    pool = RolloutPool(stages=[], buffer=StalenessBuffer(batch_size=4, eta=0))
    stop = threading.Event()
    pool._threads = [threading.Thread(target=stop.wait, daemon=True) for _ in range(3)]
    pool.start()
    start = time.monotonic()
    pool.join(timeout=0.3)
    took = time.monotonic() - start
    stop.set()
    assert 0.25 < took < 0.6, took
