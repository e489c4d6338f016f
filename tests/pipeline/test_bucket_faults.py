"""A run whose directory is a bucket, through the faults of a network store: a stage
process killed (SIGKILL) while its commit is on the wire, the storage server restarted
mid-run, responses lost after the server applied the write, and two rollout processes
racing for the tickets through a proxy that delays every conditional write.

Each run is checked the same way (:func:`_nothing_lost_or_repeated`): every step in
``metrics.jsonl`` once; no group learned twice (``groups``, the spool indices each step
learned); no group committed twice (the server applied one writer's bytes per record: a
group whose writer died with its commit on the wire is scored again after the resume,
and that second commit is refused); and after a crash, every group committed before it learned after the resume.
CI's e2e step (about 2 min in all).
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable

import pytest

from asyncopd_jax.config import save_config
from asyncopd_jax.pipeline.placements.stage_processes import StageFailed
from asyncopd_jax.pipeline.staleness import PipelineStopped
from asyncopd_jax.pipeline.trainer import Trainer
from asyncopd_jax.storage import Store, open_store, records
from tests.pipeline.test_processes import ROLLOUT, SCORING, _slow
from tests.pipeline.test_trainer import _config, models  # noqa: F401 - fixture
from tests.storage import servers
from tests.storage.fixtures import pointed_at

pytestmark = pytest.mark.e2e

FAST = {"stages.placement": "processes", "train.checkpoint_every": 5}


def _metrics(url: str) -> list[dict]:
    blob = open_store(f"{url}/t").read("metrics.jsonl")
    return [json.loads(line) for line in blob.data.decode().splitlines()]


def _nothing_lost_or_repeated(url: str, steps: int, proxy: servers.Proxy | None = None) -> list[dict]:
    records = _metrics(url)
    assert [r["step"] for r in records] == list(range(1, steps + 1))  # every step once
    learned = [g for r in records for g in r["groups"]]
    twice = [g for g, n in collections.Counter(learned).items() if n > 1]
    assert learned and not twice, f"groups learned twice: {twice}"
    if proxy is not None:  # the server applied one writer's bytes per scored record
        applied: dict[str, set[bytes]] = collections.defaultdict(set)
        for seen in proxy.seen:
            if _scored_commit(seen) and seen.status == 200:
                applied[seen.path].add(seen.body)
        assert applied, "no commit went through the proxy"
        scored_twice = sorted(p for p, b in applied.items() if len(b) > 1)
        assert not scored_twice, f"records committed by two writers: {scored_twice}"
    return records


class _Nth:
    """A proxy match that holds for the ``n``-th request ``pick`` accepts, and no other."""

    def __init__(self, pick: Callable[[servers.Seen], bool], n: int):
        self.pick, self.n, self.count, self.hit = pick, n, 0, threading.Event()

    def __call__(self, seen: servers.Seen) -> bool:
        if not self.pick(seen):
            return False
        self.count += 1
        if self.count == self.n:
            self.hit.set()
            return True
        return False


def _after_the_learner_died(url: str, stages: set[int]) -> Store:
    """Once the learner is killed: its stage processes exit by themselves (within 30 s), and
    the upload the proxy held lands after its writer died; the run's bucket."""
    from tests.scenarios.test_kill_resume import _alive

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(p) for p in stages):
        time.sleep(0.1)
    assert stages and not any(_alive(p) for p in stages), "stage processes outlived their learner"
    time.sleep(5.0)  # the held upload lands after its writer died
    return open_store(f"{url}/t")


def _scored_commit(seen: servers.Seen) -> bool:
    return seen.method == "PUT" and "/exchange/scored/" in seen.path and "if-none-match" in seen.headers


