"""What a run writes under ``runs/<name>/``: config, metrics, trace, checkpoints, report.

The run directory may be a bucket (``output_dir: s3://…`` or ``gs://…``). The run then
works in a local staging copy (:func:`~asyncopd_jax.storage.location.staging_dir`)
and uploads each output as it changes: the config, the summary, the trace, the report at
once; ``metrics.jsonl`` at most every :data:`METRICS_UPLOAD_S` seconds and at every
checkpoint; a checkpoint — written by Orbax into the staging copy, since Orbax cannot be
pointed at an S3-compatible endpoint through a path — file by file, then committed by a
record ``checkpoints/<step>.commit`` (the bucket's checkpoints are those with a record).
A resumed run, on this host or another, downloads what it needs from the bucket first.

A learner over several processes shares no directory in a bucket: each process stages
under a directory of its own, Orbax saves there what that process holds (its shards and
the replicated arrays, :func:`_each_process_handlers`), and each uploads its *part* under
``checkpoints/<step>/p<process>/``; process 0 writes the commit record, naming the process
count, once every part is uploaded. A resume downloads each process's own part, and only
with the process count that wrote it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from asyncopd_jax import tracking
from asyncopd_jax.atomic_files import write_text_atomically
from asyncopd_jax.config import RunConfig, save_config
from asyncopd_jax.learner import distributed
from asyncopd_jax.pipeline.learner_stage import teacher_metric, teacher_names
from asyncopd_jax.storage import is_url, join, open_store, records
from asyncopd_jax.storage.location import staging_dir


class CheckpointSaveFailed(OSError):
    """A checkpoint could not be written; the message names the last good one."""


class CheckpointMismatch(ValueError):
    """A checkpoint holds a train state of another layout than the run's config builds
    (a changed LoRA rank, targets or ``modules_to_save``, a changed model); the message
    names the first weight that differs."""


def state_layout(state: Any) -> list[str]:
    """Every leaf of a train state as ``"path shape dtype"``, in the order a checkpoint
    stores them (leaf ``i`` is saved as ``"{i:05d}"``): what a resume must find again."""
    return [
        f"{jax.tree_util.keystr(path)} {tuple(leaf.shape)} {np.dtype(leaf.dtype).name}"
        for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
    ]


def _io_reason(err: BaseException) -> str:
    """The operating system's reason inside an Orbax / TensorStore error (they carry it as
    ``[os_error_code='28']``), else the error's first line."""
    code = re.search(r"os_error_code='(\d+)'", str(err))
    if code:
        return os.strerror(int(code.group(1)))
    return str(err).splitlines()[0][:200] if str(err) else type(err).__name__


METRICS_UPLOAD_S = 10.0  # a run in a bucket uploads metrics.jsonl at most this often (and at checkpoints)

# Every process saves into a directory of its own (Orbax's default: process 0 creates and
# finalizes one directory all processes share).
_EACH_PROCESS = ocp.options.MultiprocessingOptions(primary_host=None)


def _each_process_handlers() -> dict[str, ocp.CheckpointHandler]:
    """Orbax's item handlers for a checkpoint every process saves and restores alone.

    Besides ``primary_host=None``, the array handler must write the replicas a process holds
    (``replica_id=None``): by default one process writes each replicated array, and the
    other's directory would lack it (Orbax 0.12.8, checked with two CPU processes). A
    registry of its own, so snapshots and other checkpoints keep Orbax's defaults."""
    arrays = ocp.type_handlers.ArrayHandler(primary_host=None, replica_id=None, use_replica_parallel=False)
    registry = ocp.type_handlers.create_type_handler_registry((jax.Array, arrays))
    return {
        "state": ocp.PyTreeCheckpointHandler(multiprocessing_options=_EACH_PROCESS, type_handler_registry=registry),
        "meta": ocp.JsonCheckpointHandler(multiprocessing_options=_EACH_PROCESS),
    }


