"""``--windows``: which window each press runs at on each stride (:func:`~kvpress_phase.evaluation.config.windows_at`),
and presses refused before the model loads when they cannot run at a stride and window of the run."""

from __future__ import annotations

import pytest

from kvpress_phase.evaluation.config import EvalConfig, planned_answers, variants
from kvpress_phase.evaluation.presses import build_press

# the long-context study's grids: pooled windows of 8 every 4 tokens, and W = S = 8
GRIDS = dict(strides=[4, 8], windows=[8], compression_ratios=[0.5, 0.75])


def _windows(config: EvalConfig, label: str, stride: int) -> list:
    return sorted({w for spec, ratio, w in variants(config, stride) if spec.label == label and ratio > 0},
                  key=lambda w: (w is None, w))


@pytest.mark.parametrize("press, at_4, at_8", [
    ("chunked_stride:mode=pool", [8], [8]),  # the paper's compressed attention: windows of 8 every 4 tokens
    ("chunked_stride", [4], [8]),  # selection cannot overlap windows: W = S
    ("phase_aware", [4], [8]),  # no windows of its own: W = S
    ("global_budget:scorer=kvzap", [4], [8]),
    ("staggered_window", [4], [8]),
    ("knorm", [None], [None]),  # no grid
])
def test_a_window_longer_than_the_stride_applies_where_the_press_takes_one(press, at_4, at_8):
    config = EvalConfig(presses=["no_press", press], **GRIDS)
    config.validate()
    assert _windows(config, press, 4) == at_4
    assert _windows(config, press, 8) == at_8
    for stride in (4, 8):  # each builds at its window
        for spec, ratio, window in variants(config, stride):
            build_press(spec, ratio, stride, window, 0)


def test_overlapping_staggered_windows_run_at_the_longer_window():
    config = EvalConfig(presses=["staggered_window:mode=pool:overlap=true"], strides=[4], windows=[8])
    config.validate()
    assert _windows(config, "staggered_window:mode=pool:overlap=true", 4) == [8]
    # with overlap=True its windows must be longer than the stride: W = S = 8 is refused before the run
    with pytest.raises(ValueError, match="at stride 8, window 8"):
        EvalConfig(presses=["staggered_window:mode=pool:overlap=true"], strides=[4, 8], windows=[8]).validate()


def test_a_press_refused_at_one_stride_and_window_is_refused_before_the_run():
    # valid at stride 8 without --windows (what parsing the spec checks), but not with the run's window
    config = EvalConfig(presses=["staggered_window:mode=pool:overlap=true:window=16"], strides=[4], windows=[8])
    with pytest.raises(ValueError, match="at stride 4, window 8"):
        config.validate()


def test_the_plan_counts_one_variant_per_window_a_press_runs_at():
    config = EvalConfig(presses=["no_press", "chunked_stride", "chunked_stride:mode=pool", "phase_aware", "knorm"],
                        strides=[4, 8], windows=[8, 16], compression_ratios=[0.5], samples=2)
    # stride 4: pooled at W = 8 and 16, the others once each; stride 8 the same, W = 8 and 16 for the pooled
    assert [len(variants(config, s)) for s in (4, 8)] == [1 + 1 + 2 + 1 + 1, 1 + 1 + 2 + 1 + 1]
    assert planned_answers(config) == 2 * (4 * 6 + 8 * 6)