@pytest.mark.parametrize("role,stages", [ROLLOUT, _slow(SCORING)])
def test_a_stage_killed_while_its_commit_is_on_the_wire_loses_nothing(models, tmp_path, s3_server, role, stages):  # noqa: F811
    """The 8th commit of a scored record is held 2 s in the proxy (the learner has
    checkpointed step 5 by then and cannot reach step 10); the stage that sent it is
    killed meanwhile, and the proxy then delivers it: a record committed by a dead
    writer, whose claim nobody renews. The run stops naming the stage; resumed on another
    host (nothing staged), every record committed before the kill is learned once."""
    proxy = servers.Proxy(s3_server.port)
    held = _Nth(_scored_commit, 8)
    proxy.delay(held, 2.0)
    with pointed_at("s3", proxy.endpoint) as url:
        sets = {**FAST, "output_dir": url, "schedule.mode": "fully_async", "schedule.max_staleness": 2, **stages}
        cfg = _config(models, tmp_path, **{**sets, "train.steps": 16})
        trainer = Trainer(cfg, progress=False)
        killed: dict[str, float] = {}

        def kill_on_hold() -> None:
            if held.hit.wait(300):
                time.sleep(0.3)  # the request is in the proxy, not yet at the server
                os.kill(trainer.stages.pids[role], signal.SIGKILL)
                killed["at"] = time.monotonic()

        threading.Thread(target=kill_on_hold, daemon=True).start()
        with pytest.raises(PipelineStopped) as info:
            trainer.run()
        assert "at" in killed, f"{role} was never killed"
        cause = info.value.__cause__
        assert isinstance(cause, StageFailed) and role in str(cause) and "SIGKILL" in str(cause)
        time.sleep(2.0)  # the held commit reaches the bucket after its writer died
        scored = open_store(f"{url}/t/exchange/scored")
        before = {k for k in scored.list("") if k.endswith(".npz")}
        assert before, "nothing was committed before the kill"

        shutil.rmtree(trainer.run_dir.path)  # another host resumes it
        resumed = Trainer(cfg, resume=True, progress=False)
        resumed.run()
        records = _nothing_lost_or_repeated(url, 16, proxy)
        learned = {g for r in records for g in r["groups"]}
        committed = {int(k.removesuffix(".npz")) for k in before}
        assert not committed & {int(k.removesuffix(".npz")) for k in scored.list("") if k.endswith(".npz")}
        assert committed <= learned | set(range(min(committed))), "a record committed before the kill was never learned"


def test_the_storage_server_restarted_mid_run_is_waited_out(models, tmp_path):  # noqa: F811
    """fake-gcs-server keeping its objects on disk, stopped for 3 s after the 4th commit
    and started again: the clients' retries carry every stage and the learner across, and
    the run ends with nothing lost or repeated."""
    server = servers.start_gcs(root=tmp_path / "gcs-data")
    try:
        with pointed_at("gcs", server.endpoint) as url:
            scored = open_store(f"{url}/t/exchange/scored", check=False)
            restarted = threading.Event()

            def restart_after_commits() -> None:
                deadline = time.monotonic() + 300
                while time.monotonic() < deadline:
                    try:
                        if len(scored.list("")) >= 4:
                            break
                    except Exception:  # noqa: BLE001 - the bucket may not be there yet
                        pass
                    time.sleep(0.1)
                server.stop()
                time.sleep(3.0)
                server.start()
                restarted.set()

            threading.Thread(target=restart_after_commits, daemon=True).start()
            cfg = _config(models, tmp_path, **{**FAST, "output_dir": url, "train.steps": 12})
            Trainer(cfg, progress=False).run()
            assert restarted.is_set(), "the run ended before the server was restarted"
            _nothing_lost_or_repeated(url, 12)
    finally:
        server.stop()


