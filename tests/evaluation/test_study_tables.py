"""The phase sets and tests behind RESULTS.md section 5."""

import numpy as np

from studies.study_tables import copooled, holm, signflip


def test_copooled_phases_follow_the_pool_groups():
    assert copooled(8, 0.5) == [0, 2, 4, 6]  # k = 4: groups of two
    assert copooled(8, 0.75) == [0, 1, 2, 4, 5, 6]  # k = 2: groups of four
    assert copooled(8, 0.25) == [2, 6]  # k = 6: two groups of two
    assert copooled(8, 0.0) == []  # k = 8: nothing pooled


def test_signflip_is_calibrated_and_detects_a_shift():
    rng = np.random.default_rng(0)
    null_p = [signflip(rng.normal(size=16), n=2000, seed=i)[1] for i in range(200)]
    assert np.mean(np.array(null_p) < 0.05) <= 0.09
    assert signflip(rng.normal(size=16) - 1.5, n=2000)[1] < 0.01


def test_holm_adjustment():
    np.testing.assert_allclose(holm([0.01, 0.04, 0.03, 0.5]), [0.04, 0.09, 0.09, 0.5])
