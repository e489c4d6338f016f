"""Fixtures shared by the sampling tests."""

from __future__ import annotations

import pytest

from asyncopd_jax.sampling.stream import ContinuousStream


@pytest.fixture(params=["ahead", "read first"])
def chunk_order(request, monkeypatch) -> str:
    """A continuous stream's step in one order, forced: the next chunk dispatched before the
    last one is read (a device still decoding it) or after (a device done with it). The
    answers must not depend on which."""
    busy = request.param == "ahead"
    monkeypatch.setattr(ContinuousStream, "device_busy", staticmethod(lambda chunk: busy))
    return request.param


# The stream's two chunk orders for a test that checks answers in both, with the second in
# CI's extended step: test_stream.py's tests run both in the fast suite, so each order's
# answers stay checked there.
AHEAD_FAST_READ_FIRST_EXTENDED = pytest.mark.parametrize(
    "chunk_order", ["ahead", pytest.param("read first", marks=pytest.mark.extended)], indirect=True
)
