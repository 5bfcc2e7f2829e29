"""Every invalid parameter is refused at construction with a ValueError naming it."""

import dataclasses

import numpy as np
import pytest
from kvpress import KeyDiffPress, KnormPress

from kvpress_phase import ChunkedStridePress, PhaseAwarePress, StaggeredWindowPress
from kvpress_phase.evaluation.presses import build_press, parse_press_spec
from kvpress_phase.presses.scorers import KeyDiffScorer, SCORERS, KVzipScorer, SnapKVScorer

BAD = [
    ("compression_ratio", -0.1),
    ("compression_ratio", 1.0),
    ("compression_ratio", "0.5"),
    ("stride", 0),
    ("stride", 2.5),
    ("offset", -1),
    ("n_sink", -1),
    ("n_local", -3),
    ("weighting", "max"),
    ("rope", "end"),
    ("backend", "cuda"),
    ("scorer", "no_such_scorer"),
    ("scorer", 3),
]
WINDOWS = [("window", 4), ("mode", "merge")]  # window < stride 8; the presses with windows of fixed slots


@pytest.mark.parametrize("cls,name,value",
                         [(c, n, v) for c in (ChunkedStridePress, PhaseAwarePress, StaggeredWindowPress) for n, v in BAD]
                         + [(c, n, v) for c in (ChunkedStridePress, StaggeredWindowPress) for n, v in WINDOWS],
                         ids=lambda x: x.__name__ if isinstance(x, type) else repr(x))
def test_invalid_parameter_names_itself(cls, name, value):
    with pytest.raises(ValueError, match=name):
        cls(**{name: value})


def test_select_mode_cannot_overlap():
    with pytest.raises(ValueError, match="window"):
        ChunkedStridePress(0.5, window=16, stride=8, mode="select")
    with pytest.raises(ValueError, match="overlap"):
        StaggeredWindowPress(0.5, mode="select", overlap=True)


@pytest.mark.parametrize("cls,kwargs", [(ChunkedStridePress, {}), (ChunkedStridePress, dict(window=2, mode="pool")),
                                        (PhaseAwarePress, {})])
def test_stride_1_with_a_positive_ratio_is_refused(cls, kwargs):
    """A window of one token keeps its one token, so at stride 1 a positive ratio would compress nothing."""
    with pytest.raises(ValueError, match="stride must be >= 2 for compression_ratio=0.25"):
        cls(compression_ratio=0.25, stride=1, **kwargs)
    assert cls(compression_ratio=0.0, stride=1, **kwargs).k == 1  # no compression asked: allowed, as at any stride


@pytest.mark.parametrize("name,value", [("residual", "keep"), ("pool_window", 4),
                                        ("recent", 1.5), ("weighting", "max"), ("rope", "end")])
def test_phase_aware_switches(name, value):
    with pytest.raises(ValueError, match=name):
        PhaseAwarePress(**{name: value})


@pytest.mark.parametrize("name,value", [("stagger", "row"), ("spread", "window"), ("overlap", "yes"), ("align", 1),
                                        ("budget", "row"), ("share_heads", "yes"), ("residual", "keep"),
                                        ("mode", "merge")])
def test_staggered_window_switches(name, value):
    with pytest.raises(ValueError, match=name):
        StaggeredWindowPress(**{name: value})


def test_phase_aware_holds_only_what_its_design_uses():
    for name in ("stagger", "align", "overlap", "window", "mode", "budget", "span", "decoding"):
        with pytest.raises(TypeError, match=name):
            PhaseAwarePress(0.5, **{name: None})


def test_phase_aware_window_conflicts():
    with pytest.raises(ValueError, match="window"):
        StaggeredWindowPress(0.5, window=8, stride=8, overlap=True)
    with pytest.raises(ValueError, match="window"):
        StaggeredWindowPress(0.5, window=16, stride=8, overlap=False)
    assert PhaseAwarePress(0.5, stride=8).effective_window == 8
    assert StaggeredWindowPress(0.5, stride=8, overlap=True).effective_window == 16
    assert StaggeredWindowPress(0.5, stride=8, overlap=None).effective_window == 16
    assert StaggeredWindowPress(0.5, stride=8, mode="select").effective_window == 8


def test_valid_presses_construct():
    ChunkedStridePress(0.0)
    ChunkedStridePress(0.9, window=12, stride=8, offset=3, n_sink=0, n_local=0, mode="pool", scorer=KnormPress())
    ChunkedStridePress(0.5, stride=4)  # select (the default) with the window equal to the stride
    StaggeredWindowPress(0.5, stagger="head_layer", align=True, overlap=False)
    PhaseAwarePress(0.5)


def test_window_topk_with_pooled_leftovers_needs_pool_mode_without_overlap():
    for kw in ({"mode": "select"}, {"overlap": True}):
        with pytest.raises(ValueError, match="budget='window_topk'"):
            StaggeredWindowPress(0.5, budget="window_topk", residual="pool", **kw)
    StaggeredWindowPress(0.5, budget="window_topk", mode="select")  # nothing is pooled with residual="drop"


@pytest.mark.parametrize("cls", [ChunkedStridePress, PhaseAwarePress])
def test_scorer_by_name_builds_the_scorer_of_the_shared_table(cls):
    for name, make in SCORERS.items():
        press = cls(0.5, scorer=name)
        assert press.scorer == make() and type(press.scorer) is type(make())
    assert SCORERS["knorm"] is KnormPress and SCORERS["snapkv"] is SnapKVScorer and SCORERS["kvzip"] is KVzipScorer
    press = cls(0.5, scorer="keydiff")
    assert press == cls(0.5) and "scorer=KeyDiffScorer(" in repr(press)
    assert press != cls(0.5, scorer=KeyDiffPress())  # kvpress's own class, asked through its own score
    assert type(dataclasses.replace(press, stride=4).scorer) is KeyDiffScorer
    assert type(dataclasses.replace(press, scorer="knorm").scorer) is KnormPress
    with pytest.raises(ValueError, match="unknown scorer 'keydif'.*keydiff"):
        cls(0.5, scorer="keydif")


def test_cli_press_specs_use_the_same_scorer_table():
    for name, make in SCORERS.items():
        for press_name in ("chunked_stride", "phase_aware"):
            spec = parse_press_spec(f"{press_name}:scorer={name}")
            assert build_press(spec, 0.5, 8, None, 0).scorer == make()
    with pytest.raises(ValueError, match="unknown scorer 'nope'; valid scorers: " + ", ".join(SCORERS)):
        parse_press_spec("phase_aware:scorer=nope")


@pytest.mark.parametrize("cls", [ChunkedStridePress, PhaseAwarePress])
def test_presses_take_the_integers_the_phase_functions_take(cls):
    """The presses check their numbers with kvpress_phase.core.phase's helper: numpy integers pass both, floats neither."""
    press = cls(np.float64(0.5), stride=np.int64(8), offset=np.int32(3))
    assert press.k == 4
    with pytest.raises(ValueError, match="offset"):
        cls(0.5, offset=np.float64(3.0))
