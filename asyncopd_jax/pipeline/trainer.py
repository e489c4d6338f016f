"""The OPD run: the loop that joins the stages.

    rollout + scoring ──▶ StalenessBuffer ──▶ learner (jit, mesh) ──▶ snapshots ──┐
        ▲                                                                          │
        └──────────── the newest policy between decode chunks ◀───────────────────┘

The :class:`~asyncopd_jax.pipeline.layout.Layout` says where each stage runs; the run's
composition root (:func:`~asyncopd_jax.pipeline.compose.build_process`) makes the
learner's process's stages there, and :func:`~asyncopd_jax.pipeline.compose.start_stages`
starts the others. One :class:`Trainer` runs
optimizer steps until ``train.steps`` and writes ``runs/<name>/``. The schedules differ
only in the staleness bound η the buffer enforces (``sync``: 0; ``n_step_off``: n
batches; ``fully_async``: ``schedule.max_staleness``), except ``fixed_lag``, which
samples each batch on demand from the policy exactly k steps back.

A learner over several processes or hosts runs one Trainer per process (see
:mod:`asyncopd_jax.pipeline.placements.multihost`); checkpoints and policy snapshots (Orbax) are
written by all of them together.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from asyncopd_jax.config import RunConfig
from asyncopd_jax.learner import TrainState, distributed
from asyncopd_jax.learner.faults import nonfinite_step_error, step_is_finite
from asyncopd_jax.models import save_pretrained
from asyncopd_jax.models.lora_checkpoint import save_adapters
from asyncopd_jax.pipeline.compose import build_process, start_stages
from asyncopd_jax.pipeline.evaluation import BackgroundEval, EvalResult
from asyncopd_jax.pipeline.exchange import Exchange
from asyncopd_jax.pipeline.heap import HeapTrimmer
from asyncopd_jax.pipeline.layout import LEARNER_PROCESS, Layout, describe, plan_layout
from asyncopd_jax.pipeline.learner_stage import LearnerStage, batch_stats
from asyncopd_jax.pipeline.placements import Stages
from asyncopd_jax.pipeline.probes import Probes, teacher_accuracies, teacher_on
from asyncopd_jax.pipeline.progress import ProgressBar, Throughput
from asyncopd_jax.pipeline.run_outputs import RunDir
from asyncopd_jax.pipeline.snapshots import SnapshotStore, as_published
from asyncopd_jax.pipeline.staleness import RolloutGroup, StalenessBuffer
from asyncopd_jax.pipeline.trace import Tracer
from asyncopd_jax.storage import join
from asyncopd_jax.tracking import FILES as tracking_files
from asyncopd_jax.tracking import RunInfo, Tracking
from asyncopd_jax.tracking.hparams import run_hparams
from asyncopd_jax.tracking.samples import COLUMNS as SAMPLE_COLUMNS
from asyncopd_jax.tracking.samples import sample_table


class Trainer:
    """Builds and runs one OPD run (``resume=True`` continues from its last checkpoint).

    ``layout``: where the stages run (default: planned here from the config and the cores
    this process may use; ``asyncopd train`` plans it before JAX starts)."""

    def __init__(self, cfg: RunConfig, *, resume: bool = False, progress: bool = True, layout: Layout | None = None):
        self.cfg, self.progress = cfg, progress
        self.run_dir = RunDir(join(cfg.output_dir, cfg.name))
        self.multi_process = jax.process_count() > 1
        self.leader = distributed.is_leader()
        self.layout = layout or plan_layout(
            cfg,
            run_path=self.run_dir.location,
            multi_process=self.multi_process,
            available_cores=sorted(os.sched_getaffinity(0)),
        )
        self.tracer = Tracer(origin=self.layout.trace_origin)
        self.eta = cfg.eta
        self.process = build_process(
            cfg, self.layout, LEARNER_PROCESS, tracer=self.tracer, leader=self.leader, multi_process=self.multi_process
        )
        if self.process.learner is None or self.process.snapshots is None:  # not reached: build_process makes both
            raise RuntimeError("the learner's process holds the learner and the snapshots' writing end")
        self.learner: LearnerStage = self.process.learner
        self.snapshots: SnapshotStore = self.process.snapshots
        self.models, self.scoring = self.process.models, self.process.scoring
        self.data, self.vocab_limit = self.models.task, self.models.vocab_limit
        self.probes = Probes(cfg, self.models, self.learner, self._teacher_on_learner, self.leader, self.tracer)
        self.start_step, self.worker_index = 0, 0
        self.unlearned: list[int] | None = None  # of the groups started before a resumed checkpoint
        # Faults at run time: rows dropped for NaN / inf scores so far, and the checkpoint a
        # diverged step's error points to (step, path), None before the first one.
        self.nonfinite_rows_total = 0
        self.last_checkpoint: tuple[int, Path] | None = None
        self._published: dict[str, int] = {}  # the last committed snapshot's bytes, for the next record
        # Evaluation (eval.mode): the last version evaluated (every process knows it) and its
        # accuracy (the leader's, once measured); in the background, the leader's worker and
        # whether the version the current batch publishes is due.
        self.evaluated_version: int | None = None
        self.evaluated_accuracy = float("nan")
        in_background = cfg.eval.mode == "background" and self.leader
        self.background = BackgroundEval(self._accuracy, self.tracer) if in_background else None
        self._eval_due = False
        self.bar: ProgressBar | None = None
        if resume:
            self._resume()
        else:
            self.run_dir.start_fresh(cfg, write=self.leader)
        self.tracking = self._open_tracking() if self.leader else Tracking()  # one log per run

    @property
    def state(self) -> TrainState:
        return self.learner.state

    @property
    def snapshot_dir(self) -> Path:
        return Path(self.layout.snapshots.directory)

    # --- set-up ------------------------------------------------------------------------

    def _open_tracking(self) -> Tracking:
        """The metric sinks of ``logging.sinks`` (TensorBoard, W&B, MLflow), continuing a
        resumed run's."""
        cfg = self.cfg
        hparams = run_hparams(cfg, describe(self.layout))
        return Tracking.open(RunInfo(self.run_dir.path, cfg.name, self.start_step, hparams, cfg.logging))

    def _resume(self) -> None:
        # a run in a bucket, resumed on any host
        self.run_dir.download("metrics.jsonl", "summary.json", *tracking_files)
        self.learner.state, meta = self.run_dir.restore_checkpoint(self.learner.state)
        self.start_step = int(meta["step"])
        self.worker_index = int(meta.get("worker_index", 0))
        self.unlearned = meta.get("unlearned")  # None: a checkpoint from before it was recorded
        self.nonfinite_rows_total = int(meta.get("nonfinite_rows_total", 0))
        self.last_checkpoint = (self.start_step, self._checkpoint_path(self.start_step))
        if self.leader:
            self.run_dir.truncate_metrics(self.start_step)

    def _teacher_on_learner(self) -> nnx.Module:
        """The teacher on the learner's devices, for a probe (see :func:`teacher_on`)."""
        return teacher_on(self.learner.mesh, self.cfg, self.models, self.scoring)

    def _start_stages(self, buffer: StalenessBuffer) -> Stages:
        exchange = self._exchange() if self.layout.stage_processes() else None
        return start_stages(self.process, buffer, self.worker_index, exchange, self.unlearned)

    def _exchange(self) -> Exchange:
        """The run's exchange: ``<run>/exchange``, its stage logs with the run's local files."""
        log_dir = None if self.run_dir.store is None else self.run_dir.path / "logs"
        return Exchange(self.run_dir.where("exchange"), log_dir=log_dir)

    # --- evaluation ---------------------------------------------------------------------

    def _accuracy(self, params: nnx.State) -> float:
        """Held-out accuracy of the student with ``params`` (host arrays, or the background
        worker's copy on the learner's devices: read to the host here, on its thread)."""
        return self.data.accuracy(self.learner.graphdef, jax.device_get(params))

    def evaluate_student(self) -> float:
        """Held-out accuracy of the current student (computed by the leader; every process
        takes part in gathering the parameters and gets the leader's figure)."""
        with self.tracer.span("eval"):
            params = distributed.gather(self.learner.state.params)
            accuracy = self._accuracy(params) if self.leader else 0.0
            self.evaluated_version, self.evaluated_accuracy = self.learner.version, accuracy
            return distributed.from_leader(accuracy)

    def _evaluate_in_background(self, version: int) -> None:
        """Hand the learner's weights, just published as ``version``, to the background
        worker (the leader's; a learner over several processes: all take part in the gather)."""
        params = self.learner.state.params
        # the worker's own copy pins the version: the learner donates its buffers at the next step
        pinned = distributed.gather(params) if self.multi_process else jax.tree_util.tree_map(jnp.copy, params)
        if self.background is not None:
            self.background.submit(version, pinned)
        self.evaluated_version = version

    def _write_evals(self, results: list[EvalResult]) -> None:
        """Background evaluations' records, into metrics.jsonl and the sinks (the leader)."""
        for result in results:
            record = result.record()
            self.run_dir.append_metrics(record)
            self.tracking.log(record)
            self.evaluated_accuracy = result.accuracy
            if self.bar is not None:
                self.bar.last_eval = result.accuracy

    def _drain_evals(self) -> None:
        """Wait for every background evaluation submitted and write it (a checkpoint: the
        run it resumes has each evaluation up to its step; the end: the last version's)."""
        if self.background is not None:
            self._write_evals(self.background.drain())

    def _student_after(self) -> float:
        """The trained student's accuracy: the evaluation of the last version where the
        run made one (the leader's figure, on every process), else measured now."""
        if self.evaluated_version == self.learner.version:
            return distributed.from_leader(self.evaluated_accuracy if self.leader else 0.0)
        return self.evaluate_student()

    def _teacher_accuracies(self) -> dict[str, float]:
        """Each in-process teacher's held-out accuracy, by name, from the stage that holds
        them (none: served teachers only, or reward-driven RL without distillation)."""
        if self.scoring is not None:
            return teacher_accuracies(self.cfg, self.models, self.scoring)
        in_process = any(not teacher.served for teacher in self.models.teachers)
        if not (self.leader and self.layout.stage_processes() and self.cfg.needs_teacher_scores and in_process):
            return {}
        exchange = self._exchange()
        return exchange.wait_for_teacher_accuracies(self.cfg.stages.startup_timeout) or {}

    def _teacher_summary(self) -> dict[str, float]:
        """``teacher_accuracy`` of the run's only teacher, or ``teacher_accuracy/NAME`` of
        each of several (the in-process ones: a server's model cannot be evaluated here);
        a learner over several processes: the leader's figures, on every process (a
        collective: all call it)."""
        accuracies = self._teacher_accuracies()
        if self.multi_process:  # the others' stages are the leader's: they measured nothing
            measured = {t.name: distributed.from_leader(accuracies.get(t.name, -1.0)) for t in self.models.teachers}
            accuracies = {name: value for name, value in measured.items() if value >= 0}
        if len(self.models.teachers) == 1:
            return {"teacher_accuracy": next(iter(accuracies.values()))} if accuracies else {}
        return {f"teacher_accuracy/{name}": value for name, value in accuracies.items()}

    # --- the run ------------------------------------------------------------------------

    def _publish_weights(self, snapshots: SnapshotStore, version: int) -> None:
        """Publish the learner's weights as ``version``, in the dtype the samplers receive."""
        snapshots.publish(version, as_published(self.learner.state.params, self.cfg.published_dtype))

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        summary = self.run_dir.read_summary()
        if "student_before" not in summary:
            summary = {"student_before": self.evaluate_student()}
            if self.leader:
                self.run_dir.write_summary(summary)
                # the eval curve starts at step 0
                self.tracking.log({"step": 0, **summary, "eval_version": self.learner.version})
        self.probes.start()
        buffer = StalenessBuffer(
            cfg.learner.batch_size, self.eta, cfg.learner.mini_batches, first_version=self.learner.version
        )
        snapshots = self.snapshots
        version = self.learner.version
        self._publish_weights(snapshots, version)
        snapshots.wait_for(version)
        self.stages = stages = self._start_stages(buffer)
        self.bar = bar = ProgressBar(self.start_step, cfg.train.steps, enabled=self.progress and self.leader)
        step, throughput, trim_heap = self.start_step, Throughput(), HeapTrimmer()  # trim: RSS flat over days
        # Ctrl-C sets a flag read between steps: a KeyboardInterrupt raised wherever the main thread
        # happens to be was seen swallowed (a CI run kept training after SIGINT; docs/reliability.md).
        interrupted = threading.Event()
        previous_sigint = (
            signal.signal(signal.SIGINT, lambda signum, frame: interrupted.set())
            if threading.current_thread() is threading.main_thread()
            else None
        )
        try:
            while step < cfg.train.steps:
                if interrupted.is_set():
                    raise KeyboardInterrupt
                with self.tracer.span("wait_for_rollouts"):
                    groups = stages.take(version)
                last_checkpoint_slot = step // cfg.train.checkpoint_every
                step = self._train_on_batch(groups, version, step, buffer, bar, throughput)
                stages.consumed(groups)
                version = self.learner.version
                with self.tracer.span("publish", version=version):
                    self._publish_weights(snapshots, version)
                # the version before it is committed now (one write in flight at a time):
                # its bytes go into the next step's record
                self._published = dict(snapshots.last_published)
                if self._eval_due:  # a step of this batch was due: evaluate what it published
                    self._evaluate_in_background(version)
                    self._eval_due = False
                if self.background is not None:
                    self._write_evals(self.background.finished())
                buffer.finish_batch()
                if step // cfg.train.checkpoint_every > last_checkpoint_slot or step >= cfg.train.steps:
                    self._checkpoint(step)
                trim_heap()
        except KeyboardInterrupt:
            self._checkpoint(step)
            self._close_outputs()
            raise
        except BaseException:
            self._close_outputs()
            raise
        finally:
            if previous_sigint is not None:
                signal.signal(signal.SIGINT, previous_sigint)
            buffer.stop()
            stages.join(timeout=120)
            snapshots.close()
            bar.close()
            self._write_trace()
            if self.layout.snapshots.temporary and self.leader:
                shutil.rmtree(self.snapshot_dir, ignore_errors=True)  # RAM; the checkpoints are the record
        return self._finish(summary, step, buffer)

    def _close_outputs(self) -> None:
        """A run that stops early: what the sinks hold is written; waiting evaluations are
        dropped (the checkpoint a resume starts from has every evaluation before it)."""
        if self.background is not None:
            self.background.close()
        self.tracking.close()

    def _finish(self, summary: dict[str, Any], step: int, buffer: StalenessBuffer) -> dict[str, Any]:
        """The trained student in Hugging Face layout, the summary and the report."""
        cfg = self.cfg
        self._drain_evals()  # the last version's (always evaluated)
        if self.background is not None:
            self.background.close()
        student = nnx.merge(self.learner.graphdef, distributed.gather(self.learner.state.params))
        # a resumed run's (the leader's summary.json: every process must agree for the collective)
        measured = bool(distributed.from_leader(int(any(key.startswith("teacher_accuracy") for key in summary))))
        summary = {
            **({} if measured else self._teacher_summary()),
            **summary,
            "student_after": self._student_after(),
            "steps": step,
            "dropped_stale": buffer.dropped_stale,
            "dropped_future": buffer.dropped_future,
            "nonfinite_rows": self.nonfinite_rows_total,
            "stage_seconds": self.tracer.totals(),
        }
        if self.leader:
            save_pretrained(student, self.run_dir.path / "student")  # Hugging Face layout (merged)
            self.data.tokenizer.save_pretrained(self.run_dir.path / "student")
            self.run_dir.upload_tree("student")
            if cfg.student.lora.enabled:  # and the adapters alone, where peft and vLLM load them
                save_adapters(student, self.run_dir.path / "adapter", cfg.student.lora, base_model=cfg.student.path)
                self.run_dir.upload_tree("adapter")
            self.run_dir.write_summary(summary)
            kind = "RL, " if cfg.algorithm == "rl" else ""
            report = self.run_dir.write_report(
                f"{cfg.name}: {kind}{cfg.estimator.name}, {cfg.schedule.mode} (η = {self.eta})"
            )
            teachers = {k: v for k, v in summary.items() if k.startswith("teacher_accuracy")}
            self.tracking.log({"step": step, **teachers})  # the teacher's line, at the last step
            self.tracking.image("report", report, step)
            self.tracking.close()
            self.run_dir.sync_logs()
        self.run_dir.close()
        return summary

    def _checkpoint(self, step: int) -> None:
        with self.tracer.span("checkpoint", step=step):
            meta = {
                "step": step,
                "worker_index": self.stages.groups_started,
                "unlearned": self.stages.unlearned(),
                "nonfinite_rows_total": self.nonfinite_rows_total,
            }
            self._drain_evals()
            self.tracking.flush()  # the sinks hold every step the checkpoint covers
            self.run_dir.save_checkpoint(step, self.learner.state, meta)
        self.last_checkpoint = (step, self._checkpoint_path(step))
        self.stages.checkpointed()
        self._write_trace()

    def _checkpoint_path(self, step: int) -> Path:
        """Where Orbax keeps the checkpoint of ``step`` (its step directory)."""
        return self.run_dir.path / "checkpoints" / str(step)

    def _write_trace(self) -> None:
        if self.leader:
            self.tracer.write(self.run_dir.path / "trace.json", others=self.stages.trace_files())
            self.run_dir.upload("trace.json")

    def _train_on_batch(
        self,
        groups: list[RolloutGroup],
        version: int,
        step: int,
        buffer: StalenessBuffer,
        bar: ProgressBar,
        throughput: Throughput,
    ) -> int:
        """Run the optimizer steps of one rollout batch (its mini-batches); log one record each."""
        cfg, learner = self.cfg, self.learner
        batch_record = batch_stats(groups, version)
        with self.tracer.span("proximal" if learner.proximal is not None else "place"):
            minis = learner.mini_batches(groups)
        behaviour = min(g.oldest_version for g in groups)  # still kept: it is ≥ version − η
        probe = self.probes.diagnose(step, len(minis), self.snapshots, behaviour)
        for mini in minis:
            if step >= cfg.train.steps:
                break
            with self.tracer.span("learn", step=step):
                metrics = learner.step(mini)
            if not step_is_finite(metrics):
                # The jitted step left the state as it was; stop before this step is logged,
                # extrapolated, published or checkpointed (the caller's `finally` stops the
                # stages). Hours of NaN steps would teach nothing and hide where it began.
                raise nonfinite_step_error(step + 1, metrics, self.last_checkpoint)
            dropped = int(metrics.get("nonfinite_rows", 0))  # rows dropped from the loss
            metrics["nonfinite_rows"] = dropped
            self.nonfinite_rows_total += dropped
            step += 1
            jump = self.probes.extrapolate(step)  # before the version is published: it carries the jump
            record = {
                "step": step,
                **metrics,
                "lr": float(learner.lr(step - 1)),
                **batch_record,
                **throughput.add(learner.rows_per_step(), int(metrics["tokens"])),
                "dropped_stale": buffer.dropped_stale,
                "dropped_future": buffer.dropped_future,
                "nonfinite_rows_total": self.nonfinite_rows_total,
                "trace_s": time.time() - self.tracer.origin,  # the same clock as trace.json's spans
                **probe,
                **jump,
                **self.probes.update_geometry(step),
            }
            record.update(self._published)
            probe, self._published = {}, {}  # on the first step of the batch only
            if step % cfg.train.eval_every == 0 or step == cfg.train.steps:
                if cfg.eval.mode == "inline":
                    start = time.perf_counter()
                    record["eval_accuracy"] = self.evaluate_student()
                    record["eval_seconds"] = time.perf_counter() - start  # inside the next step's "time"
                    record["eval_version"] = learner.version
                else:  # the version this batch publishes, on the background worker
                    self._eval_due = True
                if self.leader and self.tracking.sinks and cfg.logging.samples:
                    rows = sample_table(groups, self.data.tokenizer, cfg.logging.samples)
                    self.tracking.table("samples", SAMPLE_COLUMNS, rows, step)
            if self.leader:
                self.run_dir.append_metrics(record)
                self.tracking.log(record)
            bar.update(record)
        return step
