"""A non-editable install works: the wheel carries the bundled configs and the built-in
models, and ``asyncopd train`` runs from it outside the source tree."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_ships_the_configs_and_runs_the_main_job(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(ROOT)], check=True, cwd=tmp_path)
    wheel = next((tmp_path / "dist").glob("asyncopd_jax-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ("asyncopd_jax/configs/demo.yaml", "asyncopd_jax/configs/rl.yaml",
                   "asyncopd_jax/tasks/assets/teacher/model.safetensors",
                   "asyncopd_jax/tasks/assets/student/tokenizer.json"):
        assert needed in names, needed
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)  # a pure-Python wheel installs by unpacking
    work = tmp_path / "elsewhere"  # not the source tree: nothing can come from the checkout
    work.mkdir()
    script = ("import sys, asyncopd_jax; assert asyncopd_jax.__file__.startswith(sys.argv[1]), asyncopd_jax.__file__\n"
              "from asyncopd_jax.cli import main\n"
              "sys.exit(main(['train', '--no-progress', '--set', 'output_dir=runs', '--set', 'train.steps=2', "
              "'--set', 'schedule.mode=sync', '--set', 'learner.batch_size=8', '--set', 'task.eval_prompts=8']))")
    env = {**os.environ, "PYTHONPATH": str(site), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", script, str(site)], cwd=work, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "student after" in done.stdout
    assert (work / "runs" / "demo" / "metrics.jsonl").is_file()
