"""The best baseline of a cell is chosen among every registered kvpress baseline unless a study is told otherwise:
``studies.targets``, ``studies.replication`` and ``studies.learned_dev`` default to the whole set (KVzip+, AdaKV and
KVzapPress included), ``--baselines`` restricts it, and the per-ratio gaps come both with every answer and with every
cell weighing the same."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pytest

from kvpress_phase.evaluation.presses import REGISTRY

from studies import learned_dev, replication, targets
from studies.common import baseline_labels, kvpress_baselines, paired_pooled, pooled_by_ratio

OURS = ("no_press", "chunked_stride", "phase_aware", "staggered_window")


def test_the_default_set_is_every_registered_kvpress_baseline():
    names = kvpress_baselines()
    assert names == [name for name, entry in REGISTRY.items() if entry.matched]
    # the three the earlier default left out, and the ten it had
    assert {"kvzip_plus", "adakv", "kvzap"} <= set(names)
    assert {"snapkv", "knorm", "streaming_llm", "chunkkv", "chunk", "expected_attention", "tova", "keydiff",
            "pyramidkv", "kvzip"} <= set(names)
    assert not set(OURS) & set(names)
    # every kvpress press the registry describes is in the set
    assert {name for name, entry in REGISTRY.items() if entry.description.startswith("kvpress ")} <= set(names)
    assert baseline_labels() == names == baseline_labels("all")


def test_baselines_can_be_restricted_but_not_to_a_press_of_ours():
    assert baseline_labels("keydiff,kvzip") == ["keydiff", "kvzip"]
    assert baseline_labels("adakv:scorer=kvzap") == ["adakv:scorer=kvzap"]
    with pytest.raises(ValueError, match="'phase_aware' is not a kvpress baseline"):
        baseline_labels("keydiff,phase_aware")


def _answers(means: dict, stride: int = 4, samples: int = 4, ratio: float = 0.5) -> pd.DataFrame:
    """One cell (query-agnostic, ``niah_single``, 1,024 tokens): a press with mean m answers right in round(m x
    samples) of its samples at every phase; ``no_press`` answers everything at ratio 0."""
    rows = []
    for press, m in {"no_press": 1.0, **means}.items():
        right = round(m * samples)
        for sample, phase in itertools.product(range(samples), range(stride)):
            rows.append({"task": "niah_single", "context_length": 1024, "press": press, "protocol": "offset",
                         "setting": "query_agnostic", "compression_ratio": 0.0 if press == "no_press" else ratio,
                         "stride": stride, "phase": phase, "sample_id": sample, "score": float(sample < right)})
    return pd.DataFrame(rows)


# kvzap is the best baseline by far; the ten older baselines are all below the press
CELL = {"chunked_stride": 0.25, "phase_aware": 0.75, "snapkv": 0.25, "keydiff": 0.5, "kvzip": 0.5,
        "kvzip_plus": 0.5, "adakv": 0.5, "kvzap": 1.0}


def test_targets_counts_kvzap_kvzip_plus_and_adakv_by_default(monkeypatch, capsys):
    monkeypatch.setattr(targets, "load", lambda runs: _answers(CELL))
    assert targets.main(["run"]) == 0
    out = capsys.readouterr().out
    assert "| kvzap 1.000 |" in out and "**missed** (-0.25)" in out
    assert "T3 met in 0 of 1 cells" in out
    assert "every registered kvpress baseline" in out and "`kvzap`" in out
    # restricted to the ten older baselines the same cell is met against KeyDiff's 0.5
    assert targets.main(["run", "--baselines", "snapkv,knorm,streaming_llm,chunkkv,chunk,expected_attention,tova,"
                                               "keydiff,pyramidkv,kvzip"]) == 0
    out = capsys.readouterr().out
    assert "T3 met in 1 of 1 cells" in out and "10 of the" in out
    assert targets.main(["run", "--baselines", "phase_aware"]) == 2
    assert "not a kvpress baseline" in capsys.readouterr().err


def test_replication_counts_every_registered_baseline_by_default(monkeypatch):
    seen = []
    monkeypatch.setattr(replication, "load", lambda runs: _answers(CELL))
    monkeypatch.setattr(replication, "r1_claims", lambda records, baselines: seen.append(baselines) or [])
    monkeypatch.setattr(replication, "comparison_claims", lambda records, results, baselines: [])
    assert replication.main(["--main", "run"]) == 0
    assert seen == [kvpress_baselines()]


def test_the_learned_dev_best_baseline_is_any_registered_one():
    cells = list(itertools.product(["query_agnostic"], ["niah_single"], [0.25, 0.75]))
    means = pd.DataFrame([{"setting": s, "task": t, "compression_ratio": r, "press": p, "mean": m}
                          for p, m in {"kvzip_plus": 0.5, "keydiff": 0.5, "tova": 0.4}.items() for s, t, r in cells])
    means.loc[(means.press == "tova") & (means.compression_ratio == 0.75), "mean"] = 0.9
    best = learned_dev.best_baselines(means)
    assert best[("query_agnostic", "niah_single", 0.75)] == "tova"
    assert best[("query_agnostic", "niah_single", 0.25)] == "kvzip_plus"  # ties: the dev round's order first
    assert learned_dev.best_baselines(means, ("kvzip_plus", "keydiff"))[("query_agnostic", "niah_single", 0.75)] \
        == "kvzip_plus"


def _two_strides() -> pd.DataFrame:
    """Two texts; at stride 5 ``ours`` loses every answer ``theirs`` gets right, at stride 16 they are level."""
    rows = []
    for sample, (stride, lost) in itertools.product(range(2), ((5, True), (16, False))):
        for phase in range(stride):
            for press, score in (("ours", 0.0 if lost else 1.0), ("theirs", 1.0)):
                rows.append({"task": "niah_single", "sample_id": sample, "setting": "query_agnostic",
                             "context_length": 1024, "compression_ratio": 0.75, "stride": stride, "phase": phase,
                             "press": press, "score": score})
    return pd.DataFrame(rows)


def test_equal_cell_weights_differ_from_answer_weights_where_strides_differ():
    answers = paired_pooled(_two_strides(), "ours", "theirs")
    equal = paired_pooled(_two_strides(), "ours", "theirs", equal_cells=True)
    assert answers["diff"] == pytest.approx(-5 / 21)
    assert equal["diff"] == pytest.approx(-0.5)
    by_ratio = pooled_by_ratio(_two_strides(), "ours", "theirs")
    assert list(by_ratio.ratio) == [0.75] and by_ratio.cells.iloc[0] == 2
    assert by_ratio["diff"].iloc[0] == pytest.approx(-5 / 21) and by_ratio["equal"].iloc[0] == pytest.approx(-0.5)


def test_the_targets_summary_weighs_cells_both_ways():
    table = pd.DataFrame([
        {"ratio": 0.75, "press": 0.0, "best_mean": 1.0, "answers": 10, "t3": False},
        {"ratio": 0.75, "press": 1.0, "best_mean": 1.0, "answers": 30, "t3": True},
    ])
    out = targets.overall_markdown(table, "ours")
    assert "T3 met in 1 of 2 cells (50%" in out
    assert "| 0.75 | 2 | 1 | -0.250 | -0.500 |" in out  # 10 x -1 + 30 x 0 over 40; (-1 + 0) / 2
    assert np.isclose(-0.5, (table.press - table.best_mean).mean())


def test_the_replication_reads_equal_cell_weights_beside_the_pooled_figure():
    results = _two_strides()
    both = replication.both_settings(results, "ours", "theirs")["query_agnostic"]
    assert both["diff"] == pytest.approx(-5 / 21) and both["equal"]["diff"] == pytest.approx(-0.5)
    assert "(equal cell weights -0.500" in replication.interval(both)
