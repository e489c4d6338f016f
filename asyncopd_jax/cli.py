# fmt: off
"""The ``asyncopd`` command: ``train``, ``sft``, ``eval``, ``study``, ``plan``, ``serve-teacher`` and ``stage``.

    asyncopd train                                  # the bundled demo (asyncopd_jax/configs/demo.yaml)
    asyncopd train --config rl                      # a bundled config by name: demo, rl, …
    asyncopd train --config my.yaml --set learner.batch_size=64 --set schedule.mode=sync
    asyncopd train --set stages.placement=processes   # stages in their own processes
    asyncopd train --resume runs/demo               # continue a stopped or killed run
    asyncopd stage rollout --exchange runs/demo/exchange --index 3   # one more stage process
    asyncopd sft --model teacher --steps 1000 --out asyncopd_jax/tasks/assets/teacher
    asyncopd eval --model builtin:student
    asyncopd eval --model builtin:teacher_long --task lengths=long_tailed --task difficulty=2   # + by length
    asyncopd study cache_bias_variance --quick      # a study's report in docs/study/
    asyncopd plan --config qwen3_1.7b_from_8b_v5e16 --topology v5e-16   # does it fit? (compiled, not run)
    asyncopd serve-teacher --model builtin:teacher --port 8000   # a run's teacher.server (api: asyncopd)
"""
# fmt: on

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import logging
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from flax import nnx

from asyncopd_jax import configs
from asyncopd_jax.atomic_files import write_text_atomically
from asyncopd_jax.config import (
    ConfigError,
    OptimConfig,
    TaskConfig,
    check_resume_changes,
    load_config,
    migrate_saved_config,
)
from asyncopd_jax.config_checks import storage_url_error
from asyncopd_jax.storage.location import SCHEMES, is_url, join, open_store, staging_dir
from asyncopd_jax.studies.training_runs import default_jobs
from asyncopd_jax.teacher import wire

if TYPE_CHECKING:
    from asyncopd_jax.models import Decoder
    from asyncopd_jax.tasks import TaskData, ToolTaskData

DEMO_CONFIG = configs.DEMO


def _plan(args: argparse.Namespace) -> None:
    from asyncopd_jax.pipeline.host_env import cpu_device_flags
    from asyncopd_jax.scale.chips import get_topology, proxy_devices_needed
    from asyncopd_jax.scale.plan import Shapes, make_plan
    from asyncopd_jax.scale.report import format_plan

    proxies = proxy_devices_needed(args.topology)
    if proxies:  # XLA:CPU devices stand in for the GPUs: set before JAX starts its CPU client
        os.environ["XLA_FLAGS"] = cpu_device_flags(proxies, os.environ.get("XLA_FLAGS", ""))
    import jax

    jax.config.update("jax_platforms", "cpu")  # compile for the topology; never touch a local accelerator
    cfg = load_config(args.config or DEMO_CONFIG, args.set)
    response = args.response_tokens or cfg.sampling.max_new_tokens
    shapes = Shapes(prompt_tokens=args.prompt_tokens, response_tokens=response, layers=args.layers)
    if args.storage_gbps <= 0:
        raise ValueError(f"--storage-gbps {args.storage_gbps:g} is invalid; expected GB/s > 0")
    settings = {"mean_response_tokens": args.mean_response_tokens, "storage_bytes_per_s": args.storage_gbps * 1e9}
    topology = get_topology(args.topology)
    if args.balance:
        from asyncopd_jax.scale.report import format_balanced
        from asyncopd_jax.scale.search import balance_split

        start = time.monotonic()

        def progress(line: str) -> None:
            print(f"[balance {time.monotonic() - start:5.0f} s] {line}", file=sys.stderr, flush=True)

        found = balance_split(cfg, topology, shapes, **settings, progress=progress, chips_per_host=args.chips_per_host)
        print(format_balanced(found))
    else:
        print(format_plan(make_plan(cfg, topology, shapes, **settings)))


