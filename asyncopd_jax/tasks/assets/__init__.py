"""Models shipped with the package for the built-in task.

``builtin:NAME`` names a directory here (Hugging Face layout: ``config.json``,
``model.safetensors``, tokenizer files); any other model path is a local directory.

* ``teacher``, ``student``: SFT models made by ``asyncopd sft`` (the teacher 99.6 %
  held-out, the student a short warm start at 3.9 %).
* ``student_distilled``: the warm start of reward-driven RL (as AReaL starts from a
  distilled model): ``student`` after 400 synchronous distillation steps, 60.5 %
  held-out (greedy), about 30 % of its samples at temperature 1 correct. Made by
  ``asyncopd train --set schedule.mode=sync --set train.steps=400 --set
  optim.schedule=constant --set name=opd400`` and copying ``runs/opd400/student``.
* ``student_bpe``: the student's architecture over the ``merges`` tokenizer (64 byte-pair
  merges of the task's characters, :mod:`asyncopd_jax.tasks.tokenizer`), the other-tokenizer
  student of cross-tokenizer distillation: ``asyncopd sft --model student --tokenizer merges
  --steps 300``, 4.3 % held-out.
* ``teacher_tools``, ``student_tools``: the tool task's models (``task.name = tools``, the
  ``tools`` tokenizer): ``asyncopd sft --model teacher --tokenizer tools --task name=tools
  --steps 400`` (100 % held-out: it calls the calculator once and copies its answer) and
  ``asyncopd sft --model student --tokenizer tools --task name=tools --steps 40`` (0 %).
* ``student_tools_bpe``: the tool task's student over the ``tools_merges`` tokenizer (64
  byte-pair merges of its characters), distilled from ``teacher_tools`` across tokenizers:
  ``asyncopd sft --model student --tokenizer tools_merges --task name=tools --steps 40`` (0 %).
* ``teacher_long``, ``student_long``: the models of the ``long_tailed`` config
  (``task.lengths = long_tailed``): ``teacher`` and ``student`` with a context of 1024
  positions, fine-tuned by ``asyncopd sft --init`` on long-tailed problems added left to
  right (the teacher 96.1 % held-out, 7.8 % at 27-40 operands; the student 1.2 %). The
  commands: docs/results.md, "The long-tailed task's models".
"""

from __future__ import annotations

from pathlib import Path

from asyncopd_jax.storage.local_copy import resolve_location

ASSETS = Path(__file__).parent
BUILTIN_PREFIX = "builtin:"


def resolve_model_path(path: str) -> Path:
    """``builtin:NAME`` → the shipped directory; ``gs://…`` / ``s3://…`` → its local copy
    (:func:`~asyncopd_jax.storage.local_copy.local_copy`, downloaded once, checked at each
    use); anything else → ``Path(path)``."""
    if path.startswith(BUILTIN_PREFIX):
        name = path[len(BUILTIN_PREFIX) :]
        directory = ASSETS / name
        if not directory.is_dir():
            shipped = sorted(p.name for p in ASSETS.iterdir() if p.is_dir() and not p.name.startswith("_"))
            raise FileNotFoundError(f"no built-in model {name!r}; shipped: {', '.join(shipped) or 'none'}")
        return directory
    if not path:
        raise FileNotFoundError("no model path given (set student.path / teacher.path, e.g. builtin:teacher)")
    return resolve_location(path)
