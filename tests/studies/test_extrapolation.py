"""EffOPD study: steps and seconds to the target, the geometry by module kind, the verdict,
and the quick study end to end."""

from __future__ import annotations

import numpy as np
import pytest

from asyncopd_jax.studies import extrapolation
from asyncopd_jax.studies.extrapolation import KINDS, _verdict, curve, geometry_by_kind, to_target

RESULT = {
    "records": [
        {"step": 1, "time": 5.0},
        {"step": 2, "time": 6.0, "eval_accuracy": 0.2, "eval_seconds": 2.0},
        {"step": 3, "time": 9.0},
        {"step": 4, "time": 10.0, "eval_accuracy": 0.6, "eval_seconds": 2.0},
        {"step": 6, "time": 14.0, "eval_accuracy": 0.5, "eval_seconds": 2.0},
    ]
}


def test_training_seconds_leave_out_the_evaluations_before_each_step():
    steps, accuracy, seconds = curve(RESULT)
    assert steps.tolist() == [2, 4, 6] and accuracy.tolist() == [0.2, 0.6, 0.5]
    assert seconds.tolist() == [6.0, 8.0, 10.0]  # 10 − 2 and 14 − 2 − 2


def test_the_first_evaluation_at_or_above_the_target_counts():
    assert to_target(RESULT, 0.5) == (4.0, 8.0)
    assert to_target(RESULT, 0.2) == (2.0, 6.0)
    assert all(np.isnan(v) for v in to_target(RESULT, 0.7))


def test_geometry_is_averaged_over_layers_per_kind_and_skips_undefined_values():
    def geometry(norm, align):
        return {f"layers.{layer}.mlp.up_proj": [norm * (layer + 1), 0.5, align] for layer in range(2)} | {
            "layers.0.self_attn.q_proj": [1.0, 0.25, align]
        }

    g = geometry_by_kind(
        {
            "records": [
                {"step": 5, "update_geometry": geometry(0.1, None)},
                {"step": 7},
                {"step": 9, "update_geometry": geometry(0.2, 0.8)},
            ]
        }
    )
    assert g["steps"].tolist() == [5, 9]
    np.testing.assert_allclose(g["up_proj"], [[0.15, 0.5, np.nan], [0.3, 0.5, 0.8]])
    np.testing.assert_allclose(g["q_proj"][1], [1.0, 0.25, 0.8])
    assert np.isnan(g["down_proj"]).all()


@pytest.mark.parametrize(
    "speedups,claim",
    [
        ([3.0, 2.5, 2.0], "reproduced (3.00×, 2.50×, 2.00× across seeds)"),
        ([3.0, 1.0, 1.0], "partly reproduced"),
        ([1.0, 1.1, 0.9], "not reproduced"),
    ],
)
def test_the_verdict_follows_the_speedups(speedups, claim):
    final = {kind: np.array([[0.3 if kind in KINDS[4:] else 0.1, 0.6, 0.9]]) for kind in KINDS}
    text = _verdict({"accuracy probe": speedups}, final)
    assert f"with the accuracy probe: {claim}" in text
    assert "relative update norm 0.3 in the MLP against 0.1 in attention; rank-1 energy 0.60" in text
    # a reason is given exactly when the speed-up is not there
    assert ("most likely reason" in text) == (claim == "not reproduced")


@pytest.mark.slow
def test_the_quick_study_writes_its_report(tmp_path):
    path = extrapolation.run(tmp_path / "docs", tmp_path / "work", quick=True, seeds=1, command="asyncopd study x")
    text = path.read_text()
    assert "## Verdict" in text and text.count("| 1 | **") == 2  # the jump at step 1 of each extrapolated arm
    assert (tmp_path / "docs" / "extrapolation" / "geometry.png").is_file()
    assert len((tmp_path / "docs" / "extrapolation" / "runs.jsonl").read_text().splitlines()) == 3
