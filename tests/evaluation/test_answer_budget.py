"""studies.answer_budget: an answer is counted as cut exactly when its prediction reaches its example's budget."""

from __future__ import annotations

import json

import pytest

from kvpress_phase.evaluation.cli import main as cli_main
from studies.answer_budget import main, still_open, table


def test_a_prediction_at_the_budget_counts_as_cut(tmp_path):
    run = tmp_path / "run"
    assert cli_main(["eval", "--tasks", "vt,niah_single", "--presses", "no_press", "--strides", "4",
                     "--samples", "1", "--context-lengths", "128", "--no-diagnostics", "--output-dir", str(run)]) == 0
    before = table(str(run))
    assert set(before.task) == {"vt", "niah_single"} and (before.answers == 4).all()
    assert dict(zip(before.task, before.budget)) == {"vt": 30, "niah_single": 8}  # the tasks' own budgets

    shard = run / "results" / "results-rank0.jsonl"
    rows = [json.loads(line) for line in shard.read_text().splitlines()]
    vt = [r for r in rows if r["task"] == "vt"]
    for r, prediction in zip(vt, [" x" * 40, " x" * 40, "", ""]):  # two far past 30 tokens, two stopped at once
        r["prediction"] = prediction
    shard.write_text("".join(json.dumps(r) + "\n" for r in rows))
    after = table(str(run)).set_index("task")
    assert after.loc["vt", "cut"] == 0.5 and after.loc["vt", "found"] == 0.0
    assert after.loc["vt", "accuracy_of_cut"] == pytest.approx(sum(r["score"] for r in vt[:2]) / 2)  # stored scores
    assert after.loc["vt", "cut_wrong"] == pytest.approx(sum(r["score"] < 1 for r in vt[:2]) / 4)
    assert after.loc["niah_single", "cut"] == before.set_index("task").loc["niah_single", "cut"]  # untouched

    out = tmp_path / "t.md"
    assert main([str(run), "--output", str(out)]) == 0
    assert "| vt " in out.read_text()
    with pytest.raises(ValueError, match="config.json"):
        table(str(tmp_path))
    assert main([str(tmp_path)]) == 2  # on the command line: one line, exit 2


def test_open_answers_are_right_so_far():
    refs = ["storm", "onion", "parcel"]
    assert still_open("vt", "\n\n1. VAR storm\n2. VAR onion\n3. VAR par", refs)  # cut inside the last name
    assert still_open("vt", "VAR onion = VAR storm\nVAR storm", refs)  # the first name of each line counts
    assert not still_open("vt", "\n\n1. VAR storm\n2. VAR storm", refs)  # a repeat
    assert not still_open("vt", "1. VAR storm\n2. VAR canyon", refs)  # a name that is not a reference
    assert not still_open("vt", "The grass is green.", refs)  # no variable named
    values = ["69 57", "61 13", "64 69", "18 61"]
    assert still_open("niah_multiquery", " 69 57, 64 69, and 18", values)
    assert not still_open("niah_multiquery", " 69 57, 64 69, 69 57, and 18 61,", values)  # a repeat
    assert not still_open("niah_multivalue", " 26 17, 28 52", ["94 84", "26 18"])
    assert not still_open("qa_single_doc", "Hanoi", ["Hamburg"])  # one short answer: not a list
