"""The rounding rule from a requested compression ratio to the entries each window keeps, and its warning."""

from __future__ import annotations

import warnings
from fractions import Fraction

import numpy as np
import pytest
import torch

from kvpress_phase import ChunkedStridePress, PhaseAwarePress, StaggeredWindowPress
from kvpress_phase.core.phase import (WindowLayout, compressed_length, group_bounds, group_membership, kept_per_window,
                                 merge_period, n_windows, phase_of, ratio_mismatch, window_ratio)

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


@pytest.mark.parametrize("cls", [ChunkedStridePress, PhaseAwarePress, StaggeredWindowPress])
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
        cls(compression_ratio=0.25, stride=10)  # k = 7 (tie, more compression): 0.3, within 1/20
    assert not [w for w in caught if "per-window ratio" in str(w.message)]


def test_positive_ratio_at_stride_one_is_refused():  # ratio_mismatch still says why (above); the press refuses it
    with pytest.raises(ValueError, match="stride must be >= 2"):
        ChunkedStridePress(compression_ratio=0.5, stride=1, window=1)


# ---------------------------------------------------------------------------------------------- argument checks
LAYOUT = dict(window=8, stride=8, k=4)
BAD_CALLS = [
    ("stride", lambda: phase_of(5, 0)),
    ("stride", lambda: phase_of(5, 2.5)),
    ("stride", lambda: phase_of(5, True)),
    ("position", lambda: phase_of(5.0, 4)),
    ("offset", lambda: phase_of(torch.arange(4), 4, torch.tensor([0.5]))),
    ("stride", lambda: kept_per_window(0, 0.5)),
    ("stride", lambda: kept_per_window(8.0, 0.5)),
    ("compression_ratio", lambda: kept_per_window(8, 1.5)),
    ("compression_ratio", lambda: kept_per_window(8, -0.1)),
    ("compression_ratio", lambda: kept_per_window(8, 1)),
    ("compression_ratio", lambda: kept_per_window(8, float("nan"))),
    ("compression_ratio", lambda: kept_per_window(8, "0.5")),
    ("stride", lambda: window_ratio(0, 0.5)),
    ("compression_ratio", lambda: window_ratio(8, True)),
    ("stride", lambda: ratio_mismatch(0, 0.5)),
    ("seq_len", lambda: n_windows(-1, 8, 4, 16)),
    ("stride", lambda: n_windows(100, 0, 4, 16)),
    ("n_sink", lambda: n_windows(100, 8, -1, 16)),
    ("n_local", lambda: n_windows(100, 8, 4, 1.5)),
    ("stride", lambda: compressed_length(100, 0, 0.5)),
    ("compression_ratio", lambda: compressed_length(100, 8, 1.0)),
    ("window", lambda: group_bounds(4, 8, 2)),
    ("k", lambda: group_bounds(8, 8, 0)),
    ("k", lambda: group_membership(8, 8, 2.0)),
    ("stride", lambda: merge_period(0, 1)),
    ("k", lambda: merge_period(8, 9)),
    ("offsets", lambda: WindowLayout.build(100, **LAYOUT, offsets=[1, 2, 3], heads=2)),
    ("offsets", lambda: WindowLayout.build(100, **LAYOUT, offsets=torch.zeros(3, 2, dtype=torch.long), batch=2,
                                           heads=2)),
    ("offsets", lambda: WindowLayout.build(100, **LAYOUT, offsets=[1.5, 2], heads=2)),
    ("offsets", lambda: WindowLayout.build(100, **LAYOUT, offsets="1")),
    ("stride", lambda: WindowLayout.build(100, window=8, stride=0, k=4)),
    ("window", lambda: WindowLayout.build(100, window=4, stride=8, k=4)),
    ("k", lambda: WindowLayout.build(100, window=8, stride=8, k=9)),
    ("seq_len", lambda: WindowLayout.build(-5, **LAYOUT)),
    ("heads", lambda: WindowLayout.build(100, **LAYOUT, heads=0)),
    ("batch", lambda: WindowLayout.build(100, **LAYOUT, batch=2.0)),
    ("n_sink", lambda: WindowLayout.build(100, **LAYOUT, n_sink=-1)),
]


@pytest.mark.parametrize("name,call", BAD_CALLS, ids=[f"{i}-{n}" for i, (n, _) in enumerate(BAD_CALLS)])
def test_invalid_arguments_are_refused_naming_the_argument(name, call):
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        call()


def test_integer_scalars_of_numpy_and_torch_are_accepted():
    assert phase_of(np.int64(13), np.int32(8), np.int64(3)) == 2
    assert phase_of(13, torch.tensor(8)) == 5
    assert kept_per_window(np.int64(8), np.float32(0.5)) == kept_per_window(8, 0.5) == 4
    assert compressed_length(torch.tensor(100), np.int64(8), 0.5) == compressed_length(100, 8, 0.5)
    assert merge_period(np.int16(8), torch.tensor(4)) == merge_period(8, 4)
    layout = WindowLayout.build(np.int64(100), window=np.int64(8), stride=np.int64(8), k=torch.tensor(4),
                                offsets=np.array([1, 6]), batch=2, heads=2)
    assert isinstance(layout.stride, int) and layout.first.tolist() == [[1, 6], [1, 6]]
    assert WindowLayout.build(100, **LAYOUT, offsets=[1, 6], batch=3, heads=2).offsets.shape == (3, 2)
