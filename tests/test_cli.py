"""The command line: bad input is a clear one-line error (exit 2), never a traceback."""

from __future__ import annotations

import pytest

from asyncopd_jax import configs
from asyncopd_jax.cli import main
from asyncopd_jax.config import ConfigError, check_resume_changes, load_config, save_config
from asyncopd_jax.models import save_pretrained
from asyncopd_jax.tasks.builtin import new_model
from asyncopd_jax.tasks.tokenizer import save_tokenizer
from tests.models.test_tokenizer import make_tokenizer


def _error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_unknown_field_and_wrong_estimator(capsys):
    assert "unknown config field train.stpes" in _error(capsys, ["train", "--set", "train.stpes=3"])
    err = _error(capsys, ["train", "--set", "estimator.name=forward_kl"])
    assert "estimator.name = 'forward_kl' is invalid; allowed:" in err and "reverse_kl_mc" in err


def test_top_p_with_an_mc_estimator(capsys):
    err = _error(
        capsys,
        [
            "train",
            "--set",
            "estimator.name=reverse_kl_mc",
            "--set",
            "sampling.num_candidates=4",
            "--set",
            "sampling.top_p=0.95",
        ],
    )
    assert "allow_truncated_mc" in err


def test_missing_model_directory(capsys, tmp_path):
    err = _error(capsys, ["train", "--set", f"student.path={tmp_path / 'nowhere'}", "--set", f"output_dir={tmp_path}"])
    assert f"model directory not found: {tmp_path / 'nowhere'}" in err
    assert "no built-in model 'tutor'" in _error(capsys, ["eval", "--model", "builtin:tutor"])


def test_mismatched_vocabularies(capsys, tmp_path):
    save_pretrained(new_model("student", 0), tmp_path / "student")
    save_tokenizer(tmp_path / "student")
    save_pretrained(new_model("student", 1), tmp_path / "teacher")
    make_tokenizer(tmp_path / "teacher", ["x", "y"])  # another vocabulary
    err = _error(
        capsys,
        [
            "train",
            "--set",
            f"student.path={tmp_path / 'student'}",
            "--set",
            f"teacher.path={tmp_path / 'teacher'}",
            "--set",
            f"output_dir={tmp_path}",
        ],
    )
    # another vocabulary is a cross-tokenizer teacher, if its tokens can spell the student's text
    assert "teacher 'teacher': its tokenizer" in err and "cannot spell 16 of the student's tokens" in err


def test_resume_without_a_run(capsys, tmp_path):
    assert "cannot resume" in _error(capsys, ["train", "--resume", str(tmp_path / "runs" / "x")])


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert all(c in out for c in ("train", "sft", "eval"))


