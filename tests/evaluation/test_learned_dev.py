"""The learned-scorer dev round's decision rule (studies/learned_dev.py) on made-up cell tables: each rule can fire."""

from __future__ import annotations

import itertools

import pandas as pd

from studies.learned_dev import DENSE, MASKING, REFERENCE, best_baselines, decide, read_costs

CELLS = list(itertools.product(["query_agnostic", "query_aware"], ["niah_single", "niah_multikey"], [0.25, 0.5, 0.75]))


def _tables(means: dict, p: dict | None = None):
    rows = [{"setting": s, "task": t, "compression_ratio": r, "press": press, "mean": m}
            for press, m in means.items() for s, t, r in CELLS]
    tests = [{"setting": s, "task": t, "compression_ratio": r, "stride": stride, "press": press,
              "p_value": (p or {}).get(press, 0.5)} for press in means for s, t, r in CELLS for stride in (8, 12)]
    return pd.DataFrame(rows), pd.DataFrame(tests)


def test_the_dense_candidate_is_chosen_only_with_the_margin():
    means, tests = _tables({REFERENCE: 0.60, DENSE: 0.66, MASKING[0]: 0.70, MASKING[1]: 0.69, "kvzip_plus": 0.7})
    out = decide(means, tests, {})
    assert f"the default candidate is `{DENSE}`" in out
    assert f"better masking candidate is `{MASKING[0]}`" in out and "as an option" in out
    means, tests = _tables({REFERENCE: 0.60, DENSE: 0.64, MASKING[0]: 0.62, MASKING[1]: 0.61})
    out = decide(means, tests, {})
    assert "the frozen default stays" in out and "no option goes" in out


def test_a_phase_test_that_fires_after_holm_drops_a_candidate_and_one_that_does_not_keeps_it():
    means, tests = _tables({REFERENCE: 0.6, DENSE: 0.7, MASKING[0]: 0.7, MASKING[1]: 0.7})
    tests.loc[(tests.press == DENSE), "p_value"] = 0.001  # 24 x 0.001 = 0.024 < 0.05 after Holm
    tests.loc[(tests.press == MASKING[0]) & (tests.stride == 8) & (tests.task == "niah_single"), "p_value"] = 0.01
    out = decide(means, tests, {})
    assert f"`{DENSE}`: dropped (rule 1)" in out
    assert f"`{MASKING[0]}`: flat" in out  # 0.01 x 24 > 0.05: not significant for the family


def test_a_candidate_over_the_cost_cap_is_dropped(tmp_path):
    path = tmp_path / "cost.md"
    path.write_text("| press | compress step (ms) | in prefills | cache MiB | attended entries per layer and head |\n"
                    f"|---|---|---|---|---|\n| `{DENSE}` | 50.0 | 0.150 | 12.30 | 280.0 |\n")
    costs = read_costs(str(path))
    assert costs == {DENSE: 0.15}
    means, tests = _tables({REFERENCE: 0.6, DENSE: 0.7, MASKING[0]: 0.6, MASKING[1]: 0.6})
    assert f"`{DENSE}`: dropped (rule 2)" in decide(means, tests, costs)


def test_the_best_baseline_is_chosen_per_cell():
    means, _ = _tables({"kvzip_plus": 0.5, "adakv": 0.5, "kvzap": 0.2})
    means.loc[(means.press == "adakv") & (means.compression_ratio == 0.75), "mean"] = 0.9
    best = best_baselines(means)
    assert best[("query_aware", "niah_single", 0.75)] == "adakv"
    assert best[("query_aware", "niah_single", 0.25)] == "kvzip_plus"  # ties: the first of BASELINES


def test_committed_summaries_read_under_todays_labels():
    """A run's summary.json written under a former spelling (phase_aware:allocate=...) reads under today's labels, as
    its answers do, so a study that joins the two (learned_dev's phase tests) finds every press."""
    import os

    from kvpress_phase.evaluation.presses import parse_press_spec
    from studies.common import read_summaries
    from studies.learned_dev import phase_tests

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "outputs",
                        "learned-dev", "agnostic-s8")
    summaries = read_summaries([root])
    labels = set(summaries["press"])
    assert "layer_budget:scorer=kvzap" in labels and "global_budget:scorer=kvzap" in labels
    assert not any("allocate=" in label for label in labels)
    assert all(parse_press_spec(label).label == label for label in labels)  # every label is today's spelling
    tests = phase_tests([root])
    assert tests[tests.press == "global_budget:scorer=kvzap"]["p_value"].notna().all()
