"""Task revisions: vt follows RULER since revision 2, and runs made with an earlier definition are planned again
with it and keep their fingerprints."""

import dataclasses
import glob
import json
import os

import pytest

from kvpress_phase.evaluation.config import EvalConfig, config_differences, from_saved, plan_units
from kvpress_phase.evaluation.tasks import TASKS, generate, get_task

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_vt_follows_ruler(word_tokenizer):
    row = generate("vt", word_tokenizer, n_samples=1, context_length=300, stride=4, phases=[0], seed=3)[0]
    n = len(row["answer"])
    assert row["answer_prefix"].endswith("are:")  # the list follows at once, as after RULER's "they are:"
    assert f" {n} variables " in row["answer_prefix"]  # the count, as RULER gives it
    assert row["max_new_tokens"] == 30 == TASKS["vt"].max_new_tokens  # RULER's tokens_to_generate for vt


def test_vt_revision_1_is_the_first_definition(word_tokenizer):
    kw = dict(n_samples=2, context_length=300, stride=4, phases=[0, 3], seed=3)
    old = generate("vt", word_tokenizer, revision=1, **kw)
    new = generate("vt", word_tokenizer, **kw)
    for o, n in zip(old, new):
        value = o["question"].split("the value ")[1].split(" in the text")[0]
        assert o["answer_prefix"] == f"The variables assigned the value {value} are"
        assert o["max_new_tokens"] == 16
        assert {k: v for k, v in o.items() if k not in ("answer_prefix", "max_new_tokens")} == \
            {k: v for k, v in n.items() if k not in ("answer_prefix", "max_new_tokens")}  # the same texts
    assert generate("vt", word_tokenizer, revision=2, **kw).to_list() == new.to_list()


def test_the_list_needles_have_rulers_budget_since_revision_2(word_tokenizer):
    kw = dict(n_samples=1, context_length=300, stride=4, phases=[0], seed=3)
    for task in ("niah_multivalue", "niah_multiquery"):
        new, old = generate(task, word_tokenizer, **kw)[0], generate(task, word_tokenizer, revision=1, **kw)[0]
        assert new["max_new_tokens"] == 128  # RULER's tokens_to_generate for its needle tasks
        assert old["max_new_tokens"] == 24
        assert {k: v for k, v in new.items() if k != "max_new_tokens"} == \
            {k: v for k, v in old.items() if k != "max_new_tokens"}  # only the budget changed


def test_unknown_revision_is_refused(word_tokenizer):
    with pytest.raises(ValueError, match="no revision 3; its revisions: 1, 2"):
        generate("vt", word_tokenizer, n_samples=1, context_length=300, stride=4, phases=[0], revision=3)
    with pytest.raises(ValueError, match="niah_single.*no revision 2"):
        get_task("niah_single").at(2)
    with pytest.raises(ValueError, match="prefix must be one of"):
        generate("vt", word_tokenizer, n_samples=1, context_length=300, stride=4, phases=[0], prefix="long")


def test_a_run_saved_before_revisions_is_planned_with_revision_1(word_tokenizer):
    saved = dataclasses.asdict(EvalConfig(tasks=["vt", "niah_single"], context_lengths=[128], samples=1,
                                          strides=[4]))
    del saved["task_revisions"]  # as every run made before tasks had revisions
    old = from_saved(saved)
    assert old.task_revisions == {"vt": 1, "niah_single": 1}
    budgets = {u.task: {r["max_new_tokens"] for r in u.rows} for u in plan_units(old, word_tokenizer)}
    assert budgets == {"vt": {16}, "niah_single": {8}}
    today = EvalConfig(tasks=["vt", "niah_single"], context_lengths=[128], samples=1, strides=[4])
    assert today.task_revisions == {"vt": 2, "niah_single": 1}
    assert today.fingerprint() != old.fingerprint()  # a vt run of today's does not resume into an old one
    assert config_differences(saved, today) == [("task_revisions", "tasks as first defined", "vt at revision 2")]
    # a run without a revised task keeps its fingerprint
    plain = dataclasses.asdict(EvalConfig(tasks=["niah_single"]))
    del plain["task_revisions"]
    assert from_saved(plain).fingerprint() == EvalConfig(tasks=["niah_single"]).fingerprint()


def test_every_committed_run_still_resumes():
    paths = sorted(glob.glob(os.path.join(ROOT, "outputs", "**", "config.json"), recursive=True))
    checked = 0
    for path in paths:
        with open(path) as fh:
            saved = json.load(fh)
        if "config" not in saved:  # other tools' config files (scorers)
            continue
        assert from_saved(saved["config"]).resumes(saved["fingerprint"]), path
        checked += 1
    assert checked >= 30
