"""studies.ragged_replay_check: answers of two runs joined by key, differences listed, bad input refused."""

import os

import pandas as pd
import pytest

from studies.ragged_replay_check import compare, main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN = os.path.join(ROOT, "outputs", "ragged-replay-check")


def _frame(predictions):
    return pd.DataFrame({"key": [f"k{i}" for i in range(len(predictions))], "prediction": predictions,
                         "press": "global_budget", "score": 1.0, "cache_bytes": 100,
                         "answer": [["7"]] * len(predictions)}).set_index("key")


def test_a_changed_answer_is_listed_with_both_predictions():
    _, lines = compare(_frame([" 7", " 8", " 9"]), _frame([" 7", " 5", " 9"]))
    assert "Identical predictions: 2; different: 1." in lines
    assert any("`k1`" in line and "' 8'" in line and "' 5'" in line for line in lines)


def test_runs_without_a_common_key_are_refused():
    frame = _frame([" 7"])
    with pytest.raises(ValueError, match="share no answer key"):
        compare(frame, frame.rename(index={"k0": "other"}))


def test_the_committed_check_reads_back(capsys):
    assert main([RUN, RUN]) == 0
    assert "different: 0" in capsys.readouterr().out
    assert main([RUN, "/no/such/run"]) == 2
