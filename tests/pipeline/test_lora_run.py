"""A LoRA student through whole runs, in each placement (issue 58): the sampler decodes with
the adapters the learner trains, the base never moves, a run resumes with its adapters
and their moments, and the student is written merged."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import jax
import numpy as np
import pytest
from flax import nnx

from asyncopd_jax.learner import make_optimizer
from asyncopd_jax.models import from_pretrained
from asyncopd_jax.models.lora import adapters, split_adapters
from asyncopd_jax.pipeline.adapter_snapshots import MergedAtSwap
from asyncopd_jax.pipeline.snapshots import as_published
from asyncopd_jax.pipeline.trainer import Trainer
from asyncopd_jax.storage import open_store
from tests.learner.test_lora_step import first_updates
from tests.pipeline.test_bucket_faults import _Nth
from tests.pipeline.test_trainer import _config, models  # noqa: F401 - fixture
from tests.storage import servers
from tests.storage.fixtures import pointed_at

pytestmark = pytest.mark.e2e  # whole runs: the end-to-end step (-m e2e)

LORA = {
    "student.lora.rank": 2,
    "student.lora.alpha": 7,
    "student.lora.targets": "[q_proj, v_proj, down_proj]",
    "optim.learning_rate": 0.05,
}
PLACEMENTS = {"threads": {}, "processes": {"stages.placement": "processes"}}


def _leaves(state) -> dict[str, np.ndarray]:
    return {".".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(state)}


@pytest.mark.parametrize("sampler", ["merged", "unmerged"])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_the_sampler_decodes_with_the_adapters_the_learner_trains(models, tmp_path, placement, sampler):  # noqa: F811
    """Synchronous, one mini-batch a batch: every step trains on answers of the weights it
    starts from, so the importance ratio is 1 on every token, once the adapters and the
    modules trained whole (the tied embedding, the final norm) have moved too (a sampler
    without either would be off from step 2), whether it merges the adapters into its
    weights at each swap or decodes them unmerged; each version ships those alone."""
    sets = {"schedule.mode": "sync", "train.steps": 6, **LORA, "student.lora.sampler": sampler}
    sets["student.lora.modules_to_save"] = "[embed_tokens, norm]"
    cfg = _config(models, tmp_path, **{**sets, **PLACEMENTS[placement]})
    trainer = Trainer(cfg, progress=False)
    if placement == "threads":  # (a stage process builds its view with the same sampler_view)
        assert isinstance(trainer.process.rollouts[0].producer.snapshots, MergedAtSwap) == (sampler == "merged")
    _, start = nnx.split(nnx.merge(trainer.learner.graphdef, jax.device_get(trainer.learner.state.params)))
    trainer.run()
    final = jax.device_get(trainer.learner.state.params)
    before, after = _leaves(start), _leaves(final)
    trained = {k for k in before if k.endswith(("lora_a", "lora_b"))} | {"embed_tokens.embedding", "norm.weight"}
    assert len(trained) == 14  # 3 projections × 2 layers × (A, B), the embedding, the final norm
    assert all(np.abs(after[k] - before[k]).max() > 1e-3 for k in trained)
    assert all(np.array_equal(after[k], before[k]) for k in before.keys() - trained)  # the base is frozen
    records = [json.loads(line) for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    assert [r["staleness_max"] for r in records] == [0] * 6
    for r in records:
        assert abs(r["importance_ratio_max"] - 1) < 2e-3 and abs(r["importance_ratio_mean"] - 1) < 2e-4, r["step"]
    # each version shipped its adapters alone (stored: with a header, as a sparse delta
    # where that is smaller), the base once
    adapter_bytes, base_bytes = (
        sum(x.nbytes for x in jax.tree_util.tree_leaves(as_published(part, cfg.published_dtype)))
        for part in split_adapters(final)
    )
    for r in records[1:]:
        full = r.get("snapshot_full", 1)
        assert adapter_bytes * full <= r["snapshot_bytes"] < adapter_bytes + 2048, (r["step"], r["snapshot_bytes"])
        assert base_bytes <= r["snapshot_base_bytes"] < base_bytes + 4096, (r["step"], r["snapshot_base_bytes"])
    # the adapters alone in PEFT's layout (tests/models/test_lora_checkpoint.py loads them with peft)
    adapter = json.loads((tmp_path / "t" / "adapter" / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"], adapter["target_modules"]) == (2, 7, ["down_proj", "q_proj", "v_proj"])
    assert adapter["modules_to_save"] == ["model.embed_tokens", "model.norm"] and adapter["ensure_weight_tying"]
    assert adapter["base_model_name_or_path"] == str(models / "student")
    # written merged, in the Hugging Face layout
    written = from_pretrained(tmp_path / "t" / "student")
    assert not adapters(written)
    tokens = np.asarray([[5, 9, 3, 17, 22, 4]])
    want = nnx.merge(trainer.learner.graphdef, final)(tokens)
    np.testing.assert_allclose(np.asarray(written(tokens)), np.asarray(want), atol=2e-5)


def test_a_bfloat16_base_with_float32_adapters_ships_them_as_bfloat16_to_stage_processes(models, tmp_path):  # noqa: F811
    """``student.dtype: bfloat16``: the frozen base has no fp32 master, the adapters do; the
    samplers receive every weight in the published dtype (bf16), the adapters included, in
    the shapes their readers expect."""
    sets = {"schedule.mode": "sync", "train.steps": 3, **LORA, "student.dtype": "bfloat16"}
    cfg = _config(models, tmp_path, **{**sets, "stages.placement": "processes"})
    trainer = Trainer(cfg, progress=False)
    trained, _ = split_adapters(trainer.learner.state.params)
    assert {x.dtype for x in jax.tree_util.tree_leaves(trained)} == {np.dtype("float32")}
    assert trainer.run()["steps"] == 3
    records = [json.loads(line) for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    bf16 = sum(x.size * 2 for x in jax.tree_util.tree_leaves(trained))
    assert all(r["snapshot_bytes"] < bf16 + 2048 for r in records[1:]), [r["snapshot_bytes"] for r in records]


def test_dropout_acts_in_the_learners_forward_alone(models, tmp_path):  # noqa: F811
    """The same synchronous run with dropout 0.3: the learner's log-probs now differ from the
    sampler's (which decodes without dropout) once B has moved, so the ratio leaves 1."""
    sets = {"schedule.mode": "sync", "train.steps": 3, **LORA, "student.lora.dropout": 0.3}
    Trainer(_config(models, tmp_path, **sets), progress=False).run()
    records = [json.loads(line) for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    assert abs(records[0]["importance_ratio_max"] - 1) < 2e-3  # B = 0 at step 1: dropout changes nothing
    assert all(abs(r["importance_ratio_max"] - 1) > 1e-2 for r in records[1:])


def test_a_lora_run_resumes_with_its_adapters_and_their_moments(models, tmp_path):  # noqa: F811
    sets = {"schedule.mode": "fully_async", "train.steps": 6, **LORA, "student.lora.dropout": 0.1}
    sets["student.lora.modules_to_save"] = "[embed_tokens, '.*norm']"  # restored as WholeParam, with moments
    sets["student.lora.loraplus_lr_ratio"] = 4
    cfg = _config(models, tmp_path, **sets)
    trainer = Trainer(cfg, progress=False)
    # the learner's optimizer is the config's: B's updates at 4× plain LoRA's
    plus = first_updates(trainer.learner.optimizer, cfg.student.lora)
    plain = first_updates(make_optimizer(cfg.optim, cfg.train.steps), cfg.student.lora)
    for name, update in plain.items():
        np.testing.assert_allclose(plus[name], (4 if name.endswith("lora_b") else 1) * update, rtol=1e-6)
    saved = {}
    real_save = trainer.run_dir.save_checkpoint

    def recording_save(step, state, meta):
        saved[step] = jax.device_get(state)
        real_save(step, state, meta)

    trainer.run_dir.save_checkpoint = recording_save
    trainer.run()
    cfg = _config(models, tmp_path, **{**sets, "train.steps": 8})
    resumed = Trainer(cfg, resume=True, progress=False)
    assert resumed.start_step == 6
    restored = jax.device_get(resumed.state)
    for want, got in zip(jax.tree_util.tree_leaves(saved[6]), jax.tree_util.tree_leaves(restored)):
        np.testing.assert_array_equal(got, want)
    trained, _ = split_adapters(restored.params)
    moments = [x for x in jax.tree_util.tree_leaves(restored.opt_state) if np.ndim(x)]
    assert sum(m.size for m in moments) == 2 * sum(x.size for x in jax.tree_util.tree_leaves(trained))
    assert resumed.run()["steps"] == 8


def test_a_sampler_killed_mid_swap_is_restarted_and_never_samples_half_an_adapter(models, tmp_path, s3_server):  # noqa: F811
    """A run in a bucket (snapshots as objects): the proxy holds rollout-0's read of the
    4th adapter version's payload, and rollout-0 is killed (SIGKILL) meanwhile, in the
    middle of swapping that version in. Its successor starts from the base and the newest
    adapters; every step of the synchronous run still trains on answers sampled from exactly
    the weights the learner published (ratio 1 on every token), the dead reader's pin
    notwithstanding."""
    proxy = servers.Proxy(s3_server.port)

    def adapter_read(seen: servers.Seen) -> bool:  # rollout-0 reading an adapter version's payload
        return (
            seen.method == "GET" and "/snapshots/adapters/versions/" in seen.path and seen.path.endswith(".safetensors")
        )

    held = _Nth(adapter_read, 4)
    proxy.delay(held, 2.0)
    with pointed_at("s3", proxy.endpoint) as url:
        sets = {"schedule.mode": "sync", "train.steps": 8, **LORA, "stages.placement": "processes"}
        cfg = _config(models, tmp_path, **{**sets, "output_dir": url, "stages.restarts": 1})
        trainer = Trainer(cfg, progress=False)
        killed: dict[str, float] = {}

        def kill_on_hold() -> None:
            if held.hit.wait(300):
                time.sleep(0.3)  # the read is in the proxy: the swap has begun, its adapters not arrived
                os.kill(trainer.stages.pids["rollout-0"], signal.SIGKILL)
                killed["at"] = time.monotonic()

        threading.Thread(target=kill_on_hold, daemon=True).start()
        trainer.run()
        assert "at" in killed and trainer.stages.restarts_left == 0, "rollout-0 was not killed mid-swap and restarted"
        records = [json.loads(line) for line in open_store(f"{url}/t").read("metrics.jsonl").data.decode().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))
    for r in records:
        assert r["staleness_max"] == 0 and abs(r["importance_ratio_max"] - 1) < 2e-3, r["step"]
