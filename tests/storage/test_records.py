"""Leases judged by the observer's own clock, and the polling backoff (no server needed)."""

from __future__ import annotations

import pytest

from asyncopd_jax.storage import Blob, open_store, records


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(records.time, "monotonic", c.monotonic)
    monkeypatch.setattr(records.time, "sleep", c.sleep)
    return c


def test_a_lease_expires_only_after_its_generation_stayed_for_lease_s_of_the_observers_clock(clock):
    leases = records.LeaseClock(lease_s=10.0)
    assert not leases.expired("claims/a", "g1")  # first sight starts the observer's clock
    clock.now += 9.9
    assert not leases.expired("claims/a", "g1")
    clock.now += 0.1
    assert leases.expired("claims/a", "g1")
    assert not leases.expired("claims/a", "g2")  # renewed: the clock starts again
    clock.now += 9.0
    assert not leases.expired("claims/a", "g2") and not leases.expired("claims/b", "g2")  # per key
    clock.now += 1.0
    assert leases.expired("claims/a", "g2") and not leases.expired("claims/b", "g2")
    leases.forget("claims/a")
    assert not leases.expired("claims/a", "g2")


def test_a_bucket_is_polled_from_50_ms_doubling_to_1_s_and_a_directory_every_2_ms(clock, tmp_path):
    class Remote:
        remote = True

    backoff = records.Backoff(Remote())  # type: ignore[arg-type]
    for _ in range(7):
        backoff.wait()
    assert clock.slept == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    backoff.reset()
    backoff.wait()
    assert clock.slept[-1] == pytest.approx(0.05)
    clock.slept.clear()
    local = records.Backoff(open_store(tmp_path))
    for _ in range(3):
        local.wait()
    assert clock.slept == pytest.approx([0.002] * 3)


def test_records_carry_their_writer_and_are_unique_to_the_attempt():
    a, b = records.record_bytes({"owner": "x"}), records.record_bytes({"owner": "x"})
    assert a != b
    parsed = records.parse(Blob(a, "g"))
    assert parsed["owner"] == "x" and parsed["writer"] == records.WRITER
