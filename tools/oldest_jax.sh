#!/usr/bin/env bash
# The estimator library on the oldest JAX it supports: a fresh environment with the base
# install only (JAX at the floor pyproject.toml declares, NumPy; no training stack), then
# tests/estimators. CI runs this after the README's test command (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."

floor=$(python3 -c 'import re, tomllib; deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]; print(next(re.fullmatch(r"jax>=([0-9.]+)", d).group(1) for d in deps if d.startswith("jax>=")))')
venv=.venv-oldest-jax
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
# The base install with JAX pinned at the floor, plus what the tests themselves import (and
# pytest-timeout and pytest-xdist, which pyproject.toml's addopts and time limit need).
"$venv/bin/pip" install --quiet "jax==$floor" "jaxlib==$floor" -e . "pytest>=8" "pytest-timeout==2.4.0" "pytest-xdist==3.8.0" "hypothesis>=6.100" "scipy>=1.12"
"$venv/bin/python" -c "import jax, flax" 2>/dev/null && { echo "the base install pulled in the training stack" >&2; exit 1; }
echo "tests/estimators on jax $("$venv/bin/python" -c 'import jax; print(jax.__version__)') (the floor: $floor)"
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/estimators
