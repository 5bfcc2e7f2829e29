"""The ratio-regimes fresh split's reading (studies/regimes_split.py) on made-up answers: the target per cell against
the best of every baseline, the yardstick of deviation 3 (the dev-chosen baseline, the paired difference to it, what
a tied press reaches) and the share_heads rule."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pytest

from kvpress_phase.evaluation.config import SETTINGS

from studies import regimes_split
from studies.regimes_runs import BASELINES, MATCHED, REFERENCE, SHARE_HEADS, G

MODELS = ("smollm2", "qwen2.5-coder-0.5b")
AGNOSTIC = SETTINGS[False]


def _records(accuracy: dict, samples: int = 4, strides=(3, 5), ratios=(0.25, 0.75), weak: dict | None = None,
             seed: int = 0, models=MODELS) -> pd.DataFrame:
    """Answers of every press in ``accuracy`` ({press: {ratio: accuracy}}, drawn per answer; the other baselines at
    0.2) and ``no_press`` at 1.0; ``weak`` ({press: phase}) makes that phase wrong in every text."""
    rng = np.random.default_rng(seed)
    rows = []
    presses = list(dict.fromkeys(list(accuracy) + list(BASELINES)))
    for model, stride, sample, phase in itertools.product(models, strides, range(samples), range(max(strides))):
        if phase >= stride:
            continue
        base = {"model": model, "setting": AGNOSTIC, "task": "niah_single", "context_length": 1024, "stride": stride,
                "sample_id": sample, "phase": phase}
        rows.append({**base, "press": "no_press", "compression_ratio": 0.0, "score": 1.0})
        for press, ratio in itertools.product(presses, ratios):
            p = accuracy.get(press, {}).get(ratio, 0.2)
            score = float(rng.random() < p)
            if weak and press in weak and phase == weak[press]:
                score = 0.0
            rows.append({**base, "press": press, "compression_ratio": ratio, "score": score})
    return pd.DataFrame(rows)


def _dev_best(best: str, ratios=(0.25, 0.75)) -> pd.DataFrame:
    index = pd.MultiIndex.from_tuples([(m, AGNOSTIC, "niah_single", 1024, r) for m in MODELS for r in ratios],
                                      names=["model", "setting", "task", "context_length", "compression_ratio"])
    return pd.DataFrame({"best": best, "best_mean": 0.9}, index=index)


def test_the_recommendation_is_parsed_per_ratio_or_once():
    assert regimes_split.parse_recommendation("phase_aware", (0.25, 0.5)) == {0.25: REFERENCE, 0.5: REFERENCE}
    both = regimes_split.parse_recommendation("0.25=phase_aware,0.5=global_budget:scorer=kvzap", (0.25, 0.5))
    assert both == {0.25: REFERENCE, 0.5: G}
    with pytest.raises(ValueError, match="names no press for ratio 0.5"):
        regimes_split.parse_recommendation("0.25=phase_aware", (0.25, 0.5))
    with pytest.raises(ValueError, match="the split runs ratios 0.25, 0.5"):
        regimes_split.parse_recommendation("0.3=phase_aware,0.25=phase_aware,0.5=phase_aware", (0.25, 0.5))
    with pytest.raises(ValueError, match="'kvzip' is not a press of ours"):
        regimes_split.parse_recommendation("kvzip", (0.25, 0.5))


def test_a_press_that_ties_the_best_baseline_is_read_beside_its_yardstick():
    """Ours and kvzip both at 1.0 at ratio 0.25, both at 0.7 at 0.75: every cell within 0.03 at 0.25; at 0.75 the
    counts are noisy, the dev-chosen baseline's paired difference is about 0, and a tied press's reach is < 1."""
    records = _records({REFERENCE: {0.25: 1.0, 0.75: 0.7}, "kvzip": {0.25: 1.0, 0.75: 0.7}, MATCHED: {}},
                       samples=8)
    table = regimes_split.cell_table(records, _dev_best("kvzip"), {0.25: REFERENCE, 0.75: REFERENCE}, cells=300)
    assert len(table) == 2 * 2 * 2  # models x strides x ratios
    low = table[table.compression_ratio == 0.25]
    assert low["near"].all() and (low["tied_reach"] == 1.0).all() and (low["dev_best"] == "kvzip").all()
    high = table[table.compression_ratio == 0.75]
    assert (high["tied_reach"] < 1.0).all() and (high["tied_reach"] > 0.2).all()
    paired = regimes_split.paired_dev_best(records, table)
    at_high = paired[paired.ratio == 0.75]
    assert (at_high["low"] < 0).all() and (at_high["high"] > 0).all()  # a tie: the interval covers 0
    out = regimes_split.target_markdown(table, {}, {0.25: REFERENCE, 0.75: REFERENCE})
    assert "### smollm2" in out and "(c) A press that ties the best baseline" in out


def test_a_weak_phase_and_a_trailing_press_miss_the_target():
    records = _records({G: {0.25: 0.95, 0.75: 0.95}, "keydiff": {0.25: 1.0, 0.75: 1.0}}, samples=12,
                       weak={G: 1})
    table = regimes_split.cell_table(records, _dev_best("keydiff"), {0.25: G, 0.75: G}, cells=200)
    assert not table["near"].any() and not table["near_dev"].any()
    assert (table["p_holm"] < 0.05).any()
    costs = {m: {G: {"bytes": 13.0, "prefills": 0.03}, MATCHED: {"bytes": 12.3, "prefills": 0.01}} for m in MODELS}
    out = regimes_split.target_markdown(table, costs, {0.25: G, 0.75: G})
    assert "(0%; target 80%): missed" in out and "after Holm's correction over 4 cells: missed" in out
    assert "1.057x `chunked_stride`'s bytes (target <= 1.05x: missed)" in out


def test_the_share_heads_rule_needs_both_models():
    better = _records({SHARE_HEADS: {0.25: 1.0, 0.75: 1.0}, REFERENCE: {0.25: 0.5, 0.75: 0.5}}, samples=8)
    assert "**`share_heads=false` becomes `PhaseAwarePress()`'s default**" in regimes_split.share_heads_markdown(better)
    one = better[~((better.model == MODELS[1]) & (better.press == SHARE_HEADS))]
    out = regimes_split.share_heads_markdown(one)
    assert f"| {MODELS[1]} | not answered |" in out and "does not become" in out


def test_every_press_of_ours_is_reported_against_the_best_baseline_and_the_recommendation():
    """G ties keydiff at 0.25 and trails by 0.5 at 0.75; phase_aware is at 0.5 throughout: its difference to G is
    about -0.5 at 0.25 and about 0 at 0.75, G's own rows say they are the recommendation."""
    records = _records({G: {0.25: 1.0, 0.75: 0.5}, REFERENCE: {0.25: 0.5, 0.75: 0.5}, "keydiff": {0.25: 1.0,
                                                                                                   0.75: 1.0}},
                       samples=16)
    table = regimes_split.ours_table(records, {0.25: G, 0.75: G}).set_index(["model", "press", "ratio"])
    g_low, g_high = table.loc[(MODELS[0], G, 0.25)], table.loc[(MODELS[0], G, 0.75)]
    assert g_low["near"] == g_low["cells"] == 2 and g_low["texts"] == 0
    assert g_high["near"] == 0 and g_high["gap"] == pytest.approx(-0.5, abs=0.15)
    ours_low, ours_high = table.loc[(MODELS[0], REFERENCE, 0.25)], table.loc[(MODELS[0], REFERENCE, 0.75)]
    assert ours_low["high"] < -0.3 and ours_low["texts"] == 16
    assert ours_high["low"] < 0 < ours_high["high"]
    out = regimes_split.ours_markdown(table.reset_index())
    assert f"| {MODELS[0]} | `{G}` | 0.25 | 2 of 2 | +0.000 | (the recommendation) |" in out