def test_lost_answers_and_racing_claimants_in_a_run(models, tmp_path, s3_server):  # noqa: F811
    """Two rollout processes claim tickets from one exchange through a proxy that holds
    every conditional write 0.1 s (a check-then-write claimant would take a ticket twice)
    and loses the answers to two claims, two commits, a lease renewal and a deletion after
    the server applied them: each retried write is recognised as its own, no ticket is
    sampled twice, no group learned twice."""
    proxy = servers.Proxy(s3_server.port)
    conditional = lambda s: s.method == "PUT" and ("if-none-match" in s.headers or "if-match" in s.headers)  # noqa: E731
    proxy.delay(conditional, 0.1)
    claim = lambda s: s.method == "PUT" and "/exchange/tickets/claims/" in s.path and "if-none-match" in s.headers  # noqa: E731
    always = [  # each of these happens in every run
        _Nth(claim, 3),
        _Nth(claim, 7),
        _Nth(_scored_commit, 2),
        _Nth(_scored_commit, 5),
        _Nth(lambda s: s.method == "DELETE" and "/exchange/scored/" in s.path, 3),
    ]
    # a lease renewal (every lease_s / 3 = 10 s): only if the run lasts that long
    renewal = _Nth(lambda s: s.method == "PUT" and "/claims/" in s.path and "if-match" in s.headers, 1)
    for match in (*always, renewal):
        proxy.lose(match)
    with pointed_at("s3", proxy.endpoint) as url:
        sets = {**FAST, "output_dir": url, "stages.rollouts": 2, "train.steps": 12}
        cfg = _config(models, tmp_path, **sets)
        summary = Trainer(cfg, progress=False).run()
        records = _nothing_lost_or_repeated(url, 12, proxy)
    # Every ticket was sampled in its turn: a claim whose answer was lost and not recognised
    # as ours would sit unworked until its lease ran out (30 s), leaving a gap here that no
    # group dropped as stale explains.
    learned = sorted(g for r in records for g in r["groups"])
    gaps = learned[-1] - learned[0] + 1 - len(learned)
    assert gaps <= summary["dropped_stale"] // cfg.group_size, (learned, summary["dropped_stale"])
    assert all(m.hit.is_set() for m in always), [m.count for m in always]
    assert proxy.lost == len(always) + renewal.hit.is_set()
    print(f"lost answers: {proxy.lost} (a renewal among them: {renewal.hit.is_set()})")


def test_the_learner_killed_mid_checkpoint_upload_resumes_from_the_last_committed_one(models, tmp_path, s3_server):  # noqa: E501, F811
    """``asyncopd train`` (stages in processes) SIGKILLed while the first file of its step-8
    checkpoint is held in the proxy: the bucket has checkpoint 4 committed and checkpoint 8
    partial, without its commit record. Its stage processes exit by themselves; resumed with
    ``--resume s3://…`` on another host (a fresh staging directory), the run continues from
    step 4 and ends with every step once and no group learned twice."""
    from tests.pipeline.test_processes import _children
    from tests.scenarios.test_kill_resume import _cli

    proxy = servers.Proxy(s3_server.port)
    held = _Nth(lambda s: s.method == "PUT" and "/t/checkpoints/8/" in s.path, 1)
    proxy.delay(held, 5.0)
    with pointed_at("s3", proxy.endpoint) as url:
        sets = {**FAST, "output_dir": url, "train.steps": 12, "train.checkpoint_every": 4}
        config_file = tmp_path / "config.yaml"
        save_config(_config(models, tmp_path, **sets), config_file)
        os.environ["ASYNCOPD_STAGING"] = str(tmp_path / "host-a")
        try:
            learner = _cli("--config", str(config_file))
        finally:
            del os.environ["ASYNCOPD_STAGING"]
        stages: set[int] = set()
        try:
            while not held.hit.is_set() and learner.poll() is None:
                stages |= _children(learner.pid)
                time.sleep(0.05)
            assert held.hit.is_set(), learner.stdout.read().decode(errors="replace")[-3000:]
            os.kill(learner.pid, signal.SIGKILL)
            learner.wait(30)
        finally:
            if learner.poll() is None:
                os.killpg(learner.pid, signal.SIGKILL)
        bucket = _after_the_learner_died(url, stages)
        assert "checkpoints/4.commit" in bucket.list("checkpoints/")
        assert "checkpoints/8.commit" not in bucket.list("checkpoints/")
        assert any(k.startswith("checkpoints/8/") for k in bucket.list("checkpoints/"))  # partial

        os.environ["ASYNCOPD_STAGING"] = str(tmp_path / "host-b")
        try:
            resumed = _cli("--resume", f"{url}/t")
        finally:
            del os.environ["ASYNCOPD_STAGING"]
        output = resumed.communicate(timeout=240)[0].decode(errors="replace")
        assert resumed.returncode == 0, output[-3000:]
        _nothing_lost_or_repeated(url, 12, proxy)
        assert "checkpoints/12.commit" in bucket.list("checkpoints/")


