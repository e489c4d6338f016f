"""``stages.start_processes: false``: the learner starts no stage process and waits for the
ones started by hand, saying once a minute what it waits for, and stops in one line when
none commits a group within ``stages.startup_timeout``."""

from __future__ import annotations

import re
import time

import pytest

from asyncopd_jax.config import load_config
from asyncopd_jax.configs import DEMO
from asyncopd_jax.pipeline.exchange import Exchange
from asyncopd_jax.pipeline.layout import plan_layout
from asyncopd_jax.pipeline.placements import stage_processes
from asyncopd_jax.pipeline.placements.stage_processes import StageFailed, StageProcesses
from asyncopd_jax.pipeline.staleness import PipelineStopped, RolloutGroup, StalenessBuffer
from asyncopd_jax.pipeline.trace import Tracer


def _hand_started(tmp_path, timeout_s: float) -> StageProcesses:
    sets = [
        "stages.placement=processes",
        "stages.start_processes=false",
        "stages.rollouts=2",
        "stages.scoring_processes=1",
        f"stages.startup_timeout={timeout_s}",
        f"output_dir={tmp_path}",
    ]
    cfg = load_config(DEMO, sets)
    tracer = Tracer()
    layout = plan_layout(cfg, run_path=tmp_path, available_cores=[], trace_origin=tracer.origin)
    buffer = StalenessBuffer(cfg.learner.batch_size, cfg.eta)
    return StageProcesses(
        cfg=cfg, layout=layout, exchange=Exchange(tmp_path / "exchange"), buffer=buffer, first_index=0, tracer=tracer
    )


def test_the_learner_says_what_it_waits_for_then_stops_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(stage_processes, "WAITING_REPORT_S", 0.3)
    stages = _hand_started(tmp_path, timeout_s=2.0)
    assert stages.pids == {}  # nothing started here
    stages.exchange.store.write("trace/rollout-1.json", b"{}")  # rollout-1 has started, by hand
    begun = time.monotonic()
    stages.start()
    try:
        with pytest.raises(PipelineStopped) as stopped:
            stages.take(0)
    finally:
        stages.join(timeout=5)
    assert 2.0 <= time.monotonic() - begun < 10.0
    assert isinstance(stopped.value.__cause__, StageFailed)
    message = str(stopped.value.__cause__)
    assert "\n" not in message
    assert message.startswith("no rollout group arrived within stages.startup_timeout = 2 s"), message
    assert "none has started yet for rollout-0, scoring-0 (on its host: asyncopd stage ROLE --exchange" in message
    reports = [line for line in capsys.readouterr().err.splitlines() if line.startswith("asyncopd: waiting")]
    assert 2 <= len(reports) <= 8, reports  # once per (shortened) minute, not per poll
    assert all(re.search(r"waiting \d+ s for the stage processes started by hand", r) for r in reports)
    assert all(stages.exchange.url in r and "rollout-1" not in r.split("none has")[1] for r in reports)


def test_a_group_arriving_ends_the_wait(tmp_path, capsys, monkeypatch):
    """Once a group is committed the learner no longer reports or times out."""
    monkeypatch.setattr(stage_processes, "WAITING_REPORT_S", 0.2)
    stages = _hand_started(tmp_path, timeout_s=1.0)
    stages._first_group.set()  # what the collector does on the first scored group
    stages.start()
    time.sleep(1.5)
    try:
        assert stages.buffer._error is None
    finally:
        stages.join(timeout=5)
    assert "asyncopd: waiting" not in capsys.readouterr().err


