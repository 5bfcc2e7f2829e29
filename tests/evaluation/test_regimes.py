"""The ratio-regimes dev round's decision rule (studies/regimes_rules.py, its inputs studies/regimes_runs.py, its
command line studies/regimes.py) on made-up cells and made-up run folders: a per-ratio recommendation with one switch,
one press where it holds everywhere, a flat test that drops a candidate, T in G's place where they tie, and a round
with a run missing that prints no decision."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shutil

import pandas as pd
import pytest

from kvpress_phase.evaluation.config import SETTINGS, EvalConfig
from kvpress_phase.evaluation.store import record_key

from studies import regimes, regimes_rules, regimes_runs, regimes_split
from studies.regimes_rules import decide
from studies.regimes_runs import (BASELINES, DEV, G, G_FLOOR, MATCHED, OURS, REFERENCE, SHARE_HEADS, D, Design, T,
                                  read_cost_table)

HIGH, LOW = 0.8, 0.5


def _cells(design: Design = DEV) -> list[tuple]:
    """The dev cells of one ratio, both models: (model, setting, task, length)."""
    return list(itertools.product(design.models, design.settings, design.tasks, design.lengths))


def _means(near: dict, design: Design = DEV) -> pd.DataFrame:
    """Made-up cell means: ``kvzip`` is the best baseline at 0.8 in every cell (the other baselines 0.5); a press of
    ours is at 0.8 in the first ``near[press][ratio]`` cells of the ratio and at 0.5 (0.3 below the best) in the
    rest."""
    rows = []
    for ratio in design.ratios:
        for i, (model, setting, task, length) in enumerate(_cells(design)):
            cell = {"model": model, "setting": setting, "task": task, "context_length": length,
                    "compression_ratio": ratio, "texts": 16}
            for press in BASELINES:
                rows.append({**cell, "press": press, "mean": HIGH if press == "kvzip" else LOW})
            for press in OURS + (MATCHED,):
                k = near.get(press, {}).get(ratio, 0)
                rows.append({**cell, "press": press, "mean": HIGH if i < k else LOW})
    return pd.DataFrame(rows)


def _tests(p: dict | None = None, design: Design = DEV) -> pd.DataFrame:
    rows = []
    for ratio, (model, setting, task, length), stride, press in itertools.product(
            design.ratios, _cells(design), design.strides, OURS):
        rows.append({"model": model, "setting": setting, "task": task, "context_length": length,
                     "compression_ratio": ratio, "stride": stride, "press": press,
                     "p_value": (p or {}).get(press, 0.5)})
    return pd.DataFrame(rows)


def _pooled(p: dict | None = None, design: Design = DEV) -> pd.DataFrame:
    """Made-up pooled tests (deviation 2): per model, stride and press of ours, p 0.5 unless ``p`` names it."""
    return pd.DataFrame([{"model": m, "stride": s, "press": press, "texts": 108, "p_value": (p or {}).get(press, 0.5)}
                         for m, s, press in itertools.product(design.models, design.strides, OURS)])


BYTES = {MATCHED: 12.30, REFERENCE: 12.30, D: 12.30, G: 12.31, G_FLOOR: 12.31, T: 12.31, SHARE_HEADS: 12.30}
PREFILLS = {MATCHED: 0.013, REFERENCE: 0.012, D: 0.024, G: 0.030, G_FLOOR: 0.031, T: 0.035, SHARE_HEADS: 0.014}


def _costs(design: Design = DEV, **change) -> dict:
    out = {}
    for model in design.models:
        out[model] = {p: {"bytes": BYTES[p], "prefills": PREFILLS[p]} for p in BYTES}
        for press, value in change.items():
            out[model][press] = {**out[model][press], **value}
    return out


def _shares(multiple: float = 1.0, design: Design = DEV) -> pd.DataFrame:
    return pd.DataFrame([{"model": m, "ratio": "all", "answers": 1, "press": multiple, "against": 1.0,
                          "multiple": multiple} for m in design.models])


def _every(k: int) -> dict:
    return {r: k for r in DEV.ratios}


def test_a_press_winning_at_low_ratios_and_another_at_high_ratios_switch_once():
    near = {REFERENCE: {0.25: 24, 0.5: 24, 0.75: 0}, G: {0.25: 0, 0.5: 3, 0.75: 24}, T: {0.75: 20}}
    out = decide(_means(near), _tests(), _pooled(), _costs(), _shares())
    assert "No candidate is within 2 cells of the best at every ratio" in out
    assert f"- ratio 0.25: `{REFERENCE}` (24/24)" in out and f"- ratio 0.75: `{G}` (24/24)" in out
    assert "G stays; T costs 4 cells" in out  # rule 5: G's 24 against T's 20 is no tie
    assert (f"**Recommendation: `{REFERENCE}` below ratio 0.75 (ratios 0.25, 0.5), `{G}` from ratio 0.75 "
            "(ratios 0.75).**") in out
    # what follows: the split for both specs, read with the recommendation per ratio
    assert f"`bash studies/run_regimes_split.sh {REFERENCE},{G}`" in out
    assert f"--recommend 0.25={REFERENCE},0.5={REFERENCE},0.75={G} --cost smollm2=" in out
    assert regimes_split.parse_recommendation(f"0.25={REFERENCE},0.5={REFERENCE},0.75={G}") == {
        0.25: REFERENCE, 0.5: REFERENCE, 0.75: G}


def test_one_press_within_two_cells_at_every_ratio_is_the_recommendation_everywhere():
    near = {REFERENCE: {0.25: 22, 0.5: 24, 0.75: 24}, G: {0.25: 24, 0.5: 10, 0.75: 10}}
    out = decide(_means(near), _tests(), _pooled(), _costs(), _shares())
    assert f"- ratio 0.25: `{G}` (24/24)" in out  # rule 3 alone would switch
    assert f"`{REFERENCE}` is within 2 cells of the best at every ratio" in out
    assert f"**Recommendation: `{REFERENCE}` at every ratio.**" in out
    assert f"`bash studies/run_regimes_split.sh {REFERENCE}`" in out and f"--recommend {REFERENCE} --cost" in out
    # three cells short at one ratio and it no longer holds: the per-ratio picks stand
    near[REFERENCE][0.25] = 21
    out = decide(_means(near), _tests(), _pooled(), _costs(), _shares())
    assert f"**Recommendation: `{G}` below ratio 0.5 (ratios 0.25), `{REFERENCE}` from ratio 0.5" in out


def test_a_tie_within_one_cell_goes_to_the_lower_bytes():
    near = {REFERENCE: _every(23), G: _every(24)}
    out = decide(_means(near), _tests(), _pooled(), _costs(), _shares())
    assert f"to `{REFERENCE}` by 1.000x bytes" in out
    assert f"**Recommendation: `{REFERENCE}` at every ratio.**" in out
    near = {REFERENCE: _every(22), G: _every(24)}  # two cells apart: no tie
    out = decide(_means(near), _tests(), _pooled(), _costs(), _shares())
    assert f"**Recommendation: `{G}` at every ratio.**" in out


def test_a_phase_test_that_fires_after_holm_drops_the_candidate():
    near = {REFERENCE: _every(10), G: _every(24)}
    out = decide(_means(near), _tests({G: 0.0001}), _pooled(), _costs(), _shares())  # 144 x 0.0001 < 0.05
    assert f"`{G}` is dropped by rule 1" in out
    assert f"**Recommendation: `{REFERENCE}` at every ratio.**" in out
    tests = _tests()
    tests.loc[(tests.press == G) & (tests.stride == 8) & (tests.task == "niah_single")
              & (tests.compression_ratio == 0.25) & (tests.model == "smollm2")
              & (tests.setting == SETTINGS[False]) & (tests.context_length == 1024), "p_value"] = 0.001
    out = decide(_means(near), tests, _pooled(), _costs(), _shares())  # one test at 0.001: 0.144 after Holm, flat
    assert "is dropped by rule 1" not in out and f"**Recommendation: `{G}` at every ratio.**" in out
    # deviation 2: the pooled tests drop it alone (4 tests: 0.004 x 4 < 0.05), but not at 0.02 (0.08 after Holm)
    out = decide(_means(near), _tests(), _pooled({G: 0.004}), _costs(), _shares())
    assert f"`{G}` is dropped by rule 1: its phase tests fire after Holm's correction, pooled" in out
    assert f"**Recommendation: `{REFERENCE}` at every ratio.**" in out
    out = decide(_means(near), _tests(), _pooled({G: 0.02}), _costs(), _shares())
    assert "is dropped by rule 1" not in out and "| 4 (432) | 0.020 | 0.080 | flat |" in out


def test_cost_bytes_and_entries_drop_a_candidate():
    near = {REFERENCE: _every(10), G: _every(24), T: _every(24)}
    out = decide(_means(near), _tests(), _pooled(), _costs(), _shares())
    assert "T ties G" in out and f"**Recommendation: `{T}` at every ratio.**" in out  # rule 5
    out = decide(_means(near), _tests(), _pooled(), _costs(), _shares(1.08))
    assert f"`{T}` is dropped by rule 2" in out and "1.080x G's entries > 1.05x" in out
    assert f"**Recommendation: `{G}` at every ratio.**" in out
    out = decide(_means(near), _tests(), _pooled(), _costs(**{G: {"bytes": 13.0}, T: {"prefills": 0.2}}), _shares())
    assert f"`{G}` is dropped by rule 2" in out and f"`{T}` is dropped by rule 2" in out
    assert f"**Recommendation: `{REFERENCE}` at every ratio.**" in out


def test_a_non_monotone_pick_is_resolved_to_one_switch():
    near = {REFERENCE: {0.25: 24, 0.5: 0, 0.75: 24}, D: {0.25: 0, 0.5: 24, 0.75: 12}}
    out = decide(_means(near), _tests(), _pooled(), _costs(), _shares())
    assert f"Rule 3's picks (`{REFERENCE}`, `{D}`, `{REFERENCE}`) switch more than once" in out
    # (phase_aware, D, D), (phase_aware x 3) and (D, D, phase_aware) keep two picks each; the first has 60 cells
    assert (f"**Recommendation: `{REFERENCE}` below ratio 0.5 (ratios 0.25), `{D}` from ratio 0.5 (ratios 0.5, "
            "0.75).**") in out
    with pytest.raises(ValueError, match="switches at most once"):
        regimes_rules.recommendation_text([REFERENCE, D, REFERENCE], DEV.ratios)


def test_cost_tables_read_the_ragged_column_for_ours(tmp_path):
    path = tmp_path / "cost.md"
    path.write_text("| press | compress step (ms) | in prefills | cache MiB | ragged MiB | attended |\n"
                    "|---|---|---|---|---|---|\n"
                    f"| `{MATCHED}` | 30.0 | 0.013 | 12.30 | 12.30 | 280.0 |\n"
                    f"| `{G}` | 60.0 | 0.026 | 45.00 | 12.31 | 280.0 |\n"
                    "| `adakv` | 15.9 | 0.007 | 45.00 | 12.31 | 280.0 |\n")
    assert read_cost_table(str(path))[G] == {"prefills": 0.026, "cache_mib": 45.0, "ragged_mib": 12.31}
    costs = regimes_runs.read_costs([f"smollm2={path}"])
    assert costs["smollm2"][G]["bytes"] == 12.31 and costs["smollm2"]["adakv"]["bytes"] == 45.0
    with pytest.raises(ValueError, match="give MODEL=FILE"):
        regimes_runs.read_costs([str(path)])
    with pytest.raises(ValueError, match="not a model of the round"):
        regimes_runs.read_costs([f"llama={path}"])
    old = tmp_path / "old.md"
    old.write_text("| press | compress step (ms) | in prefills | cache MiB | attended |\n|---|---|---|---|---|\n"
                   f"| `{G}` | 60.0 | 0.026 | 45.00 | 280.0 |\n")
    with pytest.raises(ValueError, match="without the \"ragged MiB\" column"):
        regimes_runs.read_costs([f"smollm2={old}"])


# ---------------------------------------------------------------------------------------- made-up run folders
TINY = Design(models=("smollm2",), settings=(SETTINGS[False],), stride_seeds=((2, 10), (3, 15)), lengths=(256,),
              tasks=("niah_single", "niah_multikey", "niah_multivalue"), ratios=(0.25, 0.75), samples=2,
              presses=("no_press", MATCHED) + OURS + ("keydiff", "kvzip"))
SCORES = {0.25: {REFERENCE: 1.0, "keydiff": 1.0}, 0.75: {G: 1.0, T: 1.0, "kvzip": 1.0}}
"""Made-up answers: every press answers right where named here, wrong elsewhere (no_press always right)."""


def _run(root, stride: int, answered: int | None = None, design: Design = TINY, samples: int | None = None) -> str:
    """A run folder of ``design`` at ``stride``: config.json, a results shard (its first ``answered`` answers) and
    summary.json (every phase test p = 0.9); ``samples`` per phase (default: what ``design`` plans for it)."""
    seed = dict(design.stride_seeds)[stride]
    samples = design.samples_of((design.models[0], design.settings[0], stride, design.lengths[0])) \
        if samples is None else samples
    folder = os.path.join(root, f"agnostic-s{stride}-{design.lengths[0]}")
    os.makedirs(os.path.join(folder, "results"))
    config = EvalConfig(model=design.models[0], tasks=list(design.tasks), presses=list(design.presses),
                        compression_ratios=list(design.ratios), strides=[stride], protocol="offset",
                        context_lengths=list(design.lengths), samples=samples, seed=seed, matched_cache=True)
    with open(os.path.join(folder, "config.json"), "w") as fh:
        json.dump({"config": dataclasses.asdict(config), "fingerprint": config.fingerprint()}, fh)
    records, summary = [], []
    for task, press in itertools.product(design.tasks, design.presses):
        for ratio in ([0.0] if press == "no_press" else design.ratios):
            summary.append({"task": task, "context_length": design.lengths[0], "press": press,
                            "compression_ratio": ratio, "stride": stride, "protocol": "offset",
                            "setting": SETTINGS[False], "mean": 0.5, "p_value": 0.9})
            for sample, phase in itertools.product(range(samples), range(stride)):
                right = press == "no_press" or SCORES[ratio].get(press, 0.0)
                cache = 256 * (1 - ratio) * (1.02 if press == T else 1.0)
                record = {"task": task, "context_length": design.lengths[0], "stride": stride,
                          "window": None, "protocol": "offset", "sample_id": sample, "phase": phase, "press": press,
                          "compression_ratio": ratio, "setting": SETTINGS[False], "seed": seed,
                          "score": float(right), "cache_length": 256.0 if press == "no_press" else cache}
                records.append({**record, "key": record_key(record)})
    with open(os.path.join(folder, "results", "rank0.jsonl"), "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records[:answered])
    with open(os.path.join(folder, "summary.json"), "w") as fh:
        json.dump(summary, fh)
    return folder


def _cost_file(root) -> str:
    path = os.path.join(root, "cost.md")
    with open(path, "w") as fh:
        fh.write("| press | compress step (ms) | in prefills | cache MiB | ragged MiB | attended |\n"
                 "|---|---|---|---|---|---|\n")
        fh.writelines(f"| `{p}` | 1.0 | {PREFILLS[p]} | {BYTES[p]} | {BYTES[p]} | 1.0 |\n" for p in BYTES)
    return path


def test_a_missing_or_unfinished_run_leaves_the_decision_pending(tmp_path, capsys):
    first = _run(str(tmp_path), 2)
    cost = ["--cost", f"smollm2={_cost_file(str(tmp_path))}"]
    missing = os.path.join(str(tmp_path), "agnostic-s3-256")
    assert regimes.main([first, missing] + cost, design=TINY) == 0
    out = capsys.readouterr().out
    assert "**decision pending: 1 of 2 runs finished.**" in out and "Recommendation" not in out
    assert f"`{missing}`" in out and "(not started)" in out
    assert "| smollm2 | 6 of 6 | 0 of 6 |" in out  # every cell answered, none by both strides yet
    # the second run under way: still pending
    second = _run(str(tmp_path), 3, answered=40)
    assert regimes.main([first, second] + cost, design=TINY) == 0
    out = capsys.readouterr().out
    assert "**decision pending: 1 of 2 runs finished.**" in out and "40 / " in out and "(under way)" in out
    # finished: the decision, phase_aware below 0.75 and T (tied with G, rule 5) from 0.75
    shutil.rmtree(second)
    second = _run(str(tmp_path), 3)
    assert regimes.main([first, second], design=TINY) == 0
    assert "decision pending: cost and bytes not measured for smollm2" in capsys.readouterr().out
    assert regimes.main([first, second] + cost, design=TINY) == 0
    out = capsys.readouterr().out
    assert "pending" not in out and "1.020x" in out
    assert f"**Recommendation: `{REFERENCE}` below ratio 0.75 (ratios 0.25), `{T}` from ratio 0.75" in out


def test_a_run_of_another_configuration_is_refused_by_name(tmp_path, capsys):
    folder = _run(str(tmp_path), 2)
    other = Design(**{**dataclasses.asdict(TINY), "stride_seeds": ((2, 11), (3, 15))})
    assert regimes.main([folder], design=other) == 2
    err = capsys.readouterr().err
    assert folder in err and "seed at stride 2: 10, the round's 11" in err


def test_a_run_planned_with_its_own_sample_count_counts_its_texts(tmp_path, capsys):
    """Deviation 1: one run keeps the count it began with (``samples_by_run``); the others answer ``samples``."""
    design = Design(**{**dataclasses.asdict(TINY),
                       "samples_by_run": (((TINY.models[0], TINY.settings[0], 2, TINY.lengths[0]), 3),)})
    assert design.samples_of(("smollm2", SETTINGS[False], 2, 256)) == 3
    assert design.samples_of(("smollm2", SETTINGS[False], 3, 256)) == 2
    assert design.texts_per_cell("smollm2", SETTINGS[False], 256) == 5
    assert design.phases_per_cell("smollm2", SETTINGS[False], 256) == 3 * 2 + 2 * 3
    # the stride-2 run with the round's usual 2 samples is not the planned run
    wrong = _run(str(tmp_path / "wrong"), 2, design=design, samples=2)
    assert regimes.main([wrong], design=design) == 2
    assert "its samples: 2, the round's 3" in capsys.readouterr().err
    first, second = _run(str(tmp_path), 2, design=design), _run(str(tmp_path), 3, design=design)
    cost = ["--cost", f"smollm2={_cost_file(str(tmp_path))}"]
    assert regimes.main([first, second] + cost, design=design) == 0
    out = capsys.readouterr().out
    assert "2 of 2 planned runs finished" in out and "| smollm2 | 6 of 6 | 6 of 6 |" in out
    assert "| a cell (6 cells with answers) | 5 |" in out and "pending" not in out


def test_the_sizing_spread_is_the_spread_of_text_differences(tmp_path, capsys):
    """studies.regimes_sizing on made-up runs: every text of a press scores the same, so each spread is 0, and the
    detectable differences at the bound are the round's."""
    from studies import regimes_sizing

    runs = [_run(str(tmp_path), 2), _run(str(tmp_path), 3)]
    rows = regimes_sizing.spread(runs)
    assert {(r["model"], r["ratio"]) for r in rows} == {("smollm2", 0.25), ("smollm2", 0.75)}
    assert all(r["max_sd"] == 0 and r["texts"] == 3 * 2 * 2 for r in rows)  # tasks x strides x samples
    assert regimes_sizing.main(runs + ["--samples", "3"]) == 0
    out = capsys.readouterr().out
    assert f"{regimes.detectable(72):.3f} per model and ratio, {regimes.detectable(144):.3f} per ratio" in out
    with pytest.raises(SystemExit) as exit_:
        regimes_sizing.main(runs + ["--samples", "0"])
    assert exit_.value.code == 2 and "--samples must be >= 1, got 0" in capsys.readouterr().err