def optimizer_step_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of optimizer steps, in step order, from ``metrics.jsonl``'s records: a
    background evaluation (``eval.mode: background``) writes records of its own (no
    ``loss``), later than the steps after its version."""
    return [r for r in records if "loss" in r]


class RunDir:
    """``config.yaml``, ``metrics.jsonl``, ``trace.json``, ``checkpoints/``, ``report.png``,
    ``summary.json``: in a local directory, or staged here and uploaded to a bucket (see
    the module docstring). ``location``: the run directory, a path or a bucket URL."""

    def __init__(self, location: str | Path):
        self.location = str(location)
        self.store = open_store(self.location) if is_url(self.location) else None
        self.processes = jax.process_count()
        # A learner over several processes with its run in a bucket: this process's part of
        # each checkpoint (see the module docstring); None: the checkpoint is one directory.
        self.part = f"p{jax.process_index()}" if self.store is not None and self.processes > 1 else None
        if self.store is None:
            self.path = Path(location).resolve()  # Orbax wants absolute paths
        else:  # processes of one host (as in the tests) must not share a staging copy
            staged = staging_dir(self.location)
            self.path = staged.with_name(f"{staged.name}-{self.part}") if self.part else staged
        self.path.mkdir(parents=True, exist_ok=True)
        self.metrics_file = self.path / "metrics.jsonl"
        self._checkpoints: ocp.CheckpointManager | None = None
        self._metrics_uploaded = 0.0  # monotonic time of the last upload of metrics.jsonl
        self._uploaded: dict[str, tuple[int, int]] = {}  # key → (size, mtime) of the file uploaded there

    def where(self, *parts: str) -> str:
        """``parts`` under the run directory: a URL for a run in a bucket, else a path."""
        return join(self.location, *parts)

    # --- a run in a bucket: uploads and downloads ---------------------------------------------

    def upload(self, name: str) -> None:
        """Copy the staged file ``name`` to the bucket (nothing to do for a local run)."""
        if self.store is not None and (self.path / name).is_file():
            self.store.write(name, (self.path / name).read_bytes())

    def upload_tree(self, name: str, key: str | None = None) -> None:
        """Every file under the staged directory ``name`` that changed since its last
        upload, to the bucket under ``key`` (default: ``name``)."""
        if self.store is None:
            return
        root = self.path / name
        for file in sorted(p for p in root.rglob("*") if p.is_file()):
            target = f"{key or name}/{file.relative_to(root).as_posix()}"
            stat = file.stat()
            if self._uploaded.get(target) == (stat.st_size, stat.st_mtime_ns):
                continue  # the sinks' files are uploaded every few seconds; most have not changed
            self.store.write(target, file.read_bytes())
            self._uploaded[target] = (stat.st_size, stat.st_mtime_ns)

    def download(self, *names: str) -> None:
        """Copy the files or directories ``names`` from the bucket into the staging copy
        (those the bucket has)."""
        if self.store is None:
            return
        for name in names:
            blob = self.store.read(name)
            if blob is not None:
                (self.path / name).write_bytes(blob.data)
            for key in self.store.list(f"{name}/"):
                (self.path / key).parent.mkdir(parents=True, exist_ok=True)
                self.store.download(key, self.path / key)

    def _committed_steps(self) -> list[int]:
        assert self.store is not None
        keys = self.store.list("checkpoints/")
        return sorted(int(k[len("checkpoints/") : -len(".commit")]) for k in keys if k.endswith(".commit"))

    def start_fresh(self, cfg: RunConfig, *, write: bool = True) -> None:
        """Begin a new run here: refuse a directory holding another run's checkpoints, drop
        the metrics and summary of an earlier attempt, write the config (``write``: this
        process writes the run's files)."""
        checkpoints = self.path / "checkpoints"
        if self._committed_steps() if self.store is not None else checkpoints.is_dir() and any(checkpoints.iterdir()):
            raise FileExistsError(
                f"{self.location} already holds a run with checkpoints; continue it with --resume "
                f"{self.location}, or start another with --set name=<new name>"
            )
        if self.store is not None and checkpoints.is_dir():
            shutil.rmtree(checkpoints)  # staged by an earlier run of this name that never committed one
        if write:
            for stale in ("metrics.jsonl", "summary.json", *tracking.FILES):
                path = self.path / stale
                if path.is_dir():
                    shutil.rmtree(path)
                path.unlink(missing_ok=True)
                if self.store is not None:
                    for key in [stale, *self.store.list(f"{stale}/")]:
                        self.store.delete(key)
            self.write_config(cfg)

    def write_config(self, cfg: RunConfig) -> None:
        save_config(cfg, self.path / "config.yaml")
        self.upload("config.yaml")

    # --- metrics -----------------------------------------------------------------------

    def append_metrics(self, record: dict[str, Any]) -> None:
        with self.metrics_file.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.store is not None and time.monotonic() - self._metrics_uploaded >= METRICS_UPLOAD_S:
            self._upload_metrics()

    def _upload_metrics(self) -> None:
        """``metrics.jsonl`` and what the metric sinks wrote here, to the bucket."""
        self.upload("metrics.jsonl")
        for name in tracking.FILES:
            self.upload(name)  # a file (nothing for a directory) …
            self.upload_tree(name)  # … or a directory (nothing for a file)
        self._metrics_uploaded = time.monotonic()

    def sync_logs(self) -> None:
        """Upload the metrics and the sinks' files now (a run in a bucket; else nothing)."""
        self._upload_metrics()

    def read_metrics(self) -> list[dict[str, Any]]:
        """Every record; a torn last line (the process was killed while appending it) is
        skipped, a torn line anywhere else is an error naming the file and line."""
        if not self.metrics_file.is_file():
            return []
        lines = self.metrics_file.read_text().split("\n")
        records = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                if number == len(lines):  # no newline after it: the append never finished
                    continue
                raise ValueError(f"{self.metrics_file}: line {number} is not a JSON record ({err.msg})") from None
        return records

    def truncate_metrics(self, last_step: int) -> None:
        """Keep records up to ``last_step``: a resumed run repeats nothing after its checkpoint."""
        kept = [r for r in self.read_metrics() if r.get("step", 0) <= last_step]
        write_text_atomically(self.metrics_file, "".join(json.dumps(r) + "\n" for r in kept))
        self._upload_metrics()

    def write_summary(self, summary: dict[str, Any]) -> None:
        write_text_atomically(self.path / "summary.json", json.dumps(summary, indent=2) + "\n")
        self.upload("summary.json")

    def read_summary(self) -> dict[str, Any]:
        path = self.path / "summary.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    # --- checkpoints -------------------------------------------------------------------

    @property
    def checkpoints(self) -> ocp.CheckpointManager:
        if self._checkpoints is None:
            self._checkpoints = self._open_checkpoints(remove_unfinished=True)
        return self._checkpoints

    def _open_checkpoints(self, remove_unfinished: bool) -> ocp.CheckpointManager:
        """An Orbax manager of ``checkpoints/``.

        ``remove_unfinished``: Orbax deletes every unfinished save there (the
        ``<step>.orbax-checkpoint-tmp`` directory of a run killed while saving) as it opens the
        directory, in the background, and waits for that before its first save.
        """
        # Synchronous saves: the trainer waits for every save anyway, and with a learner over
        # several processes Orbax's background commit and finalize threads each hold a
        # cross-process barrier; seen deadlocked here with process 0 in the finalize barrier
        # and process 1 still in the commit barrier (tests/pipeline/test_multi_process_learner.py).
        each = {"multiprocessing_options": _EACH_PROCESS} if self.part else {}
        return ocp.CheckpointManager(
            self.path / "checkpoints",
            options=ocp.CheckpointManagerOptions(
                max_to_keep=2,
                create=True,
                enable_async_checkpointing=False,
                cleanup_tmp_directories=remove_unfinished,
                **each,
            ),
            item_handlers=_each_process_handlers() if self.part else None,
        )

    def save_checkpoint(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """The train state (as a flat dict of its leaves) and loop metadata, at ``step``.

        Raises:
          CheckpointSaveFailed: the save did not complete (a full disk, a file-size limit, a
            vanished directory); the half-written checkpoint is removed, the earlier ones
            are untouched (Orbax commits a checkpoint by renaming its finished directory).
        """
        leaves = jax.tree_util.tree_leaves(state)
        flat = {f"{i:05d}": leaf for i, leaf in enumerate(leaves)}
        meta = {**meta, "layout": state_layout(state)}  # checked by restore_checkpoint
        state = ocp.args.PyTreeSave(flat) if self.part else ocp.args.StandardSave(flat)
        try:
            self.checkpoints.save(step, args=ocp.args.Composite(state=state, meta=ocp.args.JsonSave(meta)), force=True)
            self.checkpoints.wait_until_finished()
        except Exception as err:  # Orbax and TensorStore report I/O failures as ValueError and others
            # Orbax leaves the failed save's temporary directory (<step>.orbax-checkpoint-tmp) behind.
            # Removed here, before the error is reported, so the directory is as it was before the
            # save; the fresh manager (the failed one may hold the failed save's state) then must not
            # delete it again in the background: with a learner over several processes every
            # process runs this on the shared directory, and Orbax's background deletion failing on
            # a directory another process already removed could fail the next save.
            for partial in (self.path / "checkpoints").glob(f"{step}{ocp.utils.TMP_DIR_SUFFIX}*"):
                shutil.rmtree(partial, ignore_errors=True)
            self._checkpoints = self._open_checkpoints(remove_unfinished=False)
            last = self.latest_checkpoint()
            kept = (
                f"the last good checkpoint is step {last} in {self.path / 'checkpoints' / str(last)}"
                if last is not None
                else "there is no earlier checkpoint"
            )
            raise CheckpointSaveFailed(
                f"saving the checkpoint of step {step} failed ({_io_reason(err)}); {kept}; free space or fix "
                f"the cause, then continue with: asyncopd train --resume {self.location}"
            ) from err
        if self.store is not None:
            self._commit_checkpoint(step)

    def _part_key(self, step: int) -> str:
        """Where this process's checkpoint of ``step`` lives in the bucket."""
        return f"checkpoints/{step}/{self.part}" if self.part else f"checkpoints/{step}"

    def _commit_checkpoint(self, step: int) -> None:
        """Upload the staged checkpoint of ``step`` file by file (each process its part),
        then process 0 writes its commit record and retires the bucket's checkpoints that
        Orbax retired here."""
        assert self.store is not None
        self.upload_tree(f"checkpoints/{step}", key=self._part_key(step))
        distributed.barrier(f"checkpoint {step} uploaded")  # every part is in the bucket
        if not distributed.is_leader():
            return
        self.store.write(
            f"checkpoints/{step}.commit", records.record_bytes({"step": step, "processes": self.processes})
        )
        self._upload_metrics()
        kept = set(self.checkpoints.all_steps())
        for old in self._committed_steps():
            if old not in kept:
                self.store.delete(f"checkpoints/{old}.commit")  # the record first: no resume starts on it
                for key in self.store.list(f"checkpoints/{old}/"):
                    self.store.delete(key)

    def latest_checkpoint(self) -> int | None:
        if self.store is not None:  # the bucket is the record: a staged step may never have been committed
            steps = self._committed_steps()
            return steps[-1] if steps else None
        return self.checkpoints.latest_step()

    def _stage_checkpoint(self, step: int) -> None:
        """Download the bucket's checkpoint of ``step`` (this process's part) into the
        staging copy, replacing whatever is staged under that step, and reopen Orbax's
        manager on it.

        Raises:
          ValueError: the checkpoint was written by another number of learner processes
            (each process's part holds the shards it held)."""
        assert self.store is not None
        commit = self.store.read(f"checkpoints/{step}.commit")
        written_by = int(records.parse(commit).get("processes", 1)) if commit is not None else 1
        if written_by != self.processes:
            raise ValueError(
                f"{self.where('checkpoints', str(step))} was written by a learner over {written_by} process(es); "
                f"this one has {self.processes}: resume it with {written_by}"
            )
        local = self.path / "checkpoints" / str(step)
        shutil.rmtree(local, ignore_errors=True)
        prefix = self._part_key(step) + "/"
        for key in self.store.list(prefix):
            path = local / key[len(prefix) :]
            path.parent.mkdir(parents=True, exist_ok=True)
            self.store.download(key, path)  # streamed: a real checkpoint is larger than memory allows
        if self._checkpoints is not None:
            self._checkpoints.close()
        self._checkpoints = self._open_checkpoints(remove_unfinished=True)

    def restore_checkpoint(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """Restore onto the structure, shapes and shardings of ``abstract_state``.

        Raises:
          CheckpointMismatch: the checkpoint's leaves are not ``abstract_state``'s (by path,
            shape and dtype; a checkpoint written before layouts were recorded is not checked).
        """
        if step is None:  # process 0's answer: the others must restore the same step
            latest = self.latest_checkpoint()
            step = int(distributed.from_leader(-1 if latest is None else latest))
        if step < 0:
            raise FileNotFoundError(f"no checkpoint in {self.where('checkpoints')} to resume from")
        if self.store is not None:
            self._stage_checkpoint(step)
        saved = self.checkpoints.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        self._check_layout(step, saved.get("layout"), state_layout(abstract_state))
        leaves, treedef = jax.tree_util.tree_flatten(abstract_state)
        target = {f"{i:05d}": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for i, x in enumerate(leaves)}
        state = (
            ocp.args.PyTreeRestore(target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))
            if self.part
            else ocp.args.StandardRestore(target)
        )
        flat = self.checkpoints.restore(step, args=ocp.args.Composite(state=state))["state"]
        return jax.tree_util.tree_unflatten(treedef, [flat[k] for k in sorted(flat)]), dict(saved)

    def _check_layout(self, step: int, saved: list[str] | None, wanted: list[str]) -> None:
        """Raise :class:`CheckpointMismatch` naming the first leaf where ``saved`` (the
        checkpoint's layout; None: not recorded) and ``wanted`` differ."""
        if saved is None or saved == wanted:
            return
        first = next((i for i, (a, b) in enumerate(zip(saved, wanted)) if a != b), min(len(saved), len(wanted)))
        was = saved[first] if first < len(saved) else "nothing"
        now = wanted[first] if first < len(wanted) else "nothing"
        raise CheckpointMismatch(
            f"resume: checkpoint {step} in {self.where('checkpoints')} holds a train state of {len(saved)} arrays, "
            f"this config builds {len(wanted)}; array {first} was {was}, is now {now}: resume with the settings "
            "the run was saved with (its config.yaml), such as student.lora's rank, targets and modules_to_save"
        )

    def close(self) -> None:
        if self._checkpoints is not None:
            self._checkpoints.wait_until_finished()
            self._checkpoints.close()

    # --- report ------------------------------------------------------------------------

    def write_report(self, title: str) -> Path:
        """``report.png``: loss, KL signal, accuracy (with EffOPD's jumps, if any) and
        staleness against optimizer steps."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        everything = self.read_metrics()
        records = optimizer_step_records(everything)
        steps = np.array([r["step"] for r in records])
        multi_turn = any("tool_calls_per_answer" in r for r in records)
        fig, axes = plt.subplots(2, 3 if multi_turn else 2, figsize=(16 if multi_turn else 11, 7))
        if multi_turn:  # the tools' use per answer, each teacher's rows apart (over-calling shows here)
            self._plot_episodes(axes[0, 2], axes[1, 2], steps, records)
        panels = [
            (axes[0, 0], "loss", "estimator loss"),
            (axes[0, 1], "reverse_kl_signal", "reverse-KL signal  E[log π − log q] on sampled tokens"),
            (axes[1, 1], "staleness_mean", "mean token staleness (optimizer steps)"),
        ]
        for ax, key, label in panels:
            ys = np.array([r.get(key, np.nan) for r in records], float)
            ax.plot(steps, ys, lw=1)
            ax.set_title(label, fontsize=10)
            ax.set_xlabel("optimizer step")
        teachers = teacher_names(records)
        if len(teachers) > 1:  # each teacher's own KL, on the rows it scored
            ax = axes[0, 1]
            for name in teachers:
                ys = np.array([r.get(teacher_metric(name, "kl"), np.nan) for r in records], float)
                ax.plot(steps, ys, lw=0.8, alpha=0.8, label=f"E[log μ − log q] to {name}")
            ax.legend(fontsize=8)
        ax = axes[1, 0]
        summary = self.read_summary()
        evals = sorted((r["step"], r["eval_accuracy"]) for r in everything if "eval_accuracy" in r)
        if "student_before" in summary:
            evals = [(0, summary["student_before"])] + evals
        if evals:
            ax.plot(*zip(*evals), marker="o", label="student (held-out, greedy)")
        if "teacher_accuracy" in summary:
            ax.axhline(summary["teacher_accuracy"], color="k", ls="--", label="teacher")
        for i, name in enumerate(teachers):  # several teachers: each in-process one's own line
            if f"teacher_accuracy/{name}" in summary:
                ax.axhline(summary[f"teacher_accuracy/{name}"], color="k", ls=("--", ":", "-.")[i % 3], label=name)
        train = np.array([r.get("rollout_accuracy", np.nan) for r in records], float)
        ax.plot(steps, train, lw=0.8, alpha=0.6, label="student rollouts (sampled)")
        # EffOPD jumps: accepted (the factor kept) and rejected (rolled back to θ_t)
        jumps = [(r["step"], r["extrapolation_factor"]) for r in records if "extrapolation_factor" in r]
        for kind, color, style in (("accepted", "tab:green", "--"), ("rejected", "tab:red", ":")):
            chosen = [(st, f) for st, f in jumps if (f != 1) == (kind == "accepted")]
            for i, (st, f) in enumerate(chosen):
                ax.axvline(
                    st, color=color, ls=style, lw=0.9, label=f"extrapolation {kind} ({len(chosen)})" if i == 0 else None
                )
                if kind == "accepted":
                    ax.annotate(f"×{f:g}", (st, 1.0), fontsize=7, color=color, ha="left", va="top")
        ax.set_ylim(0, 1.02)
        ax.set_title("accuracy", fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.legend(fontsize=8)
        fig.suptitle(title)
        fig.tight_layout()
        out = self.path / "report.png"
        fig.savefig(out, dpi=110)
        plt.close(fig)
        self.upload("report.png")
        return out

    @staticmethod
    def _plot_episodes(calls: Any, sizes: Any, steps: np.ndarray, records: list[dict[str, Any]]) -> None:
        """Multi-turn runs: tool calls and turns per answer (and each teacher's), then the
        observation tokens and tool errors per answer and the share of tool time the engine
        kept decoding other answers."""

        def series(key: str) -> np.ndarray:
            return np.array([r.get(key, np.nan) for r in records], float)

        for key, label in (("tool_calls_per_answer", "tool calls"), ("turns_per_answer", "turns")):
            calls.plot(steps, series(key), lw=1, label=label)
        for name in teacher_names(records):
            if len(teacher_names(records)) > 1:
                calls.plot(steps, series(teacher_metric(name, "tool_calls_per_answer")), lw=0.8, label=f"calls: {name}")
        calls.set_title("per answer", fontsize=10)
        sizes.plot(steps, series("observation_tokens_per_answer"), lw=1, label="observation tokens")
        sizes.plot(steps, series("tool_errors_per_answer"), lw=1, label="tool errors")
        sizes.plot(steps, series("environment_overlap"), lw=1, label="tool time overlapped (share)")
        sizes.set_title("per answer; overlap: a share", fontsize=10)
        for ax in (calls, sizes):
            ax.set_xlabel("optimizer step")
            ax.legend(fontsize=8)
