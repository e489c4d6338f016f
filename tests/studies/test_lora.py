"""LoRA study: the acceptance from the steps to 94 % of the teacher, the bytes a version
shipped, the learning rate tuned on seed 0, and the quick study end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest

from asyncopd_jax.studies import lora
from asyncopd_jax.studies.lora import acceptance, version_bytes


@pytest.mark.parametrize(
    "steps,best,claim",
    [
        (
            {"full": 1000, "rank 16": 1200, "rank 4": 1400, "rank 1": np.nan},
            "rank 16",
            "1.20× full training's 1000 steps: the acceptance (at most 1.25×) holds",
        ),
        ({"full": 1000, "rank 16": 1300, "rank 4": np.nan, "rank 1": np.nan}, "rank 16", "1.30×"),
        ({"full": 1000, "rank 16": 1500, "rank 4": 1400, "rank 1": np.nan}, "rank 4", "does not hold"),
        ({"full": np.nan, "rank 16": 1400, "rank 4": np.nan, "rank 1": np.nan}, "rank 16", "full training never did"),
        ({"full": 900, "rank 16": np.nan, "rank 4": np.nan, "rank 1": np.nan}, None, "no LoRA arm reached"),
        (
            {"full": 1000, "rank 16": np.nan, "rank 16 + embedding, norms": 1200, "rank 1 + embedding, norms": 1100},
            "rank 1 + embedding, norms",
            "1.10× full training's 1000 steps: the acceptance (at most 1.25×) holds",
        ),
    ],
)
def test_the_acceptance_takes_the_fastest_rank_against_full_training(steps, best, claim):
    got, text = acceptance(steps)
    assert got == best and claim in text
    assert ("does not hold" in text) == (claim in ("1.30×", "does not hold", "no LoRA arm reached"))


def test_a_versions_bytes_are_the_last_recorded_and_the_base_is_counted_once():
    records = [
        {"step": 1},
        {"step": 2, "snapshot_bytes": 100, "snapshot_base_bytes": 400},
        {"step": 3, "snapshot_bytes": 90},
    ]
    assert version_bytes({"records": records}) == (90.0, 400.0)
    assert version_bytes({"records": [{"step": 1, "snapshot_bytes": 500}]}) == (500.0, 0.0)
    shipped, base = version_bytes({"records": [{"step": 1}]})
    assert np.isnan(shipped) and base == 0.0


@pytest.mark.slow
def test_the_quick_study_tunes_on_seed_0_and_writes_its_report(tmp_path):
    path = lora.run(tmp_path / "docs", tmp_path / "work", quick=True, seeds=2, command="asyncopd study lora --quick")
    text = path.read_text()
    lines = [json.loads(line) for line in (tmp_path / "docs" / "lora" / "runs.jsonl").read_text().splitlines()]
    # the grid (8 runs, seed 0) and seed 1 of each of the 7 arms at its tuned rate
    assert len(lines) == 15 and sum(line["name"].endswith("-s1") for line in lines) == 7
    rank1 = {line["name"]: line["summary"]["student_after"] for line in lines if line["name"].startswith("rank1-")}
    chosen = max(lora.QUICK.grid["rank 1"], key=lambda lr: rank1[f"rank1-lr{lr:g}-s0"])
    assert f"rank1-lr{chosen:g}-s1" in rank1  # seed 1 ran at the rate seed 0 chose
    assert "## Verdict" in text and "student.lora.rank=4" in text and "modules_to_save=['embed_tokens'" in text
    assert (tmp_path / "docs" / "lora" / "accuracy.png").is_file()