def test_the_pooled_phase_test_sees_a_phase_weak_in_every_cell(tmp_path):
    """Deviation 2's pooled test over made-up runs: flat answers give no small p; phase 1 wrong in every text of
    every cell does."""
    runs = [_run(str(tmp_path), 2), _run(str(tmp_path), 3)]
    records = regimes_runs.read_round(runs, TINY).records
    flat = regimes_runs.pooled_phase_tests(records)
    assert set(flat.stride) == {2, 3} and (flat.texts == 3 * 2 * 2).all()  # tasks x ratios x samples per stride
    assert (flat.p_value.fillna(1.0) >= 0.05).all()
    weak = records.copy()
    weak.loc[(weak.press == G) & (weak.phase == 1), "score"] = 0.0
    weak.loc[(weak.press == G) & (weak.phase != 1), "score"] = 1.0
    tests = regimes_runs.pooled_phase_tests(weak)
    assert (tests[tests.press == G].p_value < 0.01).all()


def test_the_null_simulation_counts_what_the_rules_see():
    """studies.regimes_null: a candidate far below the best baseline is never counted within 0.03, one that ties is
    counted in some but not all cells; rule 1's per-cell step cannot fire at 3 texts a test, the pooled step sees a
    phase weak in every cell."""
    import numpy as np

    from studies import regimes_null

    rng = np.random.default_rng(0)
    dev = regimes_null.CELL_DESIGNS["dev cell (3 + 3 texts, strides 8 and 12)"]
    assert regimes_null.counted_share(rng, 0.8, dev, None, ties=1, below=0.5, cells=300) == 0.0
    tied = regimes_null.counted_share(rng, 0.8, dev, None, ties=1, below=0.0, cells=300)
    assert 0.3 < tied < 0.95
    weak = regimes_null.rule1_drop_rate(2, weak=0.4, n_permutations=200, progress=False)
    assert weak["per_cell"] == 0.0 and weak["pooled"] == 1.0 and weak["pooled_tests"] == 4


