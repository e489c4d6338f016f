"""A non-editable install works: the wheel carries the bundled configs and the built-in
models, and ``asyncopd train`` runs from it outside the source tree."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.waits import WAIT_S

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.e2e  # a wheel built, installed and run: the end-to-end step (-m e2e)
def test_the_wheel_ships_the_configs_and_runs_the_main_job(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(ROOT),
        ],
        check=True,
        cwd=tmp_path,
    )
    wheel = next((tmp_path / "dist").glob("asyncopd_jax-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in (
        "asyncopd_jax/configs/demo.yaml",
        "asyncopd_jax/configs/rl.yaml",
        "asyncopd_jax/tasks/assets/teacher/model.safetensors",
        "asyncopd_jax/tasks/assets/student/tokenizer.json",
    ):
        assert needed in names, needed
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)  # a pure-Python wheel installs by unpacking
    work = tmp_path / "elsewhere"  # not the source tree: nothing can come from the checkout
    work.mkdir()
    script = (
        "import sys, asyncopd_jax; assert asyncopd_jax.__file__.startswith(sys.argv[1]), asyncopd_jax.__file__\n"
        "from asyncopd_jax.cli import main\n"
        "sys.exit(main(['train', '--no-progress', '--set', 'output_dir=runs', '--set', 'train.steps=2', "
        "'--set', 'schedule.mode=sync', '--set', 'learner.batch_size=8', '--set', 'task.eval_prompts=8', "
        f"'--set', 'stages.startup_timeout={WAIT_S}']))"
    )
    env = {**os.environ, "PYTHONPATH": str(site), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", script, str(site)], cwd=work, env=env, capture_output=True, text=True, timeout=240
    )  # healthy ~30 s; under the per-test limit (pyproject.toml), so the failure says what the run printed
    assert done.returncode == 0, done.stderr[-3000:]
    assert "student after" in done.stdout
    assert (work / "runs" / "demo" / "metrics.jsonl").is_file()


# Makes the training stack unimportable, as in an environment with the base install only.
_WITHOUT_TRAINING_STACK = """
import importlib.abc, sys
from asyncopd_jax.entry import TRAINING_STACK
blocked = {name.split(".")[0] for name in TRAINING_STACK} | {"tokenizers", "torch"}

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, Block())
"""


def test_the_estimators_need_only_jax_and_numpy_and_the_command_names_its_extra(tmp_path):
    """The base install (``dependencies``: JAX and NumPy) is the estimator library: it imports
    and computes with the training stack unimportable; the command then exits 2 with one line
    naming the extra to install."""
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert sorted(d.split(">")[0] for d in deps) == ["jax", "numpy"]
    script = (
        _WITHOUT_TRAINING_STACK
        + """
import jax.numpy as jnp
import asyncopd_jax.estimators as est
logp = jnp.log(jnp.full((2, 3, 4), 0.2))
assert est.forward_kl_topk(logp, logp).shape == (2, 3)
assert est.aggregate(jnp.ones((2, 3)), jnp.ones((2, 3), bool), "seq-mean-token-sum-norm", horizon=6) == 0.5
loaded = sorted(m for m in sys.modules if m.split(".")[0] in blocked)
assert not loaded, loaded
from asyncopd_jax.entry import main
sys.exit(main(["train"]))
"""
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2, done.stderr[-3000:]
    message = done.stderr.strip()
    assert "\n" not in message, message
    assert message.startswith(
        "asyncopd: the training stack is not installed (missing: flax, optax, orbax-checkpoint, "
        "transformers, tensorstore, safetensors, pyyaml, matplotlib, tokenizers, tqdm)"
    ), message
    assert "pip install 'asyncopd-jax[train]'" in message


# Import name → distribution name, where they differ (PEP 503-normalised on both sides).
_DISTRIBUTION_OF = {
    "yaml": "pyyaml",
    "orbax": "orbax-checkpoint",
    "google": "google-cloud-storage",
    "mlflow": "mlflow-skinny",
}


def _normalised(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _third_party_imports(package: Path) -> dict[str, set[str]]:
    """Top-level module → the files importing it, for every absolute import in ``package``
    (lazy imports inside functions included: ``ast.walk`` sees them) that is neither the
    standard library nor the package itself."""
    found: dict[str, set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top not in sys.stdlib_module_names and top != package.name:
                    found.setdefault(top, set()).add(str(path.relative_to(package.parent)))
    return found


def test_every_third_party_import_in_the_package_is_a_declared_dependency():
    """A module imported anywhere in asyncopd_jax/ but declared nowhere in pyproject.toml works
    in the developer's environment (it came in with something else) and fails for a user on
    a clean install; this names it and the files that import it."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        requirements += extra
    declared = {_normalised(re.match(r"[A-Za-z0-9._-]+", r.strip()).group()) for r in requirements}
    imports = _third_party_imports(ROOT / "asyncopd_jax")
    assert {"jax", "numpy", "flax", "orbax"} <= imports.keys(), sorted(imports)  # the scan sees the package's imports
    undeclared = {
        module: sorted(files)
        for module, files in imports.items()
        if _normalised(_DISTRIBUTION_OF.get(module, module)) not in declared
    }
    assert not undeclared, f"imported by asyncopd_jax but not declared in pyproject.toml: {undeclared}"


def _python_without_torch(tmp_path: Path, script: str) -> subprocess.CompletedProcess:
    """``script`` in a fresh interpreter where ``torch`` is absent, as with the train extra
    (which has no torch; the test extra has it): a ``sitecustomize`` puts None in
    ``sys.modules["torch"]``, so ``import torch`` fails and ``importlib.util.find_spec``
    (transformers' probe) answers None."""
    site = tmp_path / "no_torch"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text('import sys\nsys.modules["torch"] = None\n')
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}", "JAX_PLATFORMS": "cpu"}
    env.pop("TRANSFORMERS_NO_ADVISORY_WARNINGS", None)  # would hide the advisory whatever the package does
    return subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )


def test_no_pytorch_advisory_from_transformers_and_its_other_warnings_still_shown(tmp_path):
    """Without torch, transformers logs "PyTorch was not found. Models won't be available ..."
    on import; the package never uses its PyTorch models, so it drops that one record, and only it."""
    advisory = "PyTorch was not found."
    control = _python_without_torch(tmp_path, "import transformers")
    assert control.returncode == 0, control.stderr[-3000:]
    assert advisory in control.stderr, (  # else this test checks nothing: see asyncopd_jax/__init__.py
        f"transformers without torch no longer logs {advisory!r}; stderr: {control.stderr[-2000:]}"
    )

    script = (
        "import logging, sys\n"
        "from importlib.resources import files\n"
        "from asyncopd_jax.models.tokenizer import load_tokenizer\n"
        "assert 'torch' not in {m.split('.')[0] for m in sys.modules if sys.modules[m] is not None}\n"
        "load_tokenizer(files('asyncopd_jax.tasks.assets') / 'student')\n"
        "logging.getLogger('transformers').warning_advice('another advisory')\n"
        "logging.getLogger('transformers.tokenization_utils_base').warning('another warning')\n"
    )
    done = _python_without_torch(tmp_path, script)
    assert done.returncode == 0, done.stderr[-3000:]
    assert advisory not in done.stderr, done.stderr[-3000:]
    assert "another advisory" in done.stderr and "another warning" in done.stderr, done.stderr[-3000:]
