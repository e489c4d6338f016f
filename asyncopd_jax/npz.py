"""Named NumPy arrays as the bytes of an ``.npz`` archive and back: the one binary format
the stages exchange (a spool's records, ``serve-teacher``'s binary answers).

NumPy's format has no bfloat16 (it would come back as raw 2-byte voids): such arrays are
stored as their uint16 bits, their names listed under :data:`BFLOAT16`, and viewed back.
Archives are written uncompressed and read with ``allow_pickle=False``: no code is ever
loaded from one.

    data = npz_bytes({"hidden": np.zeros((2, 8), jnp.bfloat16)})
    npz_arrays(data)["hidden"].dtype                                   # bfloat16
"""

from __future__ import annotations

import io

import jax.numpy as jnp
import numpy as np

#: The key under which an archive lists its bfloat16 arrays' names.
BFLOAT16 = "__bfloat16__"


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """``arrays`` as the bytes of an .npz file (bfloat16 ones as their bits)."""
    bf16 = [k for k, v in arrays.items() if v.dtype == jnp.bfloat16]
    stored = {k: v.view(np.uint16) if k in bf16 else v for k, v in arrays.items()}
    if bf16:
        stored[BFLOAT16] = np.asarray(bf16)
    buffer = io.BytesIO()
    np.savez(buffer, **stored)  # type: ignore[arg-type]  # numpy's stub types **kwds as allow_pickle's bool
    return buffer.getvalue()


def npz_arrays(data: bytes) -> dict[str, np.ndarray]:
    """The inverse of :func:`npz_bytes`. Raises ValueError (or zipfile's BadZipFile, a
    subclass of Exception) on bytes that are not such an archive."""
    with np.load(io.BytesIO(data), allow_pickle=False) as archive:
        arrays = {k: archive[k] for k in archive.files}
    for name in arrays.pop(BFLOAT16, []):
        arrays[str(name)] = arrays[str(name)].view(jnp.bfloat16)
    return arrays
