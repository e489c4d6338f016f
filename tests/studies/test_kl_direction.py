"""E1: the verdict follows the numbers, and the quick study runs end to end."""

from __future__ import annotations

import shutil

import pytest

from asyncopd_jax.studies import kl_direction
from asyncopd_jax.studies.kl_direction import ESTIMATORS, FORWARD, QUICK, _verdict


def _values(forward_drop, reverse_drop):
    """Accuracy 0.9 at k = 0; at the largest lag 0.9 minus the drop of the estimator's direction."""
    def values(estimator, lag, lr, key):
        drops = forward_drop if estimator in FORWARD else reverse_drop
        return [0.9 - (d if lag == max(QUICK.lags) else 0.0) for d in drops]
    return values


@pytest.mark.parametrize("forward,reverse,verdict", [
    ([0.0, 0.01], [0.2, 0.3], ": reproduced."),
    ([0.0, 0.0], [0.3, 0.0], ": partly reproduced (not on every seed)."),
    ([0.1, 0.1], [0.1, 0.1], ": not reproduced."),
    ([0.3, 0.3], [0.0, 0.0], ": not reproduced."),
])
def test_the_verdict_follows_the_accuracy_drops(forward, reverse, verdict):
    text = _verdict(_values(forward, reverse), QUICK, seeds=2)
    assert text.endswith(verdict), text
    assert f"forward-KL estimators {100 * sum(forward) / 2:.1f} points" in text


@pytest.mark.slow
def test_the_quick_study_writes_its_report(tmp_path):
    path = kl_direction.run(tmp_path / "docs", tmp_path / "work", quick=True, seeds=1, jobs=2,
                            command="asyncopd study x")
    text = path.read_text()
    assert text.count("| reverse_kl_hybrid |") == 2 and "## Verdict" in text
    assert (tmp_path / "docs" / "kl_direction" / "reverse_kl_lr0.003.png").is_file()
    ledger = tmp_path / "docs" / "kl_direction" / "runs.jsonl"
    assert len(ledger.read_text().splitlines()) == len(ESTIMATORS) * len(QUICK.lags)
    # The ledger alone rebuilds the same report: nothing is trained again, even without the run directories.
    shutil.rmtree(tmp_path / "work")
    assert kl_direction.run(tmp_path / "docs", tmp_path / "work", quick=True, seeds=1,
                            command="asyncopd study x").read_text() == text
    assert not (tmp_path / "work").exists()
