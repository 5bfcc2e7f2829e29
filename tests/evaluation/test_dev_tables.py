"""The budget dev round's decision rule (evaluation/dev_tables.py) on made-up cells."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from studies.dev_tables import decide, paired


def _cells(means: dict, p_values: dict = None) -> pd.DataFrame:
    rows = []
    for press, mean in means.items():
        for setting in ("query_agnostic", "question_compressed"):
            for task in ("niah_single", "niah_multikey"):
                for ratio in (0.25, 0.5, 0.75):
                    p = (p_values or {}).get((press, setting, task, ratio), 1.0)
                    rows.append(dict(press=press, setting=setting, task=task, compression_ratio=ratio, mean=mean,
                                     p_value=p))
    return pd.DataFrame(rows)


def test_a_candidate_must_beat_the_reference_by_the_margin():
    chosen, why = decide(_cells({"phase_aware": 0.60, "a": 0.64}), "phase_aware")
    assert chosen == "phase_aware" and "less than 0.05" in why
    chosen, _ = decide(_cells({"phase_aware": 0.60, "a": 0.66}), "phase_aware")
    assert chosen == "a"


def test_a_phase_effect_in_any_cell_drops_a_candidate_and_ties_are_listed():
    table = _cells({"phase_aware": 0.5, "a": 0.9, "b": 0.7, "c": 0.69},
                   {("a", "question_compressed", "niah_single", 0.5): 0.01})
    chosen, why = decide(table, "phase_aware")
    assert chosen == "b" and "`a`: dropped" in why and "`c` (0.690)" in why


def test_paired_differences_against_kvzip():
    rows = []
    for sample in range(10):
        for phase in range(4):
            rows.append(dict(setting="s", task="t", compression_ratio=0.5, sample_id=sample, press="ours",
                             score=float(phase < 2)))
        rows.append(dict(setting="s", task="t", compression_ratio=0.5, sample_id=sample, press="kvzip", score=1.0))
    table = paired(pd.DataFrame(rows), "kvzip")
    assert len(table) == 1 and table["diff"].iloc[0] == pytest.approx(-0.5) and table["n"].iloc[0] == 10
    assert np.isnan(table["low"].iloc[0]) or table["low"].iloc[0] == pytest.approx(-0.5)
