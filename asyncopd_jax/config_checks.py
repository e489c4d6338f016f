"""The error every config check raises, and the one form its message takes.

A leaf module (it imports nothing of the package) so that the config sections defined
next to the code they configure (:class:`asyncopd_jax.estimator_registry.EstimatorConfig`)
check their own fields the way :mod:`asyncopd_jax.config` does.
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
