"""A run's configuration to and from YAML: dicts ⇄ dataclasses with every value coerced to
its field's type (an error names the field), ``a.b=c`` overrides, fields that moved to
another name, and what may change on ``--resume``."""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from asyncopd_jax import configs
from asyncopd_jax.atomic_files import write_text_atomically
from asyncopd_jax.config.run_config import RunConfig
from asyncopd_jax.config_checks import ConfigError

# --- dict / YAML ⇄ dataclasses -----------------------------------------------------


# Fields that moved to another name: a config that still uses the old one is told the new.
MOVED = {
    "schedule.placement": "stages.placement",
    "schedule.rollout_workers": "stages.rollouts",
    "stages.rollout_processes": "stages.rollouts",
    "schedule.snapshot_in_memory": "stages.snapshot_in_memory",
    # the estimator's knobs, grouped by what reads them
    **{
        f"estimator.{old}": f"estimator.{new}"
        for old, new in {
            "mc_clip_eps": "mc.clip_eps",
            "mc_importance_sampling": "mc.importance_sampling",
            "control_variate": "forward_mc.control_variate",
            "topk_tail": "topk.tail",
            "ppo_clip_eps": "ppo.clip_eps",
            "dual_clip": "ppo.dual_clip",
            "behavior_weight_cap": "ppo.behavior_weight_cap",
            "behavior_weight_mode": "ppo.behavior_weight_mode",
            "behavior_weight_floor": "ppo.behavior_weight_floor",
            "gspo_clip_low": "gspo.clip_low",
            "gspo_clip_high": "gspo.clip_high",
            "tis_cap": "tis.cap",
            "m2po_budget": "m2po.budget",
            "second_moment_clip_budget": "second_moment_clip.budget",
            "second_moment_clip_min_low": "second_moment_clip.min_low",
            "second_moment_clip_min_high": "second_moment_clip.min_high",
            "entropy_coef": "regularisers.entropy_coef",
            "reference_kl_coef": "regularisers.reference_kl_coef",
            "reference_kl": "regularisers.reference_kl",
        }.items()
    },
}


