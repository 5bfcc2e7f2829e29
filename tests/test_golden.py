"""The presses' behaviour, pinned before they were reshaped: every press spec written in the docs builds the
configuration it built when the golden files were written (translated by :func:`reshaped`), and the built-in model gives the same answers and cache
lengths under every one of them (``tests/golden/``, written by ``python tests/golden/make_golden.py``, step by step,
its specs and keys read through the alias table of ``evaluation/spellings.py``;
replayed here with the default decoding). The real model's slice is ``tests/models/test_golden_slice.py``."""

from __future__ import annotations

import json
import os
import sys

import pandas as pd
import pytest

from kvpress_phase import load_builtin_model
from kvpress_phase.evaluation.presses import build_press, parse_press_spec
from kvpress_phase.evaluation.spellings import canonical_label, canonical_records
from kvpress_phase.evaluation.runner import run_evaluation

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
sys.path.insert(0, GOLDEN)

from make_golden import documented_specs, golden_config, press_fields  # noqa: E402


def _load(name):
    with open(os.path.join(GOLDEN, name)) as fh:
        return json.load(fh) if name.endswith(".json") else [json.loads(line) for line in fh]


ROW_NO_OPS = {"window": "None", "mode": None, "align": None, "overlap": None, "stagger": None, "spread": None}
"""Fields of the former PhaseAwarePress that did nothing under its row budget (any value; ``window`` only None)."""


def reshaped(fields: dict) -> dict:
    """The fields a golden configuration, written before the presses were reshaped, has now. Every change is
    listed here and checked, so a spec cannot silently build something else:

    - ``decoding`` (always False in the docs' specs) left the presses: decoding is ``WindowedDecodingPress``;
    - ``span`` and ``span_pool`` were removed (no documented spec used them: they must be at their defaults);
    - PhaseAwarePress's per-window budgets (``budget="window"``/``"window_topk"``) are ``StaggeredWindowPress``,
      which has no ``pool_window`` or ``recent`` (row-budget settings: at their defaults there);
    - under its row budget (now its only one) PhaseAwarePress's window and grid fields did nothing: dropped;
    - PhaseAwarePress's ``allocate``, ``floor`` and ``share_heads`` became budget wrappers around it
      (:data:`BUDGET_WRAPPERS`; ``share_heads=False`` alone is ``HeadBudgetPress(floor=1.0)``, each head its own
      even budget), and a configuration written before ``allocate`` existed has the even budget it always had;
    - ``KVzipScorer`` gained ``kvzip_plus_normalization`` (KVzip+'s scores), False for every earlier one;
    - our presses' default scorer and the name ``keydiff`` are ``KeyDiffScorer``, kvpress's ``KeyDiffPress`` with
      the same scores computed without a copy of the keys (``tests/presses/test_scorers.py``).
    """
    out = _keydiff_scorer(dict(fields))
    if "decoding" in out:
        assert out.pop("decoding") == "False"
    scorer = out.get("scorer")
    if isinstance(scorer, dict) and scorer["class"] == "KVzipScorer" and "kvzip_plus_normalization" not in scorer:
        out["scorer"] = {**scorer, "kvzip_plus_normalization": "False"}
    if out["class"] != "PhaseAwarePress" or "budget" not in out:
        return _wrapped(out)
    assert (out.pop("span"), out.pop("span_pool")) == ("0", "'max'")
    budget = out.pop("budget")
    if budget in ("'window'", "'window_topk'"):
        assert (out.pop("pool_window"), out.pop("recent")) == ("None", "0.0")
        return {**out, "class": "StaggeredWindowPress", "budget": budget}
    assert budget == "'row'"
    for name, only in ROW_NO_OPS.items():
        value = out.pop(name)
        assert only is None or value == only, (name, value)
    return _wrapped(out)


def _keydiff_scorer(fields: dict) -> dict:
    """``scorer`` ``KeyDiffPress`` -> ``KeyDiffScorer``, in a press and in the press it wraps."""
    scorer = fields.get("scorer")
    if isinstance(scorer, dict) and scorer.get("class") == "KeyDiffPress":
        fields["scorer"] = {**scorer, "class": "KeyDiffScorer"}
    if isinstance(fields.get("press"), dict) and fields.get("class") in BUDGET_WRAPPERS.values():
        fields["press"] = _keydiff_scorer(dict(fields["press"]))
    return fields


BUDGET_WRAPPERS = {"'heads'": "HeadBudgetPress", "'layers'": "LayerBudgetPress", "'layers_heads'": "GlobalBudgetPress"}


def _wrapped(out: dict) -> dict:
    """A PhaseAwarePress configuration with ``allocate``/``floor``/``share_heads`` as the budget wrapper it is now."""
    if out["class"] != "PhaseAwarePress":
        return out
    allocate, floor = out.pop("allocate", "'even'"), out.pop("floor", "0.0")
    share_heads = out.pop("share_heads", "True")
    if allocate == "'even'":
        assert floor in ("0.0", "0"), floor  # no floor without a budget spread by score
        return out if share_heads == "True" else {"class": "HeadBudgetPress", "press": out, "floor": "1.0"}
    return {"class": BUDGET_WRAPPERS[allocate], "press": out, "floor": floor}


def test_every_documented_spec_builds_its_golden_configuration():
    golden = _load("press_specs.json")  # its specs as written then, read through the alias table
    new = sorted(set(documented_specs()) - {canonical_label(text) for text in golden})
    assert not new, f"specs new in the docs, not in tests/golden: {new} (run tests/golden/make_golden.py)"
    for text, fields in golden.items():  # a spec that has left the docs still builds what it built
        assert press_fields(build_press(parse_press_spec(text), 0.5, 8, None, 0)) == reshaped(fields), text


def test_the_reshaping_translation_can_fail():
    golden = _load("press_specs.json")
    row = dict(golden["phase_aware:residual=drop"], residual="'pool'")
    assert press_fields(build_press(parse_press_spec("phase_aware:residual=drop"), 0.5, 8, None, 0)) != reshaped(row)
    with pytest.raises(AssertionError):
        reshaped(dict(golden["staggered_window"], recent="0.5"))  # a row setting under a window budget


@pytest.mark.slow
def test_builtin_model_answers_as_golden(tmp_path):
    rows = pd.DataFrame(_load("builtin_answers.jsonl"))  # keys as written then, read under today's labels
    rows["press"] = rows["key"].str.split("|").str[7]
    golden = {row["key"]: row for row in canonical_records(rows).to_dict("records")}
    config = golden_config(sorted(_load("press_specs.json")))
    config.step_by_step = False  # the default decoding must give the step-by-step answers
    model, tokenizer = load_builtin_model()
    results = run_evaluation(config, model, tokenizer, str(tmp_path), progress=False)
    assert sorted(results["key"]) == sorted(golden)
    for row in results.itertuples():
        expected = golden[row.key]
        assert (row.prediction, row.cache_length) == (expected["prediction"], expected["cache_length"]), row.key
