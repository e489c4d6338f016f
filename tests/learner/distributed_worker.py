"""One learner process of the multi-process test (``tests/learner/test_distributed.py``).

    python -m tests.learner.distributed_worker OUT PROCESS_ID NUM_PROCESSES PORT [RUN]

Joins the others through ``jax.distributed`` (CPU collectives over localhost), feeds only
its own rows of the shared test batch, runs two sharded train steps on the global mesh,
writes a checkpoint with every process into the run directory ``RUN`` (default
``OUT/run``; a bucket URL: staged under ``OUT/host-a-*``) and restores it (from a bucket:
staged afresh under ``OUT/host-b-*``, as another host would). Process 0 saves the losses
and the gathered parameters (trained and restored) to ``OUT/result.npz``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import jax
import numpy as np
import optax

from asyncopd_jax.config import DistributedConfig, EstimatorConfig, MeshConfig
from asyncopd_jax.learner import PolicyLoss, create_train_state, distributed, make_mesh, make_train_step
from asyncopd_jax.models import Decoder
from asyncopd_jax.models.lora import LoRAParams
from asyncopd_jax.pipeline.run_outputs import RunDir
from tests.learner.batches import make_learner_batch
from tests.tiny_models import tiny_decoder, tiny_lora_decoder
from tests.waits import WAIT_S

MESH = MeshConfig(data=-1, fsdp=2)
LORA = LoRAParams(rank=3, alpha=5.0, modules_to_save=("embed_tokens", ".*norm"))  # ASYNCOPD_TEST_LORA=1
ESTIMATOR = "reverse_kl_mc"
STEPS = 2


def student() -> Decoder:
    """The tests' tiny student; with ``ASYNCOPD_TEST_LORA=1``, with adapters on it."""
    return tiny_lora_decoder(LORA) if os.environ.get("ASYNCOPD_TEST_LORA") == "1" else tiny_decoder(0, scale=0.7)


def optimizer() -> optax.GradientTransformation:
    return optax.sgd(1.0)  # parameter change = gradient: exact comparisons (Adam's first step is ≈ sign(g))


def main(out: str, process_id: int, num_processes: int, port: int, run_dir: str) -> None:
    distributed.initialize(
        DistributedConfig(
            initialize=True,
            coordinator_address=f"127.0.0.1:{port}",
            num_processes=num_processes,
            process_id=process_id,
            initialization_timeout=WAIT_S,
        )
    )
    assert jax.process_count() == num_processes and jax.device_count() > jax.local_device_count()
    batch = make_learner_batch()
    mesh = make_mesh(MESH)
    graphdef, state = create_train_state(student(), optimizer(), mesh)
    step = make_train_step(
        graphdef, optimizer(), PolicyLoss(EstimatorConfig(ESTIMATOR)), mesh=mesh, state_example=state
    )
    rows = distributed.process_rows(batch.rollout.response_tokens.shape[0])
    local = jax.tree_util.tree_map(lambda x: np.asarray(x)[rows], batch)
    losses = []
    for _ in range(STEPS):
        state, metrics = step(state, distributed.global_batch(local, mesh))
        losses.append(float(metrics["loss"]))

    os.environ["ASYNCOPD_STAGING"] = str(Path(out) / "host-a")
    run = RunDir(run_dir)
    run.save_checkpoint(STEPS, state, {"step": STEPS, "process_count": jax.process_count()})
    run.close()
    os.environ["ASYNCOPD_STAGING"] = str(Path(out) / "host-b")
    restored, meta = RunDir(run_dir).restore_checkpoint(state)
    trained, restored = distributed.gather(state.params), distributed.gather(restored.params)
    if distributed.is_leader():
        leaves = {f"trained/{i}": x for i, x in enumerate(jax.tree_util.tree_leaves(trained))}
        leaves |= {f"restored/{i}": x for i, x in enumerate(jax.tree_util.tree_leaves(restored))}
        np.savez(Path(out) / "result.npz", losses=np.asarray(losses), meta_step=meta["step"], **leaves)
    jax.distributed.shutdown()


if __name__ == "__main__":
    out = sys.argv[1]
    main(out, int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] if len(sys.argv) > 5 else f"{out}/run")