def test_a_learner_over_two_processes_killed_mid_checkpoint_resumes_on_other_hosts(models, tmp_path, s3_server):  # noqa: F811
    """A learner over two ``jax.distributed`` processes (stand-in hosts: a staging directory
    each) with its run in the bucket and a rollout stage process. Process 1 is SIGKILLed
    while its part of checkpoint 8 is held in the proxy; process 0 stops by itself when the
    peer's heartbeat is missed (``distributed.heartbeat_timeout``), and its stage with it.
    Both processes resume with ``--resume s3://…`` on two fresh hosts: each downloads its
    own part of checkpoint 4, and the run ends with every step once, no group learned
    twice, each checkpoint in two parts committed by process 0. CI's e2e step, ~1 min."""
    from tests.pipeline.test_multi_process_learner import learner_processes, learners_finish
    from tests.pipeline.test_processes import _children

    proxy = servers.Proxy(s3_server.port)
    held = _Nth(lambda s: s.method == "PUT" and "/t/checkpoints/8/p1/" in s.path, 1)
    proxy.delay(held, 5.0)
    with pointed_at("s3", proxy.endpoint) as url:
        sets = {
            **FAST,
            "output_dir": url,
            "train.steps": 12,
            "train.checkpoint_every": 4,
            "schedule.mode": "fully_async",
            "schedule.max_staleness": 2,
            # parameters sharded over both processes' devices: no process holds them whole
            "learner.mesh": "{data: 1, fsdp: -1}",
            "distributed.heartbeat_timeout": 10,
        }
        config_file = tmp_path / "config.yaml"
        save_config(_config(models, tmp_path, **sets), config_file)
        procs = learner_processes(
            ["--config", str(config_file)], staging=[tmp_path / "host-a", tmp_path / "host-b"], start_new_session=True
        )
        stages: set[int] = set()
        try:
            deadline = time.monotonic() + 240
            while not held.hit.is_set() and all(p.poll() is None for p in procs) and time.monotonic() < deadline:
                stages |= _children(procs[0].pid)
                time.sleep(0.05)
            assert held.hit.is_set(), [p.stdout.read().decode(errors="replace")[-3000:] for p in procs]
            os.kill(procs[1].pid, signal.SIGKILL)
            procs[1].wait(30)
            start = time.monotonic()
            # process 0, waiting for the lost peer's part, stops by itself once the peer's
            # heartbeat is missed (10 s here; 100 s by default would fail this wait)
            procs[0].wait(45)
            print(f"process 0 ended {time.monotonic() - start:.1f} s after its peer with {procs[0].returncode}")
            assert procs[0].returncode != 0
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
        bucket = _after_the_learner_died(url, stages)
        keys = bucket.list("checkpoints/")
        assert "checkpoints/4.commit" in keys and "checkpoints/8.commit" not in keys, keys
        assert {k.split("/")[2] for k in keys if k.startswith("checkpoints/4/")} == {"p0", "p1"}

        resumed = learner_processes(["--resume", f"{url}/t"], staging=[tmp_path / "host-c", tmp_path / "host-d"])
        learners_finish(resumed, timeout=300)
        _nothing_lost_or_repeated(url, 12, proxy)
        keys = bucket.list("checkpoints/")
        assert records.parse(bucket.read("checkpoints/12.commit"))["processes"] == 2
        assert {k.split("/")[2] for k in keys if k.startswith("checkpoints/12/")} == {"p0", "p1"}