def _train(args: argparse.Namespace) -> None:
    from asyncopd_jax.pipeline.trainer import Trainer

    if args.resume:
        run = args.resume.rstrip("/")
        config_file = _saved_config(run)
        if args.config is not None:
            raise ConfigError("--resume reads the run's own config.yaml; change fields with --set instead of --config")
        moves = migrate_saved_config(config_file)
        if moves:  # printed once: the file now holds the current names
            renamed = ", ".join(moves)
            print(f"asyncopd train: {config_file} now uses the current field names: {renamed}", file=sys.stderr)
        cfg = load_config(config_file, args.set)
        check_resume_changes(load_config(config_file), cfg)
        parent, name = run.rsplit("/", 1) if is_url(run) else (str(Path(run).parent), Path(run).name)
        cfg = cfg.__class__(**{**cfg.__dict__, "name": name, "output_dir": parent})
    else:
        cfg = load_config(args.config or DEMO_CONFIG, args.set)
    from asyncopd_jax.config import check_learner_processes
    from asyncopd_jax.pipeline.host_env import detect_platform, prepare_learner_process
    from asyncopd_jax.pipeline.layout import describe, plan_layout

    layout = plan_layout(
        cfg,
        run_path=join(cfg.output_dir, cfg.name),
        available_cores=sorted(os.sched_getaffinity(0)),
        multi_process=cfg.distributed.initialize,
    )
    print(
        f"asyncopd train: {cfg.name} ({cfg.estimator.name}, {cfg.schedule.mode}, {layout.placement}) → "
        f"{join(cfg.output_dir, cfg.name)}"
    )
    print("\n".join(describe(layout)))
    prepare_learner_process(layout, detect_platform())  # before JAX starts in this process
    if cfg.distributed.initialize:
        import jax

        from asyncopd_jax.learner import distributed

        distributed.initialize(cfg.distributed)  # before anything else starts JAX here
        check_learner_processes(cfg, jax.process_count())  # the count the environment gave, when the config did not
    # planned before this process pinned itself (a plan made after would see only the learner's cores)
    summary = Trainer(cfg, resume=bool(args.resume), progress=not args.no_progress, layout=layout).run()
    teacher = summary.get("teacher_accuracy")  # absent: reward-driven RL without a teacher
    rows = [("teacher", teacher)] if teacher is not None else []
    rows += [("student before", summary["student_before"]), ("student after", summary["student_after"])]
    print(f"\nheld-out accuracy (at most {cfg.task.eval_prompts} problems, greedy):")
    for name, value in rows:
        print(f"  {name:15} {value:6.1%}" if value == value else f"  {name:15}    n/a (no reference answers)")
    if teacher is not None and teacher == teacher:
        ratio = summary["student_after"] / max(teacher, 1e-9)
        print(f"  student after / teacher = {ratio:.1%}")
    print(f"wrote {join(cfg.output_dir, cfg.name)}/: config.yaml metrics.jsonl trace.json checkpoints/ report.png")


def _saved_config(run: str) -> Path:
    """The config a run saved, as a local file (downloaded into the staging copy of a run
    in a bucket)."""
    if not is_url(run):
        config_file = Path(run) / "config.yaml"
        if not config_file.is_file():
            raise ConfigError(f"cannot resume: {config_file} does not exist")
        return config_file
    blob = open_store(run).read("config.yaml")
    if blob is None:
        raise ConfigError(f"cannot resume: {run}/config.yaml does not exist")
    config_file = staging_dir(run) / "config.yaml"
    config_file.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(config_file, blob.data.decode())  # the learner processes of one host race here
    return config_file


