"""The replication's verdict rules (``studies.replication``) on hand-made cell summaries: each verdict can come out
either way, and a cell at the floor makes a phase claim undetectable rather than refuted."""

import pandas as pd
import pytest

from studies.replication import audit_claims, with_floor


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
