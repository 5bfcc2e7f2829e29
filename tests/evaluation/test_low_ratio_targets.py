"""R10's targets (studies/low_ratio_targets.py) on synthetic splits whose truth is known."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from studies import low_ratio_targets as lt

REC, B1, B2 = "rec", "b1", "b2"


def _split(truth: dict, samples: int = 8, seed: int = 0) -> pd.DataFrame:
    """Answers of one model, two settings, one task and length, strides 6 and 12, ratios 0.25 and 0.75; ``truth``:
    each press's chance of a correct answer; a text's difficulty shifts every press alike."""
    rng = np.random.default_rng(seed)
    rows = []
    for setting in ("query_agnostic", "question_compressed"):
        for stride in (6, 12):
            for sample in range(samples):
                shift = rng.normal(0, 0.1)
                for ratio in (0.25, 0.75):
                    for press, p in truth.items():
                        for phase in range(stride):
                            rows.append(dict(model="m", setting=setting, task="t", context_length=1024,
                                             stride=stride, compression_ratio=ratio, sample_id=sample, phase=phase,
                                             press=press, score=float(rng.random() < np.clip(p + shift, 0, 1))))
    return pd.DataFrame(rows)


def test_a_press_level_with_the_best_meets_target_1_and_its_interval_covers_0():
    table = lt.targets(_split({REC: 0.8, B1: 0.8, B2: 0.4}), REC, [B1, B2], replicates=200)
    assert len(table) == 2 and (table.best_single == B1).all() and (table.cells == 4).all()
    assert table.target1.all() or (table["mean"] >= table.best_mean - 0.05).all()
    assert ((table.low <= 0) & (table.high >= 0)).sum() >= 1
    assert (table.texts == 8).all()  # (task, sample): settings and strides pooled within a text


def test_a_press_well_below_the_best_misses_both_targets():
    table = lt.targets(_split({REC: 0.4, B1: 0.8, B2: 0.5}), REC, [B1, B2], replicates=200)
    assert not table.target1.any() and not table.target2.any() and (table.high < 0).all()
    assert (table.near == 0).all()


def test_the_page_names_targets_and_refuses_missing_presses():
    records = _split({REC: 0.8, B1: 0.8, B2: 0.6, "ours": 0.7})
    text = lt.report(records, REC, ["ours"], [B1, B2], "synthetic", replicates=200)
    assert "### The recommendation, `rec`" in text and "`ours` (reported, not a target)" in text
    assert "target 1 met at" in text
    with pytest.raises(ValueError, match="no answers of 'nope'"):
        lt.targets(records, "nope", [B1], replicates=200)
    with pytest.raises(ValueError, match="no answers of any kvpress baseline"):
        lt.targets(records, REC, ["b9"], replicates=200)