def test_the_runs_say_which_are_finished():
    from kvpress_phase.evaluation.merging import RunInfo

    infos = [RunInfo("out/a", MODELS[0], 53, 10, 10, {"context_lengths": [1024], "compress_question": False}),
             RunInfo("out/b", MODELS[0], 53, 4, 10, {"context_lengths": [2048], "compress_question": True})]
    out = regimes_split.runs_markdown(infos)
    assert out.startswith("1 of 8 planned runs finished.")
    assert f"| {MODELS[0]} | query-agnostic | 1024 | `out/a` | 10 / 10 |" in out
    assert f"| {MODELS[0]} | query-aware | 2048 | `out/b` | 4 / 10 (running or stopped) |" in out
    assert out.count("not started") == 6


def test_the_command_line_refuses_what_it_cannot_read(monkeypatch, capsys):
    records = _records({REFERENCE: {0.25: 1.0, 0.75: 1.0}}, samples=2)
    monkeypatch.setattr(regimes_split, "load_runs", lambda runs: (records, []))
    assert regimes_split.main(["split", "--recommend", "0.25=kvzip,0.5=phase_aware,0.75=phase_aware"]) == 2
    assert "'kvzip' is not a press of ours" in capsys.readouterr().err
    assert regimes_split.main(["split", "--recommend", "global_budget:scorer=kvzap"]) == 2
    assert "has no answers in the split runs" in capsys.readouterr().err
    assert regimes_split.main(["split", "--recommend", "phase_aware", "--cells", "100"]) == 0
    out = capsys.readouterr().out
    assert "0 of 8 planned runs finished." in out
    assert "## The share_heads rule" in out and "## Every press of ours, reported" in out
