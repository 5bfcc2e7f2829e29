"""Phase metrics on synthetic score tables with known answers."""

import numpy as np
import pandas as pd
import pytest

from kvpress_phase.evaluation.metrics import (
    cochran_p_value,
    crossfit_gap,
    permutation_p_value,
    phase_intervals,
    summarize,
    summarize_group,
)


def table(per_phase_rates, n=200, seed=0, stride=None):
    rng = np.random.default_rng(seed)
    stride = stride or len(per_phase_rates)
    rows = []
    for s in range(n):
        for p, rate in enumerate(per_phase_rates):
            rows.append(dict(task="t", press="x", compression_ratio=0.5, stride=stride, protocol="prefix",
                             phase=p, sample_id=s, score=float(rng.random() < rate)))
    return pd.DataFrame(rows)


def test_flat_accuracy_has_a_crossfitted_gap_near_zero_and_high_p():
    rec = summarize_group(table([0.8] * 8, n=400), 8)
    assert rec["mean"] == pytest.approx(0.8, abs=0.03)
    assert rec["p_value"] > 0.01
    assert rec["gap_xfit"] == pytest.approx(0.0, abs=0.05)
    assert rec["gap_xfit_ci_low"] <= 0 <= rec["gap_xfit_ci_high"]
    assert rec["gap"] > rec["gap_xfit"]  # the plug-in gap of noisy means is biased upward


def test_periodic_weak_spot_is_found():
    rates = [0.9, 0.3, 0.9, 0.3, 0.9, 0.3, 0.9, 0.1]
    rec = summarize_group(table(rates, n=300), 8)
    assert rec["worst_phase"] in (1, 3, 5)  # boundary phase 7 is reported apart, not as the worst
    assert rec["best_phase"] in (0, 2, 4, 6)
    assert rec["gap"] == pytest.approx(0.6, abs=0.1)
    assert rec["gap_xfit"] == pytest.approx(0.6, abs=0.1)
    assert rec["gap_xfit_ci_low"] > 0.4
    assert rec["gap_xfit_ci_low"] <= rec["gap_xfit"] <= rec["gap_xfit_ci_high"]
    assert rec["boundary"] == pytest.approx(0.1, abs=0.05)
    assert rec["p_value"] < 0.001 and rec["cochran_p"] < 1e-6
    for (lo, hi), acc in zip(rec["per_phase_ci"], rec["per_phase"]):
        assert lo <= acc <= hi


def test_all_correct_is_homogeneous():
    m = np.ones((10, 4))
    assert permutation_p_value(m) == 1.0
    assert cochran_p_value(m) == 1.0
    assert crossfit_gap(m) == (0.0, pytest.approx(0.0, abs=0.5), pytest.approx(0.0, abs=0.5))


def test_permutation_test_is_paired():
    """Every sample right at phase 0 and wrong at phase 1: an unpaired test of 10 vs 10 could not separate a
    sample effect from a phase effect, the paired one sees ten consistent pairs."""
    m = np.tile([1.0, 0.0], (10, 1))
    assert permutation_p_value(m, n_permutations=4000) < 0.01
    # the same margins with the disagreement spread over samples (5 right at each phase) give no evidence
    m = np.array([[1.0, 0.0]] * 5 + [[0.0, 1.0]] * 5)
    assert permutation_p_value(m, n_permutations=4000) > 0.5


def test_too_few_samples_give_no_gap():
    assert crossfit_gap(np.ones((3, 4))) == (None, None, None)
    assert np.isnan(permutation_p_value(np.ones((5, 1))))


def test_wilson_intervals_for_binary_and_bootstrap_for_fractions():
    binary = np.array([[1.0, 0.0]] * 8)
    iv = phase_intervals(binary)
    assert iv[0, 1] == 1.0 and iv[0, 0] < 0.8  # an all-correct phase still gets a width
    assert iv[1, 0] == 0.0 and iv[1, 1] > 0.2
    frac = np.array([[0.5, 0.25], [0.75, 0.25], [0.5, 0.5]])
    iv = phase_intervals(frac)
    assert 0.5 <= iv[0, 0] <= iv[0, 1] <= 0.75


def test_summarize_groups_and_missing_phases():
    df = pd.concat([table([1, 0, 1, 0], n=20), table([0.5] * 4, n=20).assign(press="y")])
    df = df[df.phase != 2]
    recs = summarize(df, n_resamples=200)
    assert [r["press"] for r in recs] == ["x", "y"]
    assert recs[0]["per_phase"][2] is None and recs[0]["phases"] == [0, 1, 3]
    assert recs[0]["n_samples"] == 20 and recs[0]["n_paired"] == 20


def test_ruler_credit_is_reported_beside_the_mean_for_tasks_that_need_every_reference():
    from kvpress_phase.evaluation.report import summary_table

    refs = ["11 11", "22 22", "33 33", "44 44"]
    answers = {0: "11 11, 22 22, 33 33, 44 44", 1: "11 11, 22 22, 33 33", 2: "none", 3: "44 44"}  # 1, 3/4, 0, 1/4
    df = pd.DataFrame([dict(task="niah_multivalue", press="x", compression_ratio=0.5, stride=4, protocol="offset",
                            phase=p, sample_id=s, answer=refs, prediction=answers[(p + s) % 4],
                            score=float((p + s) % 4 == 0)) for s in range(4) for p in range(4)])
    rec = summarize_group(df, 4)
    assert rec["mean"] == pytest.approx(0.25)
    assert rec["partial_mean"] == pytest.approx((1 + 0.75 + 0 + 0.25) / 4)
    assert summarize_group(df.assign(task="qa_single_doc"), 4)["partial_mean"] is None  # any one: the score
    one = df.assign(answer=[["11 11"]] * len(df))
    assert summarize_group(one, 4)["partial_mean"] is None  # one reference each: the score
    assert summarize_group(df.drop(columns=["prediction"]), 4)["partial_mean"] is None
    assert "RULER credit" in summary_table(summarize(df, n_resamples=50)).columns
    assert "RULER credit" not in summary_table(summarize(table([0.5] * 4, n=10), n_resamples=50)).columns


def test_an_interrupted_sample_is_left_out_of_the_paired_statistics():
    df = table([0.8] * 4, n=12)
    df = df[~((df.sample_id == 3) & (df.phase == 1))]
    rec = summarize_group(df, 4)
    assert rec["n_samples"] == 12 and rec["n_paired"] == 11
