"""The learner over two processes (JAX's distributed runtime, CPU collectives on
localhost) equals the same sharded learner in one process: the same losses and
parameters after two steps, and an Orbax checkpoint written and restored by both."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from asyncopd_jax.config import ConfigError, EstimatorConfig, load_config
from asyncopd_jax.learner import PolicyLoss, create_train_state, distributed, make_mesh, make_train_step
from asyncopd_jax.pipeline.run_outputs import RunDir
from asyncopd_jax.storage import location, open_store, records
from tests.learner import distributed_worker as worker
from tests.learner.batches import make_learner_batch
from tests.storage.fixtures import pointed_at
from tests.waits import communicate_all
from tests.xla_flags import host_devices

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_process_reference():
    """The same two steps on one process whose mesh has the same shape (2 × 2 devices)."""
    batch = make_learner_batch()
    mesh = make_mesh(worker.MESH, devices=jax.devices()[:4])
    graphdef, state = create_train_state(worker.student(), worker.optimizer(), mesh)
    step = make_train_step(
        graphdef, worker.optimizer(), PolicyLoss(EstimatorConfig(worker.ESTIMATOR)), mesh=mesh, state_example=state
    )
    losses = []
    for _ in range(worker.STEPS):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.asarray(losses), jax.tree_util.tree_leaves(jax.device_get(state.params))


def _run_workers(tmp_path: Path, *run_dir: str) -> None:
    """The two learner processes of :mod:`tests.learner.distributed_worker`, to the end."""
    port = _free_port()
    env = {
        **os.environ,  # ASYNCOPD_TEST_LORA included
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": host_devices(2),
        "PYTHONPATH": str(ROOT),
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.learner.distributed_worker", str(tmp_path), str(i), "2", str(port), *run_dir],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    outputs = communicate_all(procs, timeout=240)  # a peer that fails ends the other at once
    assert all(p.returncode == 0 for p in procs), "\n".join(
        f"learner process {i} exited with {p.returncode}:\n{text[-4000:]}"
        for i, (p, text) in enumerate(zip(procs, outputs))
        if p.returncode != 0
    )


def _check_result(tmp_path: Path) -> None:
    result = np.load(tmp_path / "result.npz")
    losses, params = _one_process_reference()
    np.testing.assert_allclose(result["losses"], losses, rtol=1e-5)
    assert losses[1] < losses[0]  # the steps did something that could differ
    assert len(params) == sum(k.startswith("trained/") for k in result.files)
    for i, leaf in enumerate(params):
        np.testing.assert_allclose(result[f"trained/{i}"], leaf, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(result[f"restored/{i}"], result[f"trained/{i}"])
    assert int(result["meta_step"]) == worker.STEPS


@pytest.mark.e2e  # two learner processes: the end-to-end step (-m e2e)
def test_two_learner_processes_equal_one(tmp_path):
    _run_workers(tmp_path)
    _check_result(tmp_path)


@pytest.mark.e2e
def test_two_learner_processes_train_a_lora_student_as_one(tmp_path, monkeypatch):
    """The adapters and the modules trained whole beside them (the embedding, the norms),
    and only they (the frozen base is compared too), trained over two processes, the
    adapters sharded as their base kernels, equal one process's; the checkpoint of a LoRA
    train state round-trips."""
    monkeypatch.setenv("ASYNCOPD_TEST_LORA", "1")  # read by the workers and by the reference
    _run_workers(tmp_path)
    _check_result(tmp_path)


@pytest.mark.e2e
@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_two_learner_processes_checkpoint_to_a_bucket_each_its_own_part(tmp_path, kind, request):
    """The run directory in a bucket (moto, fake-gcs-server): each process stages its checkpoint in a
    directory of its own, uploads its part, and restores from a fresh staging copy (another
    host) what it wrote; process 0 commits once both parts are in. A learner over another
    number of processes is refused the checkpoint in one line."""
    server = request.getfixturevalue(f"{kind}_server")
    with pointed_at(kind, server.endpoint) as url:
        _run_workers(tmp_path, f"{url}/t")
        _check_result(tmp_path)
        bucket = open_store(f"{url}/t")
        keys = bucket.list("checkpoints/")
        parts = {k.split("/")[2] for k in keys if k.count("/") > 2}
        assert parts == {"p0", "p1"}, keys
        assert records.parse(bucket.read(f"checkpoints/{worker.STEPS}.commit"))["processes"] == 2
        assert sorted(p.name for p in tmp_path.glob("host-b/*")) == [
            f"{location.local_name(f'{url}/t')}-p{i}" for i in range(2)
        ]
        with pytest.raises(ValueError, match=r"written by a learner over 2 process\(es\); this one has 1: resume"):
            RunDir(f"{url}/t").restore_checkpoint(None)


def test_each_process_feeds_its_own_contiguous_rows():
    assert [distributed.process_rows(8, p, 2) for p in range(2)] == [slice(0, 4), slice(4, 8)]
    assert distributed.process_rows(6, 2, 3) == slice(4, 6)
    with pytest.raises(ValueError, match="does not split evenly over 3 learner processes"):
        distributed.process_rows(8, 0, 3)


def test_global_batch_in_one_process_is_the_batch_sharded():
    mesh = make_mesh(worker.MESH, devices=jax.devices()[:4])
    x = np.arange(8 * 3).reshape(8, 3)
    out = distributed.global_batch({"x": x, "n": np.asarray(5)}, mesh)
    np.testing.assert_array_equal(out["x"], x)
    assert out["x"].sharding.spec == jax.sharding.PartitionSpec(("data", "fsdp"))
    assert len(out["x"].addressable_shards) == 4 and int(out["n"]) == 5


def test_distributed_config_is_validated():
    with pytest.raises(ConfigError, match="distributed.process_id = 2 is invalid"):
        load_config(None, ["distributed.num_processes=2", "distributed.process_id=2"])
    with pytest.raises(ConfigError, match="distributed.num_processes = -1 is invalid"):
        load_config(None, ["distributed.num_processes=-1"])
    assert load_config(None, ["distributed.initialize=true"]).distributed.process_id == -1