def test_rulers_credit_orders_presses_that_all_score_zero():
    """Exploratory table: every answer misses a value (score 0 everywhere), the credit still tells 3 of 4 from 1 of 4,
    and the best baseline is the best by credit."""
    values = ["11 11", "22 22", "33 33", "44 44"]
    held = {"no_press": 4, MATCHED: 1, REFERENCE: 3, "keydiff": 2, "kvzip": 1}
    rows = []
    for press, n in held.items():
        for ratio in ([0.0] if press == "no_press" else [0.25]):
            for sample, phase in itertools.product(range(2), range(2)):
                rows.append({"model": "smollm2", "setting": SETTINGS[False], "task": "niah_multivalue",
                             "context_length": 256, "compression_ratio": ratio, "stride": 2, "sample_id": sample,
                             "phase": phase, "press": press, "answer": values, "prediction": ", ".join(values[:n]),
                             "score": float(n == 4)})
    records = pd.DataFrame(rows)
    out = regimes.credit_markdown(records, TINY)
    row = next(line for line in out.splitlines() if line.startswith("| query-agnostic | niah_multivalue | 256 | 0.25"))
    assert "| 1.00 | 0.25 (-0.25) x | 0.75 (+0.25) |" in row and row.endswith("| `keydiff` 0.50 |")
    assert "every kvpress baseline" not in out
    assert "no niah_multivalue answers" in regimes.credit_markdown(records.drop(columns="prediction"), TINY)
