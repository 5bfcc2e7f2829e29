"""The replication's verdict rules (``studies.replication``) on hand-made cell summaries: each verdict can come out
either way, and a cell at the floor makes a phase claim undetectable rather than refuted."""

import numpy as np
import pandas as pd
import pytest

from studies.replication import audit_claims, profiles_figure, r1_claims, with_floor


def _records(p_keydiff, p_knorm, mean=0.8, no_press=1.0):
    rows = []
    for task in ("niah_single", "niah_multikey"):
        for stride, ratio, press, p in ((20, 0.125, "chunk:scorer=keydiff", p_keydiff), (8, 0.25, "chunk", p_knorm),
                                        (20, 0.125, "chunkkv", 0.5)):
            rows.append({"setting": "query_agnostic", "task": task, "context_length": 1024, "stride": stride,
                         "compression_ratio": ratio, "press": press, "mean": mean, "p_value": p,
                         "per_phase": [mean] * stride})
            rows.append({"setting": "query_agnostic", "task": task, "context_length": 1024, "stride": stride,
                         "compression_ratio": 0.0, "press": "no_press", "mean": no_press, "p_value": None,
                         "per_phase": [no_press] * stride})
    return with_floor(pd.DataFrame(rows).drop_duplicates(subset=["task", "stride", "press"]))


def _verdicts(records):
    return {r["claim"]: r["verdict"] for r in audit_claims(records)}


def test_a_significant_cell_after_holm_replicates_and_a_flat_one_does_not():
    assert _verdicts(_records(0.001, 0.001)) == {"A1": "replicated", "A2": "replicated",
                                                 "A3": "no phase effect detected (reported)"}
    assert _verdicts(_records(0.5, 0.5))["A1"] == "not replicated"
    # 0.02 is below 0.05 alone but not after Holm over the six cells
    assert _verdicts(_records(0.02, 0.5))["A1"] == "not replicated"


@pytest.mark.parametrize("mean, no_press", [(0.1, 1.0), (0.8, 0.3)])
def test_a_cell_at_the_floor_is_undetectable(mean, no_press):
    verdicts = _verdicts(_records(0.5, 0.5, mean=mean, no_press=no_press))
    assert verdicts["A1"] == verdicts["A2"] == "undetectable at this sample size"


def test_claims_without_their_runs_read_not_run():
    assert set(_verdicts(None).values()) == {"not run"}


def _r1_records(p_chunked, weakest, mean=0.6):
    """B1-B3's 8 cells of one setting: chunked_stride with p ``p_chunked`` and its lowest phase at ``weakest``."""
    rows = []
    for task in ("niah_single", "niah_multikey"):
        for stride in (6, 10):
            cell = {"setting": "query_agnostic", "task": task, "context_length": 1024, "stride": stride}
            rows.append({**cell, "compression_ratio": 0.0, "press": "no_press", "mean": 1.0, "p_value": None,
                         "per_phase": [1.0] * stride})
            for ratio in (0.25, 0.5):
                phases = [mean + 0.2] * stride
                phases[weakest(stride)] = mean - 0.4
                rows.append({**cell, "compression_ratio": ratio, "press": "chunked_stride", "mean": mean,
                             "p_value": p_chunked, "per_phase": phases})
                rows.append({**cell, "compression_ratio": ratio, "press": "phase_aware", "mean": 0.9, "p_value": 0.8,
                             "per_phase": [0.9] * stride})
    return pd.DataFrame(rows)


@pytest.mark.parametrize("p, weakest, verdict", [
    (0.001, lambda s: s // 2, "replicated"),                       # weak in the middle of the window
    (0.001, lambda s: 0, "undetectable at this sample size"),      # an effect, but at the window's first phase
    (0.001, lambda s: s - 1, "undetectable at this sample size"),  # ... or its last
    (0.5, lambda s: s // 2, "not replicated"),                     # no cell significant, all readable
])
def test_b1_needs_a_significant_cell_weakest_inside_the_window(p, weakest, verdict):
    rows = {r["claim"]: r for r in r1_claims(_r1_records(p, weakest), baselines=[])}
    assert rows["B1"]["verdict"] == verdict
    assert rows["B2"]["verdict"] == "replicated"


def test_the_profiles_figure_is_drawn_and_refuses_a_press_without_answers(tmp_path):
    rng = np.random.default_rng(0)
    answers = pd.DataFrame([{"model": model, "setting": "query_agnostic", "press": "chunked_stride", "stride": 6,
                             "compression_ratio": 0.25, "phase": phase, "score": float(rng.random() < 0.7)}
                            for model in ("a", "b") for phase in range(6) for _ in range(16)])
    path = tmp_path / "profiles.png"
    profiles_figure(answers, str(path))
    assert path.stat().st_size > 1000
    with pytest.raises(ValueError, match="no answers of 'phase_aware'"):
        profiles_figure(answers, str(path), press="phase_aware")


def test_an_audit_still_answering_reads_incomplete_not_a_verdict():
    records = _records(0.001, 0.5)
    missing = records[~((records.press == "chunk") & (records.task == "niah_multikey"))]
    assert all(v.startswith("incomplete (5 of 6 cells answered; reads ") for v in _verdicts(missing).values())
    records.at[records.index[records.press == "chunkkv"][0], "per_phase"] = [0.8] * 19 + [None]
    assert _verdicts(records)["A1"] == "incomplete (1 of 6 cells still answering; reads replicated so far)"
    records["n_samples"] = 12
    assert _verdicts(records)["A2"].startswith("incomplete (6 of 6 cells still answering")