def _from_dict(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{prefix}." if prefix else ""
        moved = [where + u for u in unknown if where + u in MOVED]  # all of them: a config often has several
        if moved:
            raise ConfigError(f"config field {', '.join(f'{old} is now {MOVED[old]}' for old in moved)} (same values)")
        raise ConfigError(
            f"unknown config field {where}{unknown[0]}; allowed in {prefix or 'the top level'}: {', '.join(fields)}"
        )
    kwargs = {name: _coerce(hints[name], value, f"{prefix}.{name}" if prefix else name) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as err:
        message = str(err)
        raise ConfigError(message if message.startswith(prefix) else f"{prefix or 'config'}: {message}") from None


_EXPONENT_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _coerce(tp: Any, value: Any, field: str) -> Any:
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _from_dict(tp, value, field)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{field} = {value!r} is invalid; allowed: {', '.join(map(str, allowed))}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(arg, value, field)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if errors else f"{field} = {value!r} is invalid")
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{field} = {value!r} is invalid; allowed: true, false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{field} = {value!r} is invalid; allowed: an integer")
        return value
    if tp is float:
        if isinstance(value, str) and _EXPONENT_NUMBER.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads 1e-3 (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{field} = {value!r} is invalid; allowed: a number")
        return float(value)
    if origin is tuple:
        (item, *_) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{field} = {value!r} is invalid; allowed: a list")
        return tuple(_coerce(item, v, f"{field}[{i}]") for i, v in enumerate(value))
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{field} = {value!r} is invalid; allowed: a string")
        return value
    return value


def to_dict(cfg: Any) -> dict[str, Any]:
    """The resolved config as plain data (for ``config.yaml``)."""
    return dataclasses.asdict(cfg)


# Fields a resumed run may change (``asyncopd train --resume DIR --set …``): how long it
# runs, what it logs, how it evaluates, how its learner processes find each other (each
# process of a learner over several sets its own process_id), never what it computes.
# ``section.*``: every field.
SAFE_ON_RESUME = (
    "train.steps",
    "train.eval_every",
    "train.checkpoint_every",
    "train.diagnostics_every",
    "train.diagnostic_prompts",
    "train.update_geometry_every",
    "distributed.*",
    "logging.*",
    "eval.*",
)


def _safe_on_resume(field: str) -> bool:
    return any(field == safe or (safe.endswith(".*") and field.startswith(safe[:-1])) for safe in SAFE_ON_RESUME)


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` → ``{"a.b": 1}`` (a config as :func:`to_dict` gives it)."""
    if isinstance(data, dict):
        return {k: v for key, value in data.items() for k, v in flatten(value, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): data}


def check_resume_changes(saved: RunConfig, resumed: RunConfig) -> None:
    """Raise a :class:`ConfigError` naming every field that ``resumed`` changes from the
    run's ``saved`` config, unless all of them are in :data:`SAFE_ON_RESUME`."""
    old, new = flatten(to_dict(saved)), flatten(to_dict(resumed))
    changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k) and not _safe_on_resume(k))
    if changed:
        diffs = ", ".join(f"{k} ({old.get(k)!r} → {new.get(k)!r})" for k in changed)
        raise ConfigError(
            f"--resume would change {diffs}: a resumed run must compute what it started computing; "
            f"allowed changes: {', '.join(SAFE_ON_RESUME)} (start a new run for anything else)"
        )


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b=c`` overrides (values parsed as YAML scalars) to a config mapping."""
    data = yaml.safe_load(yaml.safe_dump(data)) or {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.field=value")
        key, raw = item.split("=", 1)
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part} is not a section")
        node[parts[-1]] = yaml.safe_load(raw)
    _command_line_teacher_replaces_the_files(data, {item.split("=", 1)[0].strip() for item in overrides})
    return data


def _command_line_teacher_replaces_the_files(data: dict[str, Any], keys: set[str]) -> None:
    """A served teacher (``teacher.server.url``) or a list of ``teachers`` given by override,
    where the overrides leave ``teacher.path`` alone, replaces the config file's in-process
    teacher: ``--set teacher.server.url=http://host:8000`` is enough with the demo config
    (whose ``teacher.path`` would otherwise make two teachers). Both in one file, or both by
    override, are still refused by the config's rules."""
    if "teacher.path" in keys:
        return
    teacher = data.get("teacher")
    server = teacher.get("server") if isinstance(teacher, dict) else None
    served = "teacher.server.url" in keys and isinstance(server, dict) and server.get("url")
    listed = "teachers" in keys and data.get("teachers")
    if (served or listed) and isinstance(teacher, dict):
        teacher["path"] = ""


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """Read a YAML config (a path or a bundled config's name, see :mod:`asyncopd_jax.configs`;
    None: the defaults), apply overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            path = configs.resolve(path)
        except FileNotFoundError as err:
            raise ConfigError(str(err)) from None
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ConfigError(f"{path} is not valid YAML{where}: {problem}") from None
        if not isinstance(data, dict):
            raise ConfigError(
                f"{path} must hold a mapping of config sections (name:, task:, …), not a {type(data).__name__}"
            )
    return _from_dict(RunConfig, apply_overrides(data, list(overrides)), "")


def with_overrides(cfg: RunConfig, overrides: Sequence[str]) -> RunConfig:
    """``cfg`` with ``--set``-style overrides applied, validated as :func:`load_config` does."""
    return _from_dict(RunConfig, apply_overrides(to_dict(cfg), list(overrides)), "")


def migrate_saved_config(path: str | Path) -> list[str]:
    """A saved run's ``config.yaml`` (``--resume``) rewritten with each field that moved
    (:data:`MOVED`) under its new name, its value unchanged. Returns the moves made (``old
    → new``; none when the file already uses the current names). Only a run's own saved
    config is migrated: a hand-written config with an old name is refused, naming the new."""
    path = Path(path)
    data = yaml.safe_load(path.read_text()) or {}
    moves = []
    for old, new in MOVED.items():
        *old_parents, old_leaf = old.split(".")
        section = _section(data, old_parents, create=False)
        if section is None or old_leaf not in section:
            continue
        *new_parents, new_leaf = new.split(".")
        target = _section(data, new_parents, create=True)
        if target is None or new_leaf in target:
            raise ConfigError(f"{path}: holds both {old} and {new} (the same field, renamed): keep one")
        target[new_leaf] = section.pop(old_leaf)
        moves.append(f"{old} → {new}")
    if moves:
        write_text_atomically(path, yaml.safe_dump(data, sort_keys=False))
    return moves


def _section(data: Any, keys: list[str], create: bool) -> dict | None:
    """The mapping at ``keys`` under ``data`` (made where ``create``), None where there is none."""
    for key in keys:
        if not isinstance(data, dict):
            return None
        if key not in data and create:
            data[key] = {}
        data = data.get(key)
    return data if isinstance(data, dict) else None


def config_yaml(cfg: RunConfig) -> str:
    """``cfg`` as the YAML a run saves (and :func:`load_config` reads back)."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def save_config(cfg: RunConfig, path: str | Path) -> None:
    write_text_atomically(path, config_yaml(cfg))
