"""Every invalid parameter is refused at construction with a ValueError naming it."""

import pytest
from kvpress import KnormPress

from kvpress_phase import ChunkedStridePress, PhaseAwarePress

BAD = [
    ("compression_ratio", -0.1),
    ("compression_ratio", 1.0),
    ("compression_ratio", "0.5"),
    ("stride", 0),
    ("stride", 2.5),
    ("window", 4),  # < stride 8
    ("offset", -1),
    ("n_sink", -1),
    ("n_local", -3),
    ("mode", "merge"),
    ("weighting", "max"),
    ("rope", "end"),
    ("backend", "cuda"),
    ("scorer", "knorm"),
    ("decoding", "yes"),
]


@pytest.mark.parametrize("cls", [ChunkedStridePress, PhaseAwarePress])
@pytest.mark.parametrize("name,value", BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_invalid_parameter_names_itself(cls, name, value):
    with pytest.raises(ValueError, match=name):
        cls(**{name: value})


def test_select_mode_cannot_overlap():
    with pytest.raises(ValueError, match="window"):
        ChunkedStridePress(0.5, window=16, stride=8, mode="select")
    with pytest.raises(ValueError, match="overlap"):
        PhaseAwarePress(0.5, mode="select", overlap=True, budget="window")


@pytest.mark.parametrize("name,value", [("stagger", "row"), ("spread", "window"), ("overlap", "yes"), ("align", 1),
                                        ("budget", "tokens"), ("span", -1), ("span_pool", "min"),
                                        ("share_heads", "yes"), ("residual", "keep"), ("pool_window", 4)])
def test_phase_aware_switches(name, value):
    with pytest.raises(ValueError, match=name):
        PhaseAwarePress(**{name: value})


def test_phase_aware_window_conflicts():
    with pytest.raises(ValueError, match="window"):
        PhaseAwarePress(0.5, window=8, stride=8, overlap=True, budget="window")
    with pytest.raises(ValueError, match="window"):
        PhaseAwarePress(0.5, window=16, stride=8, overlap=False)
    assert PhaseAwarePress(0.5, stride=8).effective_window == 8
    assert PhaseAwarePress(0.5, stride=8, overlap=True, budget="window").effective_window == 16
    assert PhaseAwarePress(0.5, stride=8, overlap=None, budget="window").effective_window == 16
    assert PhaseAwarePress(0.5, stride=8, mode="select", budget="window").effective_window == 8


def test_valid_presses_construct():
    ChunkedStridePress(0.0)
    ChunkedStridePress(0.9, window=12, stride=8, offset=3, n_sink=0, n_local=0, mode="pool", scorer=KnormPress())
    ChunkedStridePress(0.5, stride=4)  # select (the default) with the window equal to the stride
    PhaseAwarePress(0.5, stagger="head_layer", align=True, overlap=False, budget="window")
    PhaseAwarePress(0.5)


def test_content_budgets_need_pool_mode_without_overlap():
    for kw in ({"mode": "select"}, {"overlap": True}):
        with pytest.raises(ValueError, match="budget='row'"):
            PhaseAwarePress(0.5, budget="row", residual="pool", **kw)
    PhaseAwarePress(0.5, budget="row", mode="select")  # nothing is pooled with residual="drop" (the default)