def test_sft_writes_a_loadable_model_and_eval_reads_it(capsys, tmp_path):
    out = tmp_path / "sft"
    assert (
        main(
            [
                "sft",
                "--model",
                "student",
                "--steps",
                "3",
                "--batch-size",
                "8",
                "--task",
                "eval_prompts=8",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert "held-out accuracy" in capsys.readouterr().out
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (out / name).is_file(), name
    assert main(["eval", "--model", str(out), "--task", "eval_prompts=8"]) == 0
    assert f"held-out accuracy of {out}" in capsys.readouterr().out
    assert main(["eval", "--model", "builtin:teacher", "--task", "eval_prompts=64"]) == 0
    teacher = float(capsys.readouterr().out.rsplit(":", 1)[1].strip().rstrip("%"))
    assert teacher >= 90.0  # the shipped teacher solves the held-out problems


def test_malformed_or_missing_config_files_name_the_file_and_line(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: demo\ntask: {difficulty: 3\nseed: 1\n")
    err = _error(capsys, ["train", "--config", str(bad)])
    assert f"{bad} is not valid YAML at line" in err and err.count("\n") == 1
    listing = tmp_path / "list.yaml"
    listing.write_text("- name\n- seed\n")
    assert "must hold a mapping of config sections" in _error(capsys, ["train", "--config", str(listing)])
    err = _error(capsys, ["train", "--config", str(tmp_path / "nowhere.yaml")])
    assert f"config file not found: {tmp_path / 'nowhere.yaml'}" in err and "bundled config: demo" in err


def test_bundled_configs_load_by_name():
    assert load_config("rl").algorithm == "rl" and load_config("rl.yaml") == load_config(configs.RL)
    assert load_config("demo") == load_config(configs.DEMO)
    assert {"demo", "rl"} <= set(configs.names())


def test_an_unusable_output_directory_is_one_line(capsys, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    err = _error(capsys, ["train", "--set", f"output_dir={blocker / 'runs'}", "--set", "train.steps=1"])
    assert str(blocker) in err


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(ConfigError, match="unknown config field train.stpes"):
        main(["train", "--debug", "--set", "train.stpes=3"])


def test_resume_refuses_changes_that_alter_the_computation(capsys, tmp_path):
    run = tmp_path / "runs" / "x"
    run.mkdir(parents=True)
    save_config(load_config("demo"), run / "config.yaml")
    err = _error(capsys, ["train", "--resume", str(run), "--set", "optim.learning_rate=0.5", "--set", "seed=5"])
    assert "optim.learning_rate (0.003 → 0.5)" in err and "seed (0 → 5)" in err
    assert "allowed changes: train.steps" in err
    assert "--set instead of --config" in _error(capsys, ["train", "--resume", str(run), "--config", "demo"])
    saved = load_config(run / "config.yaml")
    check_resume_changes(saved, load_config(run / "config.yaml", ["train.steps=999", "train.eval_every=7"]))
    # each process of a learner over several resumes with its own id and its coordinator's address
    where = ["distributed.initialize=true", "distributed.process_id=1", "distributed.coordinator_address=h:1"]
    check_resume_changes(saved, load_config(run / "config.yaml", where))
    err = _error(capsys, ["train", "--resume", str(run), "--set", "stages.rollouts=3"])
    assert "stages.rollouts (1 → 3)" in err and "distributed.*" in err


@pytest.mark.parametrize(
    ("platform", "devices", "expected"),
    [
        (
            "tpu",
            "0-3",
            {"TPU_VISIBLE_CHIPS": "0,1,2,3", "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,2,1", "TPU_PROCESS_PORT": "8480"},
        ),
        ("gpu", "4,5", {"CUDA_VISIBLE_DEVICES": "4,5"}),
        ("cpu", "4,5", {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}),  # two of its own
    ],
)
def test_a_stage_started_by_hand_takes_its_devices_before_jax_starts(
    monkeypatch, tmp_path, platform, devices, expected
):
    """``asyncopd stage --devices`` (what launch/stage_host.sh passes): the platform's own
    variables, set in this process before the stage imports JAX; one process, several chips."""
    import os

    from asyncopd_jax.pipeline import stage_main

    monkeypatch.setattr(os, "environ", {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
    seen = {}
    monkeypatch.setattr(stage_main, "run_stage", lambda *args: seen.update(os.environ) or 0)
    argv = ["stage", "rollout", "--exchange", str(tmp_path), "--index", "3", "--devices", devices]
    assert main([*argv, "--platform", platform]) == 0
    assert {k: seen.get(k) for k in expected} == expected
    monkeypatch.setattr(os, "environ", {**os.environ, "JAX_PLATFORMS": platform.replace("gpu", "cuda")})
    seen.clear()
    assert main(argv) == 0  # no --platform: this host's, here from JAX_PLATFORMS
    assert {k: seen.get(k) for k in expected} == expected


def test_the_launch_scripts_pass_each_stage_process_its_devices():
    """launch/common.sh turns a ROLLOUT_DEVICES entry into the options above: several chips
    for one TPU process ("0-3"), nothing for a CPU one."""
    import subprocess

    def args(kind: str, device: str) -> str:
        command = f"source launch/common.sh && stage_device_args {kind} '{device}'"
        return subprocess.run(["bash", "-c", command], capture_output=True, text=True, check=True).stdout.strip()

    assert args("tpu", "0-3") == "--platform tpu --devices 0-3"
    assert args("cuda", "4,5") == "--platform gpu --devices 4,5"
    assert args("cpu", "0-7") == ""


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--config", "gs://b/demo.yaml"],
        ["sft", "--model", "student", "--out", "s3://b/student"],
        ["sft", "--model", "student", "--out", "d", "--init", "gs://b/m"],
        ["study", "staleness", "--work", "gs://b/work"],
        ["study", "staleness", "--out", "gs://b/out"],
        ["plan", "--topology", "v6e-8", "--config", "gs://b/c.yaml"],
    ],
)
def test_a_storage_url_argument_is_refused_in_one_line(capsys, argv):
    url = next(a for a in argv if "://" in a)
    with pytest.raises(SystemExit) as exited:  # argparse's exit on a bad argument
        main(argv)
    assert exited.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after argparse's usage lines
    assert "error: argument --" in last and f"{url!r} is a storage URL" in last, last
    assert "may be in a bucket" in last
