"""The error every config check raises, and the one form its message takes.

A leaf module (it imports nothing of the package, nor JAX) so that the config sections
defined next to the code they configure (:class:`asyncopd_jax.estimator_registry.EstimatorConfig`)
check their own fields the way :mod:`asyncopd_jax.config` does, and so that a stage process
reads its device and core lists (:func:`parse_id_list`) before JAX starts.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Annotated, Any

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


#: A setting that names a file or directory here or in a bucket every host reaches
#: (``gs://…``, ``s3://…``; :mod:`asyncopd_jax.storage`): the run directory and the
#: snapshots, written there; the models, tokenizers and dataset, read from there through a
#: local copy (:mod:`asyncopd_jax.storage.local_copy`). The run's checks refuse any other
#: URL scheme in such a setting; the sections mark theirs with this type.
StorageLocation = Annotated[str, "a path, or a gs:// or s3:// URL"]

_URL_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


def url_scheme(value: str) -> str | None:
    """The scheme of ``value`` when it is a URL (``gs`` of ``gs://b/x``, lower case), else None."""
    url = _URL_SCHEME.match(value)
    return None if url is None else url.group(1).lower()


def storage_url_error(name: str | None, value: str) -> str | None:
    """One line refusing ``value`` for the path setting ``name`` (None: a command-line
    argument, which argparse names) when it is a URL (``gs://…``, ``s3://…``, any
    ``scheme://``), else None: read as a path, ``gs://b/runs`` would silently become the
    local directory ``./gs:/b/runs``."""
    url = _URL_SCHEME.match(value)
    if url is None:
        return None
    return (
        f"{'' if name is None else f'{name} = '}{value!r} is a storage URL ({url.group(1)}://); allowed: a "
        "path on this machine's file system (configs and the outputs of sft and study are local; the run "
        "directory, snapshots, models, tokenizers and datasets may be in a bucket)"
    )
