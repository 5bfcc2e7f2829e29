"""Phase metrics on synthetic score tables with known answers."""

import numpy as np
import pandas as pd
import pytest

from kvpress_phase.evaluation.metrics import homogeneity_p_value, summarize, summarize_group


def table(per_phase_rates, n=200, seed=0, stride=None):
    rng = np.random.default_rng(seed)
    stride = stride or len(per_phase_rates)
    rows = []
    for s in range(n):
        for p, rate in enumerate(per_phase_rates):
            rows.append(dict(task="t", press="x", compression_ratio=0.5, stride=stride, protocol="prefix",
                             phase=p, sample_id=s, score=float(rng.random() < rate)))
    return pd.DataFrame(rows)


def test_flat_accuracy_has_a_gap_ci_near_zero_and_high_p():
    rec = summarize_group(table([0.8] * 8, n=400), 8)
    assert rec["mean"] == pytest.approx(0.8, abs=0.03)
    assert rec["p_value"] > 0.01
    assert rec["gap_ci_low"] < 0.1


def test_periodic_weak_spot_is_found():
    rates = [0.9, 0.3, 0.9, 0.3, 0.9, 0.3, 0.9, 0.1]
    rec = summarize_group(table(rates, n=300), 8)
    assert rec["worst_phase"] in (1, 3, 5)  # boundary phase 7 is reported apart, not as the worst
    assert rec["best_phase"] in (0, 2, 4, 6)
    assert rec["gap"] == pytest.approx(0.6, abs=0.1)
    assert rec["gap_ci_low"] <= rec["gap"] <= rec["gap_ci_high"]
    assert rec["gap_ci_low"] > 0.4
    assert rec["boundary"] == pytest.approx(0.1, abs=0.05)
    assert rec["p_value"] < 1e-6
    for (lo, hi), acc in zip(rec["per_phase_ci"], rec["per_phase"]):
        assert lo <= acc <= hi


def test_all_correct_is_homogeneous():
    m = np.ones((10, 4))
    assert homogeneity_p_value(m, range(4)) == 1.0


def test_summarize_groups_and_missing_phases():
    df = pd.concat([table([1, 0, 1, 0], n=20), table([0.5] * 4, n=20).assign(press="y")])
    df = df[df.phase != 2]
    recs = summarize(df, n_resamples=200)
    assert [r["press"] for r in recs] == ["x", "y"]
    assert recs[0]["per_phase"][2] is None and recs[0]["phases"] == [0, 1, 3]
    assert recs[0]["n_samples"] == 20
