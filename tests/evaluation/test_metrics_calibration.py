"""The phase statistics on simulated truths: quiet under a flat truth, loud on one weak phase.

Seeded simulations (a few seconds). Under a flat truth the permutation p-value may fall below 0.05, and the
cross-fitted gap's CI may exclude 0, in at most 7% of replicates; with one phase at 0.0 and the others at 0.8
(16 samples per phase, stride 8) both must detect it in at least 90%.
"""

import numpy as np
import pandas as pd
import pytest

from studies.calibration import flat, simulate, weak_phase
from kvpress_phase.evaluation.metrics import detectable_gap, permutation_p_value, summarize_group

REPLICATES = 300

FLAT_TRUTHS = [
    # accuracy, samples per phase, stride, share of samples whose phases are one draw
    (0.2, 50, 4, 0.0),
    (0.45, 16, 8, 0.0),
    (0.45, 8, 12, 0.0),
    (0.8, 16, 8, 0.8),
    (0.95, 50, 16, 0.0),
    (0.6, 30, 16, 0.8),
    (0.45, 50, 8, 0.0),
]


@pytest.mark.parametrize("rate,n,stride,shared", FLAT_TRUTHS)
def test_flat_truth_rarely_fires(rate, n, stride, shared):
    rates = simulate(flat(rate, n, stride, shared), REPLICATES, seed=int(rate * 100) + n + stride,
                     n_permutations=500, n_splits=50)
    assert rates.p_below <= 0.07
    assert rates.xfit_ci_excludes_zero <= 0.07
    assert abs(rates.mean_gap_xfit) < 0.04  # centred on the true gap, 0


def test_the_plugin_gap_is_biased_and_the_crossfitted_one_is_not():
    rates = simulate(flat(0.45, 16, 8), 200, seed=11, n_permutations=100, n_splits=50)
    assert rates.mean_gap_plugin > 0.25
    assert abs(rates.mean_gap_xfit) < 0.03


@pytest.mark.parametrize("phase", [0, 3, 6])
def test_one_weak_phase_is_detected(phase):
    scenario = weak_phase(0.0, 0.8, 16, 8, phase)
    rates = simulate(scenario, 200, seed=phase, n_permutations=500, n_splits=50)
    assert rates.p_below >= 0.9
    assert rates.xfit_ci_excludes_zero >= 0.9
    assert rates.mean_gap_xfit == pytest.approx(0.8, abs=0.06)
    assert rates.xfit_covers_truth >= 0.9


def test_a_weak_boundary_phase_moves_the_test_but_not_the_gap():
    """The gap is taken over phases 0..S-2; the boundary phase S-1 is reported apart, the test sees it."""
    rates = simulate(weak_phase(0.0, 0.8, 16, 8, 7), 100, seed=3, n_permutations=500, n_splits=50)
    assert rates.p_below >= 0.9
    assert rates.xfit_ci_excludes_zero <= 0.07


def test_detectable_gap_is_what_the_test_detects():
    """At the reported detectable gap the permutation test has about 80% power at the hardest accuracy level,
    and a gap well below it is mostly missed."""
    n, stride = 16, 8
    delta = detectable_gap(n, stride)
    assert delta is not None and 0.3 < delta < 0.8
    rng = np.random.default_rng(0)

    def power(d, high):
        scenario = weak_phase(high - d, high, n, stride, 2)
        return np.mean([permutation_p_value(scenario.draw(rng), n_permutations=300, rng=rng) < 0.05
                        for _ in range(150)])

    hardest = min(power(delta, h) for h in (0.5 + delta / 2, 0.75, 1.0) if h <= 1.0)
    assert hardest >= 0.7
    assert power(delta / 2, 0.5 + delta / 4) < 0.5
    assert detectable_gap(50, stride) < delta < detectable_gap(8, stride)  # more samples see smaller gaps


def _table(matrix):
    rows = [dict(task="t", press="x", compression_ratio=0.5, stride=matrix.shape[1], protocol="prefix", phase=p,
                 sample_id=s, score=float(matrix[s, p])) for s in range(matrix.shape[0]) for p in range(matrix.shape[1])]
    return pd.DataFrame(rows)


def test_summary_record_carries_the_calibrated_fields():
    rng = np.random.default_rng(5)
    weak = weak_phase(0.0, 0.9, 16, 8, 4).draw(rng)
    rec = summarize_group(_table(weak), 8)
    assert rec["p_value"] < 0.01 and rec["cochran_p"] < 0.01
    assert rec["gap_xfit_ci_low"] > 0.3 and rec["gap_xfit"] <= rec["gap"]
    assert rec["gap_xfit_ci_low"] <= rec["gap_xfit"] <= rec["gap_xfit_ci_high"]
    assert rec["detectable_gap"] == detectable_gap(16, 8)
    even = flat(0.9, 16, 8, shared=1.0).draw(rng)  # every sample the same at every phase
    rec = summarize_group(_table(even), 8)
    assert rec["p_value"] == 1.0 and rec["gap_xfit"] == 0.0
    assert rec["gap_xfit_ci_low"] <= 0 <= rec["gap_xfit_ci_high"]


def test_boundary_test_holds_under_a_flat_truth_and_finds_a_weak_boundary():
    """The boundary test (phase S-1 against the others) on simulated flat truths fires about as often as its level,
    and finds a boundary phase 0.6 below the others at 16 samples per phase."""
    from kvpress_phase.evaluation.metrics import boundary_test

    rng = np.random.default_rng(20)
    fired, found = 0, 0
    for _ in range(200):
        rates = rng.uniform(0.1, 0.95, size=(16, 1))  # samples differ, phases do not
        flat = (rng.random((16, 8)) < rates).astype(float)
        fired += boundary_test(flat, n_permutations=400, rng=rng)[1] < 0.05
    for _ in range(50):
        weak = (rng.random((16, 8)) < 0.8).astype(float)
        weak[:, -1] = rng.random(16) < 0.2
        found += boundary_test(weak, n_permutations=400, rng=rng)[1] < 0.05
    assert fired / 200 <= 0.09
    assert found / 50 >= 0.9
