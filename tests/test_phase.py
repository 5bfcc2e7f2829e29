"""The rounding rule from a requested compression ratio to the entries each window keeps, and its warning."""

from __future__ import annotations

import warnings
from fractions import Fraction

import pytest

from kvpress_phase import ChunkedStridePress, PhaseAwarePress
from kvpress_phase.phase import compressed_length, kept_per_window, ratio_mismatch, window_ratio

STRIDES = range(2, 33)
RATIOS = [Fraction(i, 64) for i in range(64)]  # every ratio in [0, 1) in steps of 1/64, exactly


def _expected(stride: int, ratio: Fraction) -> int:
    """The rule in exact arithmetic: nearest integer to S(1 - r), ties down; <= S - 1 when r > 0; >= 1."""
    exact = stride * (1 - ratio)
    k = exact.numerator // exact.denominator
    if exact - k > Fraction(1, 2):
        k += 1
    if ratio > 0:
        k = min(k, stride - 1)
    return max(1, k)


@pytest.mark.parametrize("stride", STRIDES)
def test_rule_at_every_ratio_in_steps_of_1_64(stride):
    for ratio in RATIOS:
        k = kept_per_window(stride, float(ratio))
        assert k == _expected(stride, ratio), (stride, ratio)
        achieved = 1 - Fraction(k, stride)
        if ratio > 0:
            assert k < stride  # a positive ratio always compresses at S >= 2
            assert achieved > 0
        assert window_ratio(stride, float(ratio)) == pytest.approx(float(achieved))
        # within half a step of the request, except where the floor of one entry or the cap of S - 1 apply
        off = abs(achieved - ratio) > Fraction(1, 2 * stride)
        assert (ratio_mismatch(stride, float(ratio)) is not None) == off
        if off:
            assert k in (1, stride - 1)


@pytest.mark.parametrize("stride", STRIDES)
def test_ties_go_to_more_compression(stride):
    for k in range(1, stride):
        ratio = 1 - (k + 0.5) / stride  # S(1 - r) = k + 1/2 exactly
        if 0 < ratio < 1:
            assert kept_per_window(stride, ratio) == k


def test_the_cases_that_motivated_the_rule():
    assert kept_per_window(4, 0.125) == 3 and compressed_length(1000, 4, 0.125, 4, 16) < 1000
    assert kept_per_window(4, 0.375) == 2 and kept_per_window(4, 0.625) == 1  # two ratios, two configurations
    assert kept_per_window(10, 0.75) == 2 and kept_per_window(10, 0.25) == 7
    assert kept_per_window(8, 0.0) == 8 and kept_per_window(1, 0.5) == 1
    assert "no compression" in ratio_mismatch(1, 0.5)


@pytest.mark.parametrize("cls", [ChunkedStridePress, PhaseAwarePress])
def test_warning_once_per_press(cls):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        press = cls(compression_ratio=0.05, stride=4)
        press.validate()
        press.validate()
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(messages) == 1 and "per-window ratio of 0.25" in messages[0] and cls.__name__ in messages[0]
    assert press.window_ratio == 0.25
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cls(compression_ratio=0.5, stride=8).validate()
        cls(compression_ratio=0.25, stride=10, window=10)  # k = 7 (tie, more compression): 0.3, within 1/20
    assert not [w for w in caught if "per-window ratio" in str(w.message)]


def test_positive_ratio_at_stride_one_warns():
    with pytest.warns(UserWarning, match="no compression"):
        ChunkedStridePress(compression_ratio=0.5, stride=1, window=1)