def _scored_group(rows: int) -> RolloutGroup:
    """A scored group of ``rows`` answers (its values do not matter here)."""
    import numpy as np

    from asyncopd_jax.cache import RolloutBatch, TeacherScoreCache

    mask = np.ones((rows, 3), bool)
    batch = RolloutBatch(
        prompt_tokens=np.ones((rows, 2), np.int32),
        prompt_mask=np.ones((rows, 2), bool),
        response_tokens=np.ones((rows, 3), np.int32),
        response_mask=mask,
        behavior_logp=np.zeros((rows, 3), np.float32),
        token_version=np.zeros((rows, 3), np.int32),
    )
    cache = TeacherScoreCache(
        token_logp=np.zeros((rows, 3), np.float32),
        topk_ids=np.zeros((rows, 3, 2), np.int32),
        topk_logp=np.zeros((rows, 3, 2), np.float32),
    )
    return RolloutGroup(batch, cache, 0, 0)


def test_a_group_committed_under_a_tickets_name_reaches_the_learner_and_no_other(tmp_path):
    """A hand-started rollout process commits each group under its ticket's name (the first
    ticket: group 1): the learner takes that group; a record under a name no ticket of this
    run issued (a stray file, an earlier run's) is left alone."""
    from asyncopd_jax.pipeline.spool import group_to_record

    stages = _hand_started(tmp_path, timeout_s=30.0)
    group_rows = stages.group_size
    stages.buffer = StalenessBuffer(group_rows, 0)  # one group a batch
    stages.start()
    try:
        deadline = time.monotonic() + 10
        while not stages.exchange.tickets.names():
            assert time.monotonic() < deadline, "no ticket was issued"
            time.sleep(0.01)
        ticket = stages.exchange.tickets.names()[0]
        assert ticket == "0000000001"  # groups numbered from 1: the index picks the group's prompts
        stages.exchange.scored.put("0000099999", group_to_record(_scored_group(group_rows), 99999))
        stages.exchange.scored.put(ticket, group_to_record(_scored_group(group_rows), int(ticket)))
        taken = stages.buffer.take(0, timeout=10)  # what stages.take(0) does, bounded
        assert [g.record for g in taken] == [ticket]
        stages.buffer.finish_batch()  # the learner trained on it: room for the next group, ticket 2
        while len(stages.exchange.tickets.names()) < 2:
            assert time.monotonic() < deadline + 10, f"one ticket after the first: {stages.exchange.tickets.names()}"
            time.sleep(0.01)
        assert stages.exchange.tickets.names() == ["0000000001", "0000000002"]
    finally:
        stages.join(timeout=5)


@pytest.mark.parametrize(("unlearned", "kept"), [([4], [4, 7]), (None, [2, 3, 4, 7])])
def test_a_resumed_learner_takes_only_the_committed_groups_its_checkpoint_had_not_learned(tmp_path, unlearned, kept):
    """Groups an earlier incarnation left committed: those started after the checkpoint
    (7 > 5) and those it had started but not learned (4) are admitted; the others (2, 3),
    learned before the checkpoint and left by a crash before their deletion or committed
    again by a stage whose claim was taken over, are deleted, not learned twice. A
    checkpoint that does not say (None) keeps them all, as before."""
    import numpy as np

    exchange = Exchange(tmp_path / "exchange")
    for n, spool in ((2, exchange.sampled), (3, exchange.scored), (4, exchange.scored), (7, exchange.sampled)):
        spool.put(f"{n:010d}", {"index": np.asarray(n)})
    cfg = load_config(DEMO, ["stages.placement=processes", "stages.start_processes=false", f"output_dir={tmp_path}"])
    layout = plan_layout(cfg, run_path=tmp_path, available_cores=[])
    stages = StageProcesses(
        cfg=cfg,
        layout=layout,
        exchange=exchange,
        buffer=StalenessBuffer(cfg.learner.batch_size, cfg.eta),
        first_index=5,
        tracer=Tracer(),
        unlearned=unlearned,
    )
    assert stages._leftovers == kept
    left = sorted(int(n) for spool in (exchange.sampled, exchange.scored) for n in spool.names())
    assert left == kept
    stages._admitted.update(kept)  # what its dispatcher admits first
    stages._consumed.append(f"{kept[0]:010d}")
    assert stages.unlearned() == kept[1:]  # what its next checkpoint records