def _sft(args: argparse.Namespace) -> None:
    import numpy as np

    from asyncopd_jax.learner.sft import train_sft
    from asyncopd_jax.models import save_pretrained
    from asyncopd_jax.tasks import new_model, padded_vocab, sft_data
    from asyncopd_jax.tasks.tokenizer import build_tokenizer

    task = load_config(None, [f"task.{kv}" for kv in args.task]).task if args.task else TaskConfig()
    tokenizer = build_tokenizer(args.tokenizer)
    data = sft_data(task, tokenizer)
    rng = np.random.default_rng(args.seed)
    batches = iter(lambda: data.sft_batch(rng, args.batch_size), None)
    optim = OptimConfig(
        learning_rate=args.lr, warmup_steps=50, schedule="cosine", final_lr_fraction=0.05, weight_decay=0.01
    )

    def log(step, metrics, graphdef, params):
        if step % max(args.steps // 10, 1) == 0 or step == args.steps:
            print(f"step {step:5d}  nll {metrics['loss']:.4f}  {metrics['seconds']:.0f} s", flush=True)

    model = new_model(args.model, args.seed, padded_vocab(len(tokenizer)))
    if args.init:
        _initialise_from(model, args.init)
    model = train_sft(model, batches, args.steps, optim, on_step=log)
    accuracy = data.accuracy(*nnx.split(model))
    save_pretrained(model, args.out)
    tokenizer.save_pretrained(args.out)
    print(f"held-out accuracy (greedy, {task.eval_prompts} problems): {accuracy:.1%}; saved to {args.out}")
    _print_accuracy_by_length(data, model)


def _initialise_from(model: Decoder, path: str) -> None:
    """Copy the weights of the model at ``path`` (``builtin:NAME`` or a directory) into
    ``model``: the same architecture, the context (``max_position_embeddings``) aside."""
    import dataclasses

    from asyncopd_jax.models import DecoderConfig
    from asyncopd_jax.pipeline.model_loading import load_model_and_tokenizer

    source, _ = load_model_and_tokenizer(path, "float32")
    config = getattr(source, "config", None)
    if isinstance(config, DecoderConfig):  # the context aside
        config = dataclasses.replace(config, max_position_embeddings=model.config.max_position_embeddings)
    if config != model.config:
        raise ValueError(f"--init {path}: its config.json is not the architecture of --model (context aside)")
    nnx.update(model, nnx.state(source, nnx.Param))


def _print_accuracy_by_length(data: TaskData | ToolTaskData, model: nnx.Module) -> None:
    """For ``task.lengths = long_tailed``: the held-out accuracy per operand-count bucket."""
    if not hasattr(data, "accuracy_by_length") or data.task.lengths != "long_tailed":
        return
    per_bucket = 64
    print(f"by operands (greedy, {per_bucket} held-out problems each):")
    for low, high, accuracy in data.accuracy_by_length(*nnx.split(model), per_bucket=per_bucket):
        print(f"  {low if low == high else f'{low}-{high}':>6}  {accuracy:6.1%}", flush=True)


def _eval(args: argparse.Namespace) -> None:
    from asyncopd_jax.pipeline.model_loading import load_model_and_tokenizer
    from asyncopd_jax.tasks.builtin import TaskData

    task = load_config(None, [f"task.{kv}" for kv in args.task]).task if args.task else TaskConfig()
    model, tokenizer = load_model_and_tokenizer(args.model, "float32")
    data = TaskData(task, tokenizer)
    print(
        f"held-out accuracy of {args.model} (greedy, {task.eval_prompts} problems): "
        f"{data.accuracy(*nnx.split(model)):.1%}"
    )
    _print_accuracy_by_length(data, model)


def _study(args: argparse.Namespace) -> None:
    import shlex

    from asyncopd_jax.studies import get_study
    from asyncopd_jax.studies.report import log_figures

    run = get_study(args.name)
    for flag, value in (("--seeds", args.seeds), ("--jobs", args.jobs)):
        if value < 1:
            raise ValueError(f"{flag} = {value} is invalid; allowed: >= 1")
    quick = ["--quick"] if args.quick else []
    command = shlex.join(["asyncopd", "study", args.name, *quick, "--seeds", str(args.seeds)])
    args.out.mkdir(parents=True, exist_ok=True)
    path = run(args.out, args.work, quick=args.quick, seeds=args.seeds, jobs=args.jobs, command=command)
    print(f"asyncopd study: wrote {path}")
    if args.sinks:  # the report's plots, as the images of a run of their own
        where = log_figures(path, args.work, args.sinks, {"study": args.name, "command": command})
        print(f"asyncopd study: its plots went to {', '.join(args.sinks)} (run study-{args.name}, files in {where})")


def _serve_teacher(args: argparse.Namespace) -> None:
    import jax

    from asyncopd_jax.config import MeshConfig, ModelSource
    from asyncopd_jax.config_checks import parse_id_list
    from asyncopd_jax.pipeline.devices import stage_mesh
    from asyncopd_jax.pipeline.model_loading import load_model
    from asyncopd_jax.teacher.batch_scorer import BatchScorer, ServerSettings
    from asyncopd_jax.teacher.server import prefix_trees, serve

    local = jax.local_devices()
    ids = parse_id_list(args.devices) if args.devices else list(range(len(local)))
    if max(ids) >= len(local):
        raise ValueError(
            f"--devices {args.devices} names device {max(ids)}; this host has {len(local)} (0-{len(local) - 1})"
        )
    try:
        axes = {k: int(v) for k, v in (item.split("=") for item in args.mesh.split(","))} if args.mesh else {}
        mesh_config = MeshConfig(**axes)
    except (ValueError, TypeError) as err:
        raise ValueError(f"--mesh {args.mesh!r} is invalid; allowed: e.g. data=1,tensor=4 ({err})") from None
    mesh = stage_mesh([local[i] for i in ids], mesh_config)
    model = load_model(ModelSource(path=args.model, dtype=args.dtype), None, mesh)
    settings = ServerSettings(
        model_name=args.name,
        max_topk=args.max_topk,
        temperature=args.temperature,
        max_rows=args.max_rows,
        max_wait_ms=args.max_wait_ms,
        queue_rows=args.queue_rows,
        max_request_rows=args.max_request_rows,
    )
    scorer = BatchScorer(model, settings, mesh)
    print(
        f"asyncopd serve-teacher: {args.model} as {args.name!r} on {len(ids)} device(s) "
        f"({dict(mesh.shape)}) at http://{args.host}:{args.port}",
        flush=True,
    )
    serve(scorer, settings, args.host, args.port, prefix_trees(model, args.model, args.temperature))


def _stage(args: argparse.Namespace) -> int:
    from asyncopd_jax.config_checks import parse_id_list
    from asyncopd_jax.pipeline.host_env import detect_platform, device_env, stage_port

    if args.devices:  # before JAX's runtime starts: the platform's own variables give this process its devices
        platform = args.platform or detect_platform()
        os.environ.update(device_env(platform, parse_id_list(args.devices), stage_port(args.index)))
    from asyncopd_jax.pipeline.stage_main import run_stage

    cores = parse_id_list(args.cores)
    return run_stage(
        args.exchange, args.role, args.index, cores, args.parent_pid, args.niceness, args.wait_for_exchange
    )


@contextlib.contextmanager
def _library_log_to_file() -> Iterator[Path]:
    """Send Python logging (Orbax, absl, asyncio) to a file instead of the terminal while the
    command runs: a failed checkpoint write makes Orbax log its traceback before it raises,
    and the user should see one line saying what happened. The file appears only if
    something is logged; the previous logging setup is restored afterwards."""
    path = Path(tempfile.gettempdir()) / f"asyncopd-{os.getpid()}.log"
    handler = logging.FileHandler(path, delay=True)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    saved = root.handlers[:], root.level, sys.unraisablehook
    root.handlers, root.level = [handler], logging.WARNING
    # TensorStore's callbacks into Orbax's closed event loop after a failed write end as
    # unraisable exceptions ("Event loop is closed"): to the same file.
    sys.unraisablehook = lambda u: logging.getLogger("unraisable").error(
        "%s: %s",
        u.err_msg or "unraisable exception",
        u.exc_value,
        exc_info=(u.exc_type, u.exc_value, u.exc_traceback),  # type: ignore[arg-type]  # exc_value may be None
    )
    try:
        yield path
    finally:
        handler.close()
        root.handlers, root.level, sys.unraisablehook = saved


def main(argv: list[str] | None = None) -> int:
    # `kill -USR1 <pid>`: every thread's stack on stderr, for a run that seems stuck (not where
    # stderr has no file descriptor, e.g. captured in-process by a test)
    with contextlib.suppress(AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both of the last
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    args = _parser().parse_args(argv)
    if args.command == "stage":
        return args.fn(args)  # its own exit status; errors go to its log
    with contextlib.nullcontext() if args.debug else _library_log_to_file() as log:
        return _run(args, log)


def _run(args: argparse.Namespace, log: Path | None) -> int:
    """Run the command; the user's mistakes and I/O failures are one line on stderr."""
    try:
        args.fn(args)
    except (ConfigError, OSError, ValueError) as err:  # the user's input or environment, not a bug here
        if args.debug:
            raise
        details = f"details in {log}; " if log is not None and log.is_file() else ""
        print(f"asyncopd {args.command}: error: {err} ({details}--debug shows the traceback)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\nasyncopd {args.command}: interrupted; resume with --resume", file=sys.stderr)
        return 130
    return 0


# ---------------------------------------------------------------------------------------
# the command line: one builder per sub-command, each setting ``fn`` to the function that runs it

_SubCommands = argparse._SubParsersAction  # what add_subparsers returns; add_parser makes a sub-command


def _local_path(value: str) -> str:
    """An argument that names a file or directory here (argparse names the argument in
    the error: ``argument --resume: 'gs://…' is a storage URL (gs://); …``)."""
    error = storage_url_error(None, value)
    if error:
        raise argparse.ArgumentTypeError(error)
    return value


def _local_dir(value: str) -> Path:
    return Path(_local_path(value))


def _storage_location(value: str) -> str:
    """An argument that names a local path or a bucket (``gs://…``, ``s3://…``)."""
    url = is_url(value) and value.split("://", 1)[0].lower()
    if url and url not in SCHEMES:
        raise argparse.ArgumentTypeError(
            f"{value!r}: {url}:// is not a storage this tool reads; allowed: a path, gs://, s3://"
        )
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncopd", description="Asynchronous on-policy distillation in JAX.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug",
        action="store_true",
        help="show the full traceback of an error (by default: one line naming what to fix)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_train, _add_sft, _add_eval, _add_study, _add_plan, _add_serve_teacher, _add_stage):
        add(sub, common)
    return parser


def _add_train(sub: _SubCommands, common: argparse.ArgumentParser) -> None:
    train = sub.add_parser(
        "train", parents=[common], help="distil a student from a teacher (default: the built-in demo)"
    )
    train.add_argument(
        "--config",
        type=_local_path,
        help=f"a YAML file or a bundled config: {', '.join(configs.names())} (default: demo)",
    )
    train.add_argument("--set", action="append", default=[], metavar="A.B=C", help="override a config field")
    train.add_argument(
        "--resume",
        type=_storage_location,
        metavar="RUN_DIR",
        help="continue runs/<name> (or gs://…/<name>, s3://…/<name>) from its last checkpoint",
    )
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.set_defaults(fn=_train)


def _add_sft(sub: _SubCommands, common: argparse.ArgumentParser) -> None:
    sft = sub.add_parser(
        "sft", parents=[common], help="train a built-in model on the built-in task by supervised fine-tuning"
    )
    sft.add_argument(
        "--model",
        choices=["teacher", "student", "teacher_long", "student_long", "teacher_moe"],
        required=True,
        help="a built-in size (the _long ones: a context of 1024 positions, for task.lengths=long_tailed; "
        "teacher_moe: the teacher's widths with a mixture of 8 experts in each layer)",
    )
    sft.add_argument(
        "--tokenizer",
        choices=["characters", "merges", "tools", "tools_merges"],  # tasks.tokenizer.TOKENIZER_KINDS (a test checks)
        default="characters",
        help="the built-in tokenizer: one token per character, 64 byte-pair merges of them (the other-tokenizer "
        "student of cross-tokenizer distillation), the tool task's characters, or 64 merges of those",
    )
    sft.add_argument("--steps", type=int, default=1000)
    sft.add_argument("--batch-size", type=int, default=64)
    sft.add_argument("--lr", type=float, default=3e-3)
    sft.add_argument("--seed", type=int, default=0)
    sft.add_argument(
        "--init",
        type=_local_path,
        default="",
        help="start from this model's weights (builtin:NAME or a directory; same architecture)",
    )
    sft.add_argument("--task", action="append", default=[], metavar="FIELD=VALUE", help="task config field")
    sft.add_argument("--out", type=_local_dir, required=True, help="output directory (Hugging Face layout)")
    sft.set_defaults(fn=_sft)


def _add_eval(sub: _SubCommands, common: argparse.ArgumentParser) -> None:
    ev = sub.add_parser("eval", parents=[common], help="held-out accuracy of a model on the built-in task")
    ev.add_argument("--model", type=_storage_location, required=True, help="builtin:NAME, a directory, a bucket URL")
    ev.add_argument("--task", action="append", default=[], metavar="FIELD=VALUE", help="task config field")
    ev.set_defaults(fn=_eval)


def _add_study(sub: _SubCommands, common: argparse.ArgumentParser) -> None:
    study = sub.add_parser("study", parents=[common], help="run a study and write its report (docs/study/NAME.md)")
    study.add_argument(
        "name",
        help="the study: kl_direction (E1), stabilisers (E2), cache_bias_variance (E3), "
        "throughput (E4), rl_staleness (AReaL's η ablation), extrapolation (EffOPD), cross_tokenizer "
        "(a teacher of another tokenizer), multi_turn, lora (LoRA students against full training)",
    )
    study.add_argument("--quick", action="store_true", help="a minutes-long version (its numbers are not findings)")
    study.add_argument("--seeds", type=int, default=3, help="independent seeds")
    study.add_argument("--out", type=_local_dir, default=Path("docs/study"), help="where the report goes")
    study.add_argument("--work", type=_local_dir, default=Path("runs/study"), help="where the study's runs go")
    study.add_argument(
        "--jobs",
        type=int,
        default=default_jobs(),
        help="training runs side by side, each pinned to its own cores (default: one per core)",
    )
    sinks = ("tensorboard", "wandb", "mlflow")  # as logging.sinks
    study.add_argument("--sinks", nargs="+", choices=sinks, default=[], help="also log the report's plots to these")
    study.set_defaults(fn=_study)


def _add_plan(sub: _SubCommands, common: argparse.ArgumentParser) -> None:
    plan = sub.add_parser(
        "plan",
        parents=[common],
        help="compile every stage of a config for a TPU slice or GPU node (shapes only) and print what each "
        "chip holds, its FLOPs and roofline time",
    )
    plan.add_argument("--config", type=_local_path, help="a YAML file or a bundled config (default: demo)")
    plan.add_argument("--set", action="append", default=[], metavar="A.B=C", help="override a config field")
    plan.add_argument("--topology", required=True, help="v5e-16, v6e-8, v5p-8 (TPU: libtpu), h100-8 (XLA:CPU proxy)")
    plan.add_argument("--prompt-tokens", type=int, default=512, help="prompt slots P (default 512)")
    plan.add_argument(
        "--response-tokens", type=int, default=0, help="response slots T (default: sampling.max_new_tokens)"
    )
    plan.add_argument("--layers", type=int, default=None, help="compile this many layers (a quick, reduced plan)")
    plan.add_argument(
        "--balance",
        action="store_true",
        help="search the split of the topology's chips among learner, sampler and teacher that samples fastest",
    )
    plan.add_argument(
        "--mean-response-tokens",
        type=float,
        default=None,
        help="answer tokens expected per sample, for the continuous engine's decode (default: every answer to T)",
    )
    plan.add_argument(
        "--chips-per-host",
        type=int,
        default=None,
        help="--balance: chips one host holds (default: all); a stage off the learner's host swaps through storage",
    )
    plan.add_argument(
        "--storage-gbps",
        type=float,
        default=1.0,
        help="GB/s a snapshot is written and read at when it goes through storage (stage processes; default 1)",
    )
    plan.set_defaults(fn=_plan)


def _add_serve_teacher(sub: _SubCommands, common: argparse.ArgumentParser) -> None:
    served = sub.add_parser(
        "serve-teacher",
        parents=[common],
        help="serve a teacher model over HTTP: vLLM's completions API, plus the scoring of the student's "
        "candidates (a run's teacher.server.api: asyncopd)",
    )
    served.add_argument(
        "--model", type=_storage_location, required=True, help="builtin:NAME, a directory, a bucket URL"
    )
    served.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    served.add_argument("--name", default="teacher", help="the model's name in the API (default: teacher)")
    served.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: loopback only)")
    served.add_argument("--port", type=int, default=8000)
    served.add_argument("--devices", default="", help="this host's devices to hold the teacher, e.g. 0-3 (default all)")
    served.add_argument("--mesh", default="", help="how the devices split the teacher, e.g. data=1,tensor=4")
    served.add_argument("--max-topk", type=int, default=32, help="the largest top-K a request may ask")
    served.add_argument("--temperature", type=float, default=1.0, help="the teacher's distribution softmax(z / T)")
    served.add_argument("--max-rows", type=int, default=wire.BATCH_ROWS, help="rows scored in one batch")
    served.add_argument("--max-wait-ms", type=float, default=5.0, help="how long a batch waits for more rows")
    served.add_argument("--queue-rows", type=int, default=1024, help="rows queued at most (then 503)")
    served.add_argument("--max-request-rows", type=int, default=256, help="rows in one request at most (then 413)")
    served.set_defaults(fn=_serve_teacher)


def _add_stage(sub: _SubCommands, common: argparse.ArgumentParser) -> None:
    stage = sub.add_parser(
        "stage",
        parents=[common],
        help="run one rollout or scoring process of a run started with "
        "stages.placement=processes (started for you; by hand on other hosts)",
    )
    stage.add_argument("role", choices=["rollout", "scoring"])
    stage.add_argument(
        "--exchange",
        type=_storage_location,
        required=True,
        help="the run's exchange: runs/<name>/exchange, or its bucket URL (gs://…/exchange, s3://…/exchange)",
    )
    stage.add_argument("--index", type=int, default=0, help="this process's number within its role")
    stage.add_argument("--cores", default="", help="CPU list to pin to before JAX starts, e.g. 2-3")
    stage.add_argument("--parent-pid", type=int, default=None, help="exit when this process is no longer the parent")
    stage.add_argument("--niceness", type=int, default=0, help="lower this process's CPU priority by this much")
    stage.add_argument(
        "--wait-for-exchange",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="wait this long for the learner to set the exchange up (default: not at all)",
    )
    stage.add_argument(
        "--devices",
        default="",
        help="this host's devices for this process, e.g. 0-3 (TPU chips, GPUs; on a CPU: how many XLA:CPU devices)",
    )
    stage.add_argument(
        "--platform",
        choices=["cpu", "gpu", "tpu"],
        default=None,
        help="whose device variables --devices sets (default: this host's, from JAX_PLATFORMS or its device files)",
    )
    stage.set_defaults(fn=_stage)


if __name__ == "__main__":
    sys.exit(main())
