"""The targets tables' command line: press specs are read as the results name them (today's labels, whatever
spelling the run was written under or the spec is typed in), and a press the runs did not answer is refused with the
presses they did answer (exit code 2), not a traceback."""

from __future__ import annotations

import os

import pytest

from studies.targets import main

EXTRAS = os.path.join(os.path.dirname(__file__), "..", "..", "outputs", "budgets-dev", "agnostic-extras")
HEADS = "phase_aware:allocate=heads:share_heads=false:recent=0.1"


@pytest.fixture(scope="module")
def run_dir():
    if not os.path.isdir(os.path.join(EXTRAS, "results")):
        pytest.skip("the committed dev run is not in this checkout")
    return EXTRAS


def test_a_press_not_in_the_runs_is_named_with_those_that_are(run_dir, capsys):
    assert main([run_dir, "--press", "phase_aware:share_heads=false"]) == 2
    err = capsys.readouterr().err
    assert "'head_budget:floor=1.0' has no answers" in err and "no_press" in err


def test_a_reference_without_compressed_cells_is_refused(run_dir, capsys):
    # the spec is typed in a former spelling (the run was written under phase_aware:allocate=heads:share_heads=False):
    # both read as head_budget:recent=0.1, so it is found
    assert main([run_dir, "--press", HEADS, "--reference", "no_press"]) == 2
    assert "no compressed cell has answers of both" in capsys.readouterr().err


def test_an_unknown_press_spec_is_a_usage_error(run_dir, capsys):
    assert main([run_dir, "--press", "phase_awre"]) == 2
    assert "unknown press 'phase_awre'" in capsys.readouterr().err


def test_the_tables_name_the_press_as_the_results_do(run_dir, capsys):
    assert main([run_dir, "--press", HEADS, "--reference",
                 "phase_aware:allocate=heads:share_heads=false:recent=0.25"]) == 0
    out = capsys.readouterr().out
    assert "| task | tokens | S | ratio |" in out and "head_budget:recent=0.1" in out
    assert main([run_dir, "--press", "head_budget:recent=0.1", "--reference", "head_budget:recent=0.25"]) == 0
    assert capsys.readouterr().out == out  # today's spelling reads the same tables
    assert "T3 met in" in out


def test_against_compares_cell_by_cell_and_paired(run_dir, capsys):
    assert main([run_dir, "--press", HEADS, "--reference", "phase_aware:allocate=heads:share_heads=false:recent=0.25",
                 "--against", "phase_aware:scorer=kvzip:allocate=heads:share_heads=false"]) == 0
    out = capsys.readouterr().out
    assert "against head_budget:scorer=kvzip" in out
    assert "| query_agnostic | niah_single | 1024 | 8 | 0.75 |" in out
    assert "mean difference to `head_budget:scorer=kvzip`" in out
    assert main([run_dir, "--press", HEADS, "--reference", "phase_aware:allocate=heads:share_heads=false:recent=0.25",
                 "--against", "kvzip"]) == 2  # not answered in this run
    assert "--against 'kvzip' has no answers" in capsys.readouterr().err


def _flat_split(rng, shift=0.0, texts=24):
    """Answers of two presses on the same texts where only ``shift`` separates them: every text has its own
    difficulty (shared by both presses, every setting, ratio and phase), so a text's answers are correlated."""
    import itertools

    import pandas as pd

    rows = []
    for task, sample in itertools.product(("a", "b"), range(texts // 2)):
        easy = rng.uniform(0.2, 0.9)
        for setting, ratio, stride in itertools.product(("agnostic", "question"), (0.25, 0.75), (5, 8)):
            for phase in range(stride):
                for press, p in (("ours", easy + shift), ("theirs", easy)):
                    rows.append({"task": task, "sample_id": sample, "setting": setting, "context_length": 1024,
                                 "compression_ratio": ratio, "stride": stride, "phase": phase, "press": press,
                                 "score": float(rng.random() < min(p, 1.0))})
    return pd.DataFrame(rows)


def test_the_pooled_interval_holds_its_level_under_a_flat_truth():
    """Simulated null (the same texts, the same chance of an answer for both presses): the 95% interval excludes 0 in
    about 5% of splits. A pooling that counted every answer as independent would exclude it far more often."""
    import numpy as np

    from studies.common import paired_pooled

    rng = np.random.default_rng(0)
    fired = [not (t["low"] <= 0 <= t["high"]) for t in
             (paired_pooled(_flat_split(rng), "ours", "theirs") for _ in range(300))]
    assert 0.01 <= np.mean(fired) <= 0.10


def test_the_pooled_interval_sees_a_real_difference_and_refuses_a_missing_press():
    import numpy as np

    from studies.common import paired_pooled

    table = paired_pooled(_flat_split(np.random.default_rng(1), shift=0.25), "ours", "theirs")
    assert table["n"] == 24 and table["low"] > 0.1
    with pytest.raises(ValueError, match="no compressed answers of 'kvzip'"):
        paired_pooled(_flat_split(np.random.default_rng(1)), "ours", "kvzip")
