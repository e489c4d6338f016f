"""The OPD run: rollout workers, teacher scoring, staleness buffer, learner, snapshots.

    rollout + scoring ──▶ StalenessBuffer ──▶ learner (jit, mesh) ──▶ SnapshotStore ──┐
        ▲                                                                             │
        └──────────────── newest snapshot between decode chunks ◀─────────────────────┘

Rollout and scoring run where ``schedule.placement`` puts them: as threads of this
process (:class:`RolloutPool`) or as separate processes on their own cores or devices
(:class:`StageProcesses`, joined through versioned snapshots on disk and a spool of
scored groups).

One :class:`Trainer` builds every component from a :class:`RunConfig`, runs optimizer
steps until ``train.steps``, and writes ``runs/<name>/``. The three schedules differ only
in the staleness bound η the buffer enforces (``sync``: 0; ``n_step_off``: n batches;
``fully_async``: ``schedule.max_staleness``).

A learner over several processes or hosts (``distributed.initialize``; see
:mod:`asyncopd_jax.learner.distributed`) runs one Trainer per process. Process 0, the
*leader*, owns the staleness buffer and the stage processes and writes the run's files;
at every rollout batch it broadcasts the numbers of the spool records it took, and every
process reads those records from the shared run directory and feeds its own rows.
Checkpoints and policy snapshots (Orbax) are written by all processes together.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from asyncopd_jax.cache import RolloutBatch
from asyncopd_jax.config import RunConfig
from asyncopd_jax.estimator_registry import get_estimator
from asyncopd_jax.learner import (
    LearnerBatch,
    distributed,
    PolicyLoss,
    create_train_state,
    make_mesh,
    make_optimizer,
    make_packed_train_step,
    make_proximal_fn,
    make_train_step,
)
from asyncopd_jax.learner.extrapolation import Extrapolator
from asyncopd_jax.learner.faults import nonfinite_step_error, step_is_finite
from asyncopd_jax.learner.update_geometry import update_geometry
from asyncopd_jax.learner.optimizer import learning_rate_schedule
from asyncopd_jax.models import (Decoder, check_same_vocabulary, from_pretrained, load_tokenizer, save_pretrained,
                                 shared_vocab_size)
from asyncopd_jax.pipeline.diagnostics import ProbeDiagnostics
from asyncopd_jax.pipeline.fixed_lag import FixedLagRollouts
from asyncopd_jax.pipeline.heap import HeapTrimmer
from asyncopd_jax.pipeline.processes import Exchange, StageProcesses, default_snapshot_dir, plan_stages
from asyncopd_jax.pipeline.reward_stage import RewardStage
from asyncopd_jax.pipeline.rollout import GroupProducer, RolloutPool, make_scorers
from asyncopd_jax.pipeline.run_outputs import RunDir
from asyncopd_jax.pipeline.snapshots import InMemorySnapshotStore, DiskSnapshotStore
from asyncopd_jax.pipeline.spool import group_from_record, read_record
from asyncopd_jax.pipeline.stage_worker import stop_token_ids
from asyncopd_jax.pipeline.staleness import PipelineStopped, RolloutGroup, StalenessBuffer
from asyncopd_jax.pipeline.trace import Tracer
from asyncopd_jax.sampling import Sampler
from asyncopd_jax.tasks.assets import resolve_model_path
from asyncopd_jax.tasks.prompt_task import make_task
from asyncopd_jax.teacher import Scorers


def _concat(items: list) -> Any:
    return jax.tree_util.tree_map(lambda *xs: jnp.concatenate(xs, axis=0), *items)


def _rows(tree: Any, start: int, stop: int) -> Any:
    return jax.tree_util.tree_map(lambda x: x[start:stop], tree)


def load_model_and_tokenizer(path: str, dtype: str) -> tuple[Decoder, Any]:
    directory = resolve_model_path(path)
    return from_pretrained(directory, dtype=dtype), load_tokenizer(directory)


class Trainer:
    """Builds and runs one OPD run (``resume=True`` continues from its last checkpoint)."""

    def __init__(self, cfg: RunConfig, *, resume: bool = False, progress: bool = True):
        self.cfg = cfg
        self.progress = progress
        self.run_dir = RunDir(Path(cfg.output_dir) / cfg.name)
        self.tracer = Tracer()
        self.multi_process = jax.process_count() > 1
        self.leader = distributed.is_leader()

        student, tokenizer = load_model_and_tokenizer(cfg.student.path, cfg.student.dtype)
        context = student.config.max_position_embeddings
        self.teacher = None  # reward-driven RL may run without one (rl.distill_coef = 0)
        self.vocab_limit: int | None = None
        if cfg.teacher.path:
            teacher, teacher_tokenizer = load_model_and_tokenizer(cfg.teacher.path, cfg.teacher.dtype)
            check_same_vocabulary(tokenizer, teacher_tokenizer)
            # embeddings padded to different sizes: both models output the ids they share
            self.vocab_limit = shared_vocab_size(tokenizer, student.config.vocab_size, teacher.config.vocab_size)
            student.vocab_limit = teacher.vocab_limit = self.vocab_limit
            self.teacher = teacher
            # the student samples prompt + answer and the teacher scores all of it: both must hold it
            context = min(context, teacher.config.max_position_embeddings)
        self.data = make_task(cfg.task, tokenizer, max_new_tokens=cfg.sampling.max_new_tokens, max_positions=context)

        learner = cfg.learner
        self.eta = cfg.schedule.eta(learner.mini_batches)
        self.mesh = make_mesh(learner.mesh)
        self.optimizer = make_optimizer(cfg.optim, cfg.train.steps)
        self.lr = learning_rate_schedule(cfg.optim, cfg.train.steps)
        self.graphdef, self.state = create_train_state(student, self.optimizer, self.mesh)
        self.loss = PolicyLoss.from_config(cfg)
        if learner.token_budget:  # dynamic batching
            self.train_step = make_packed_train_step(self.graphdef, self.optimizer, self.loss,
                                                     token_budget=learner.token_budget, bucket=learner.token_bucket,
                                                     mesh=self.mesh, state_example=self.state)
        else:
            self.train_step = make_train_step(self.graphdef, self.optimizer, self.loss,
                                              micro_batches=learner.micro_batches, mesh=self.mesh,
                                              state_example=self.state)
        self.needs_proximal = get_estimator(cfg.estimator.name).needs_proximal
        self.proximal = make_proximal_fn(self.graphdef, self.loss) if self.needs_proximal else None

        self.sampling = dataclasses.replace(
            cfg.sampling, stop_token_ids=stop_token_ids(cfg, self.data, student.config.eos_token_ids))
        self.diagnostics = self._probe_diagnostics() if cfg.train.diagnostics_every else None
        self.extrapolator, self.extrapolation_probe = None, None
        if learner.extrapolation.enabled:  # EffOPD (after a resume, anchored at the restored weights)
            self.extrapolation_probe = self._extrapolation_probe()
        self.start_step, self.worker_index = 0, 0
        # Faults at run time: rows dropped for NaN / inf scores so far, and the checkpoint a
        # diverged step's error points to (step, path), None before the first one.
        self.nonfinite_rows_total = 0
        self.last_checkpoint: tuple[int, Path] | None = None
        self.rollout_seed = cfg.seed * 1_000_003
        if resume:
            self._resume()
        else:
            if (self.run_dir.path / "checkpoints").is_dir() and any((self.run_dir.path / "checkpoints").iterdir()):
                raise FileExistsError(
                    f"{self.run_dir.path} already holds a run with checkpoints; continue it with "
                    f"--resume {self.run_dir.path}, or start another with --set name=<new name>"
                )
            if self.leader:
                for stale in ("metrics.jsonl", "summary.json"):
                    (self.run_dir.path / stale).unlink(missing_ok=True)
                self.run_dir.write_config(cfg)

    # --- set-up ------------------------------------------------------------------------

    def _resume(self) -> None:
        self.state, meta = self.run_dir.restore_checkpoint(self.state)
        self.start_step = int(meta["step"])
        self.worker_index = int(meta.get("worker_index", 0))
        self.nonfinite_rows_total = int(meta.get("nonfinite_rows_total", 0))
        self.last_checkpoint = (self.start_step, self._checkpoint_path(self.start_step))
        if self.leader:
            self.run_dir.truncate_metrics(self.start_step)

    @property
    def snapshot_dir(self) -> Path:
        configured = self.cfg.stages.snapshot_dir
        if self.cfg.schedule.placement == "processes" and configured == "auto" and not self.multi_process:
            return default_snapshot_dir(self.run_dir.path)
        return Path(configured) if configured != "auto" else self.run_dir.path / "snapshots"

    def _snapshot_store(self):
        # A version is published once per rollout batch (M optimizer steps), so the versions
        # a rollout may still start from span ⌈η / M⌉ + 1 of them; one more is in flight.
        keep = -(-self.eta // self.cfg.learner.mini_batches) + 2
        if self.cfg.schedule.snapshot_in_memory and self.cfg.schedule.placement == "threads":
            return InMemorySnapshotStore(keep=keep)
        # Versions left by an earlier incarnation of this run may be newer than the restored
        # policy; rollouts from them would be refused as "future". The learner is the only
        # writer and no reader runs yet, so start from an empty directory.
        if self.leader:
            shutil.rmtree(self.snapshot_dir, ignore_errors=True)
        distributed.barrier("snapshot directory emptied")
        abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self.state.params)
        return DiskSnapshotStore(self.snapshot_dir, abstract, keep=keep, format=self.snapshot_format)

    @property
    def snapshot_format(self) -> str:
        """``stages.snapshot_format``, with ``auto`` resolved: a flat safetensors file when
        one process holds all the parameters, Orbax (each process writes its shards) else."""
        configured = self.cfg.stages.snapshot_format
        if configured == "auto":
            return "orbax" if self.multi_process else "safetensors"
        return configured

    def _probe_diagnostics(self) -> ProbeDiagnostics:
        prompts, _ = self.data.train_prompts(np.random.default_rng([self.cfg.seed, 2**31 - 1]),
                                             self.cfg.train.diagnostic_prompts)
        return ProbeDiagnostics(graphdef=self.graphdef, teacher=self.teacher, prompts=prompts, sampling=self.sampling,
                                teacher_temperature=self.cfg.scoring.temperature, pad_id=self.data.pad_id,
                                prompt_slots=self.data.prompt_slots, seed=self.cfg.seed)

    def _extrapolation_probe(self) -> Callable[[nnx.State], float]:
        """EffOPD's probe: a score of the full parameters, higher is better (see
        :class:`asyncopd_jax.config.ExtrapolationConfig`)."""
        ext, seed = self.cfg.learner.extrapolation, self.cfg.seed
        prompts, items = self.data.train_prompts(np.random.default_rng([seed, 2**31 - 2]), ext.probe_prompts)
        if ext.probe_metric == "accuracy":
            return lambda params: self.data.accuracy(self.graphdef, params, items=items,
                                                     temperature=ext.probe_temperature, seed=seed)
        probe = ProbeDiagnostics(graphdef=self.graphdef, teacher=self.teacher, prompts=prompts, sampling=self.sampling,
                                 teacher_temperature=self.cfg.scoring.temperature, pad_id=self.data.pad_id,
                                 prompt_slots=self.data.prompt_slots, seed=seed + 1)
        return lambda params: -probe.measure(params, params)["probe_reverse_kl"]

    def _extrapolate(self, step: int) -> dict[str, Any]:
        """EffOPD after optimizer step ``step``: at steps 1, 2, 4, … search the extrapolation
        candidates on the probe and continue from the one kept (parameters only: the
        optimizer state is untouched). Returns the jump's metrics ({} at other steps)."""
        if self.extrapolator is None:
            return {}

        def score(params: nnx.State) -> float:  # computed by the leader, shared with every process
            full = distributed.gather(params)
            return distributed.from_leader(self.extrapolation_probe(full) if self.leader else 0.0)

        start = time.perf_counter()
        with self.tracer.span("extrapolate", step=step):
            params, jump = self.extrapolator.after_update(step, self.state.params, score)
        if jump is None:
            return {}
        self.state = dataclasses.replace(self.state, params=params)
        return {**jump.metrics(), "extrapolation_tried": [list(t) for t in jump.tried],
                "extrapolation_seconds": time.perf_counter() - start}

    def _update_geometry(self) -> dict[str, list[float | None]]:
        """The update-geometry diagnostic of θ_t against θ_0 and the previous measurement θ_s."""
        current = distributed.gather(self.state.params)  # every process: a collective over several
        initial, previous = self.geometry_params
        self.geometry_params = [initial, current]
        return update_geometry(initial, previous, current)

    def _producer(self, group_size: int, interruptible: bool = True) -> GroupProducer:
        """Samples rollout groups in this process from ``self.snapshots``."""
        return GroupProducer(
            sampler=Sampler(self.graphdef, self.sampling, pad_id=self.data.pad_id), snapshots=self.snapshots,
            prompts=self.data.train_prompts, reward=RewardStage.from_config(self.cfg, self.data.rewards),
            group_size=group_size,
            seed=self.rollout_seed, prompt_slots=self.data.prompt_slots, tracer=self.tracer,
            interruptible=interruptible,
        )

    def _scorer(self) -> Scorers | None:
        """The scoring of rollouts in this process (None: the run needs no scores)."""
        return make_scorers(self.cfg, self.teacher, self.vocab_limit)

    def _start_stages(self, buffer: StalenessBuffer) -> RolloutPool | StageProcesses | FixedLagRollouts:
        """Rollout and scoring, as threads of this process or as stage processes (or, for
        ``fixed_lag``, on demand in the learner's thread)."""
        cfg = self.cfg
        group = cfg.rollout_group_size()
        if cfg.schedule.mode == "fixed_lag":  # whole batches from one policy: no weight swaps
            return FixedLagRollouts(producer=self._producer(group, interruptible=False),
                                    scorer=self._scorer(), lag=cfg.schedule.lag,
                                    first_version=int(self.state.step))
        if cfg.schedule.placement == "processes":
            _, specs = plan_stages(cfg.stages, sorted(os.sched_getaffinity(0)))
            layout = {"snapshots": str(self.snapshot_dir), "snapshot_format": self.snapshot_format, "seed": self.rollout_seed, "group_size": group,
                      "origin": self.tracer.origin, "vocab_limit": self.vocab_limit}
            stages = StageProcesses(cfg=cfg, exchange=Exchange(self.run_dir.path / "exchange"), buffer=buffer,
                                    specs=specs, group_size=group, first_index=self.worker_index, layout=layout,
                                    tracer=self.tracer)
        else:
            workers = cfg.schedule.rollout_workers
            stages = RolloutPool(producer=self._producer(group), scorer=self._scorer(), buffer=buffer,
                                 workers=workers, first_index=self.worker_index)
        stages.start()
        return stages

    # --- evaluation ---------------------------------------------------------------------

    def evaluate_student(self) -> float:
        """Held-out accuracy of the current student (computed by the leader; every process
        takes part in gathering the parameters and gets the leader's figure)."""
        with self.tracer.span("eval"):
            params = distributed.gather(self.state.params)
            accuracy = self.data.accuracy(self.graphdef, params) if self.leader else 0.0
            return distributed.from_leader(accuracy)

    # --- the run ------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        summary = self.run_dir.read_summary()
        if "student_before" not in summary:
            summary = {}
            if self.teacher is not None:
                teacher_accuracy = self.data.accuracy(*nnx.split(self.teacher)) if self.leader else 0.0
                summary["teacher_accuracy"] = distributed.from_leader(teacher_accuracy)
            summary["student_before"] = self.evaluate_student()
            if self.leader:
                self.run_dir.write_summary(summary)

        if self.extrapolation_probe is not None:
            self.extrapolator = Extrapolator(self.state.params, cfg.learner.extrapolation.factors)
        if cfg.train.update_geometry_every:  # θ_0 and θ_s of the update-geometry diagnostic, on the host
            self.geometry_params = [distributed.gather(self.state.params)] * 2
        buffer = StalenessBuffer(cfg.learner.batch_size, self.eta, cfg.learner.mini_batches)
        self.snapshots = snapshots = self._snapshot_store()
        version = int(self.state.step)
        snapshots.publish(version, self.state.params)
        snapshots.wait_for(version)
        self.stages = pool = self._start_stages(buffer) if self.leader else _Follower()
        bar = _progress(self.start_step, cfg.train.steps, enabled=self.progress and self.leader)
        step = self.start_step
        throughput = _Throughput()
        trim_heap = HeapTrimmer()  # resident memory flat over days (pipeline/heap.py)
        # Ctrl-C sets a flag read between steps: a KeyboardInterrupt raised wherever the main thread
        # happens to be was seen swallowed (a CI run kept training after SIGINT; docs/reliability.md).
        interrupted = threading.Event()
        previous_sigint = (signal.signal(signal.SIGINT, lambda signum, frame: interrupted.set())
                           if threading.current_thread() is threading.main_thread() else None)
        try:
            while step < cfg.train.steps:
                if interrupted.is_set():
                    raise KeyboardInterrupt
                with self.tracer.span("wait_for_rollouts"):
                    groups = self._take_batch(buffer, version)
                last_checkpoint_slot = step // cfg.train.checkpoint_every
                step = self._train_on_batch(groups, version, step, buffer, bar, throughput)
                pool.consumed(groups)
                version = int(self.state.step)
                with self.tracer.span("publish", version=version):
                    snapshots.publish(version, self.state.params)
                buffer.finish_batch()
                if step // cfg.train.checkpoint_every > last_checkpoint_slot or step >= cfg.train.steps:
                    self._checkpoint(step, pool)
                trim_heap()
        except KeyboardInterrupt:
            self._checkpoint(step, pool)
            raise
        finally:
            if previous_sigint is not None:
                signal.signal(signal.SIGINT, previous_sigint)
            buffer.stop()
            pool.join(timeout=120)
            snapshots.close()
            bar.close()
            self._write_trace(pool)
            if cfg.schedule.placement == "processes" and cfg.stages.snapshot_dir == "auto" and self.leader:
                shutil.rmtree(self.snapshot_dir, ignore_errors=True)  # RAM; the checkpoints are the record
        student = nnx.merge(self.graphdef, distributed.gather(self.state.params))
        summary = {**summary, "student_after": self.evaluate_student(), "steps": step,
                   "dropped_stale": buffer.dropped_stale, "dropped_future": buffer.dropped_future,
                   "nonfinite_rows": self.nonfinite_rows_total, "stage_seconds": self.tracer.totals()}
        if self.leader:
            save_pretrained(student, self.run_dir.path / "student")  # Hugging Face layout
            self.data.tokenizer.save_pretrained(self.run_dir.path / "student")
            self.run_dir.write_summary(summary)
            self.run_dir.write_report(f"{cfg.name}: {'RL, ' if cfg.algorithm == 'rl' else ''}{cfg.estimator.name}, {cfg.schedule.mode} (η = {self.eta})")
        self.run_dir.close()
        return summary

    def _take_batch(self, buffer: StalenessBuffer, version: int) -> list[RolloutGroup]:
        """The rollout groups of the next batch. One process: from the staleness buffer.
        Several: the leader takes them from its buffer and broadcasts their record numbers
        with a fingerprint of each; every other process reads the same records from the
        spool and checks the fingerprints (a stale read of shared storage fails loudly
        instead of training on other rows). Numbers −1: the leader stopped."""
        if isinstance(self.stages, FixedLagRollouts):
            return self.stages.take(version)
        if not self.multi_process:
            return buffer.take(version)
        named = np.full((self.cfg.learner.batch_size // self.cfg.rollout_group_size(), 2), -1, np.int64)
        groups: list[RolloutGroup] = []
        if self.leader:
            try:
                groups = buffer.take(version)
            except PipelineStopped:
                distributed.from_leader(named)  # tell the others to stop too
                raise
            named = np.asarray([(int(g.info["record"]), _fingerprint(g)) for g in groups], np.int64)
        named = distributed.from_leader(named)
        if (named[:, 0] < 0).any():
            raise PipelineStopped("the leader learner process stopped the run (its log has the cause)")
        if self.leader:
            return groups
        scored = Exchange(self.run_dir.path / "exchange").scored
        groups = [group_from_record(read_record(scored.path(f"{n:010d}")))[0] for n in named[:, 0]]
        for group, (number, fingerprint) in zip(groups, named):
            if _fingerprint(group) != fingerprint:
                raise RuntimeError(f"rollout record {number:010d} in {scored.root} differs from the one the leader "
                                   "trains on: is the run directory on storage every host sees consistently?")
        return groups

    def _checkpoint(self, step: int, pool: RolloutPool | StageProcesses | FixedLagRollouts | _Follower) -> None:
        with self.tracer.span("checkpoint", step=step):
            meta = {"step": step, "worker_index": pool.groups_started,
                    "nonfinite_rows_total": self.nonfinite_rows_total}
            self.run_dir.save_checkpoint(step, self.state, meta)
        self.last_checkpoint = (step, self._checkpoint_path(step))
        pool.checkpointed()
        self._write_trace(pool)

    def _checkpoint_path(self, step: int) -> Path:
        """Where Orbax keeps the checkpoint of ``step`` (its step directory)."""
        return self.run_dir.path / "checkpoints" / str(step)

    def _write_trace(self, pool: RolloutPool | StageProcesses | FixedLagRollouts | _Follower) -> None:
        if not self.leader:
            return
        others = pool.trace_files() if isinstance(pool, StageProcesses) else []
        self.tracer.write(self.run_dir.path / "trace.json", others=others)


    def _train_on_batch(self, groups, version: int, step: int, buffer: StalenessBuffer, bar, throughput) -> int:
        """Run the optimizer steps of one rollout batch (its mini-batches); log one record each."""
        cfg = self.cfg
        batch = _concat([g.batch for g in groups])
        cache = _concat([g.cache for g in groups]) if groups[0].cache is not None else None  # None: RL, β = 0
        rewards = np.concatenate([g.info["rewards"] for g in groups])
        # NaN: a response the task cannot check (a dataset without reference answers)
        rollout_acc = {"rollout_accuracy": float(np.nanmean(rewards))} if np.isfinite(rewards).any() else {}
        stale = _staleness(batch, version)
        rows = cfg.learner.batch_size // cfg.learner.mini_batches
        minis = [LearnerBatch(_rows(batch, m * rows, (m + 1) * rows), _rows(cache, m * rows, (m + 1) * rows))
                 for m in range(cfg.learner.mini_batches)]
        if self.multi_process:  # this process feeds its own rows of each mini-batch
            share = distributed.process_rows(rows)
            minis = [distributed.global_batch(_rows(mini, share.start, share.stop), self.mesh) for mini in minis]
        if self.needs_proximal:  # π_prox: the weights before the batch's first step
            with self.tracer.span("proximal"):
                minis = [LearnerBatch(m.rollout, m.cache, self.proximal(self.state.params, m)) for m in minis]
        probe = {}
        every = cfg.train.diagnostics_every
        if self.diagnostics is not None and any(s % every == 0 for s in range(step, step + len(minis))):
            behaviour = min(g.oldest_version for g in groups)  # still kept: it is ≥ version − η
            with self.tracer.span("diagnostics"):
                probe = self.diagnostics.measure(self.state.params, self.snapshots.load(behaviour)[1])
            probe["probe_behaviour_version"] = behaviour
        for mini in minis:
            if step >= cfg.train.steps:
                break
            with self.tracer.span("learn", step=step):
                self.state, metrics = self.train_step(self.state, mini)
                metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
            if not step_is_finite(metrics):
                # The jitted step left the state as it was; stop before this step is logged,
                # extrapolated, published or checkpointed (the caller's `finally` stops the
                # stages). Hours of NaN steps would teach nothing and hide where it began.
                raise nonfinite_step_error(step + 1, metrics, self.last_checkpoint)
            metrics["nonfinite_rows"] = int(metrics.get("nonfinite_rows", 0))  # dropped from the loss
            self.nonfinite_rows_total += metrics["nonfinite_rows"]
            step += 1
            jump = self._extrapolate(step)  # before the version is published: it carries the jump
            elapsed = throughput.add(rows, int(metrics["tokens"]))
            record = {
                "step": step, **metrics, "lr": float(self.lr(step - 1)),
                "staleness_mean": stale["mean"], "staleness_max": stale["max"], "staleness_hist": stale["hist"],
                **rollout_acc, "samples_per_s": throughput.samples / elapsed,
                "tokens_per_s": throughput.tokens / elapsed, "dropped_stale": buffer.dropped_stale,
                "dropped_future": buffer.dropped_future, "nonfinite_rows_total": self.nonfinite_rows_total,
                "time": elapsed,
                "trace_s": time.time() - self.tracer.origin,  # the same clock as trace.json's spans
                **probe, **jump,
            }
            probe = {}  # on the first step of the batch only
            if cfg.train.update_geometry_every and step % cfg.train.update_geometry_every == 0:
                record["update_geometry"] = self._update_geometry()
            if step % cfg.train.eval_every == 0 or step == cfg.train.steps:
                start = time.perf_counter()
                record["eval_accuracy"] = self.evaluate_student()
                record["eval_seconds"] = time.perf_counter() - start  # inside the next step's "time"
            if self.leader:
                self.run_dir.append_metrics(record)
            bar.update(record)
        return step


class _Follower:
    """The stages as a learner process other than the leader sees them: not its business
    (the leader starts and feeds them; this process reads the batches it names)."""

    groups_started = 0

    def consumed(self, taken: list[RolloutGroup]) -> None:
        pass

    def checkpointed(self) -> None:
        pass

    def join(self, timeout: float = 60.0) -> None:
        pass


class _Throughput:
    """Samples and tokens trained on since the run (or resume) started."""

    def __init__(self) -> None:
        self.start, self.samples, self.tokens = time.perf_counter(), 0, 0

    def add(self, samples: int, tokens: int) -> float:
        """Count a step; return the seconds elapsed since the start."""
        self.samples += samples
        self.tokens += tokens
        return time.perf_counter() - self.start


def _fingerprint(group: RolloutGroup) -> int:
    """A position-weighted checksum of a group's response tokens and versions."""
    values = np.concatenate([np.asarray(group.batch.response_tokens).ravel(),
                             np.asarray(group.batch.token_version).ravel()]).astype(np.int64)
    return int(np.sum(values * (np.arange(values.size) % 9973 + 1)))


def _staleness(batch: RolloutBatch, version: int) -> dict[str, Any]:
    mask = np.asarray(batch.response_mask)
    ages = version - np.asarray(batch.token_version)[mask]
    hist = np.bincount(np.maximum(ages, 0)).tolist() if ages.size else []
    return {"mean": float(ages.mean()) if ages.size else 0.0, "max": int(ages.max()) if ages.size else 0, "hist": hist}


class _progress:
    """A tqdm bar showing loss, KL signal, staleness and accuracy (silent when disabled)."""

    def __init__(self, start: int, total: int, enabled: bool):
        self.bar = None
        self.last_eval = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)

    def update(self, record: dict[str, Any]) -> None:
        if self.bar is None:
            return
        self.last_eval = record.get("eval_accuracy", self.last_eval)
        post = {"loss": f"{record['loss']:.4f}", "kl": f"{record.get('reverse_kl_signal', 0.0):.3f}",
                "stale": f"{record['staleness_mean']:.2f}"}
        if "rollout_accuracy" in record:
            post["acc"] = f"{record['rollout_accuracy']:.2f}"
        if self.last_eval is not None:
            post["eval"] = f"{self.last_eval:.2f}"
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


