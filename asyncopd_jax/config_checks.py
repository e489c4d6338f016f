"""The error every config check raises, and the one form its message takes.

A leaf module (it imports nothing of the package, nor JAX) so that the config sections
defined next to the code they configure (:class:`asyncopd_jax.estimator_registry.EstimatorConfig`)
check their own fields the way :mod:`asyncopd_jax.config` does, and so that a stage process
reads its device and core lists (:func:`parse_id_list`) before JAX starts.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

# (field within the section, its value, whether the value is allowed, what is allowed)
Check = tuple[str, Any, bool, str]


class ConfigError(ValueError):
    """A configuration problem, naming the field at fault."""


def check_fields(section: str, checks: Iterable[Check]) -> None:
    """Raise a :class:`ConfigError` for the first check that fails, in one line:
    ``section.field = value is invalid; allowed: …``."""
    for field, value, ok, allowed in checks:
        if not ok:
            raise ConfigError(f"{section}.{field} = {value!r} is invalid; allowed: {allowed}")


# A list of this host's CPU cores or devices, as a Linux CPU list: "0-2,5" (see parse_id_list).
IdList = tuple[int, ...]


def parse_id_list(spec: str) -> IdList:
    """``"0-2,5"`` → ``(0, 1, 2, 5)`` (a Linux CPU list; devices are written the same way);
    ``""`` → ``()``."""
    ids: list[int] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        first, _, last = part.partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(f"{part!r} is not a number or range")
        lo, hi = int(first), int(last or first)
        if hi < lo:
            raise ValueError(f"range {part!r} runs backwards")
        ids.extend(range(lo, hi + 1))
    return tuple(dict.fromkeys(ids))
