"""The low-ratio dev round's rule (studies/low_ratio_rule.py) does what docs/preregistration-low-ratio.md says, on
synthetic rounds whose answer is known."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from studies import low_ratio_dev as dev
from studies import low_ratio_rule as rule

G, KD25, MLP, L64, PA, HB = (rule.G, "global_budget:scorer=kvzap_keydiff_25", "global_budget:scorer=kvzap_mlp",
                             "global_budget:n_local=64:scorer=kvzap", "phase_aware", "head_budget:floor=1.0")
RATIOS = (0.25, 0.5, 0.75)


def _records(accuracy, models=(("m1", ("t1", "t2")), ("m2", ("t1",))), strides=(8, 12), samples=6, weak=None, seed=0):
    """Answers of a synthetic round: ``accuracy(model, task, ratio, press)`` the chance of a correct answer;
    ``weak = (press, phase)`` answers nothing at that phase of every stride."""
    rng = np.random.default_rng(seed)
    rows = []
    for model, tasks in models:
        for task in tasks:
            for stride in strides:
                for ratio in RATIOS:
                    for press in rule.DESIGNS + rule.BASELINES:
                        for sample in range(samples):
                            for phase in range(stride):
                                p = accuracy(model, task, ratio, press)
                                score = float(rng.random() < p)
                                if weak and press == weak[0] and phase == weak[1]:
                                    score = 0.0
                                rows.append(dict(model=model, setting="query_agnostic", task=task,
                                                 context_length=2048, compression_ratio=ratio, stride=stride,
                                                 sample_id=sample, phase=phase, press=press, score=score))
    return pd.DataFrame(rows)


def _scores(table: dict) -> pd.DataFrame:
    """Scores from ``{design: (score at 0.25, at 0.5, at 0.75)}``; the other designs 0."""
    frame = pd.DataFrame({d: table.get(d, (0.0, 0.0, 0.0)) for d in rule.DESIGNS}, index=list(RATIOS))
    frame.index.name = "compression_ratio"
    return frame


def test_the_designs_are_the_preregistered_presses_as_the_results_label_them():
    from kvpress_phase.evaluation.presses import parse_press_spec

    ours = [parse_press_spec(p).label for p in dev.PRESSES if p not in ("no_press", "chunked_stride")]
    assert sorted(rule.DESIGNS + rule.BASELINES) == sorted(ours)
    assert all(parse_press_spec(d).label == d for d in rule.DESIGNS)


def test_the_tie_order_is_g_then_fewer_settings_then_the_tables_order():
    assert rule.ratio_pick({G: 0.80, KD25: 0.805, PA: 0.70}, [G, KD25, PA]) == (G, [G, KD25])
    assert rule.ratio_pick({G: 0.70, KD25: 0.805, PA: 0.80}, [G, KD25, PA]) == (PA, [KD25, PA])  # 0 settings < 1
    assert rule.ratio_pick({G: 0.70, KD25: 0.80, MLP: 0.80}, [G, KD25, MLP]) == (KD25, [KD25, MLP])  # listed first
    assert rule.ratio_pick({G: 0.78, KD25: 0.80}, [G, KD25]) == (KD25, [KD25])  # 0.02 behind: no tie
    assert rule.settings_count(L64) == 2 and rule.settings_count(PA) == 0 and rule.settings_count(HB) == 1


def test_one_design_within_001_of_every_pick_is_the_recommendation():
    decision = rule.decide(_scores({G: (0.50, 0.70, 0.90), KD25: (0.56, 0.705, 0.90)}))
    assert decision.picks == {0.25: KD25, 0.5: G, 0.75: G}
    assert decision.holds == [KD25] and decision.sequence == [KD25] * 3 and decision.single


def test_no_single_design_gives_one_switch_point():
    decision = rule.decide(_scores({G: (0.50, 0.70, 0.90), KD25: (0.60, 0.75, 0.85)}))
    assert decision.holds == [] and decision.sequence == [KD25, KD25, G] and not decision.single
    text = rule.markdown(*_page(decision))
    assert "switches at ratio 0.625" in text


def test_a_non_monotone_pick_keeps_the_most_picks_with_one_switch():
    decision = rule.decide(_scores({G: (0.50, 0.80, 0.60), KD25: (0.60, 0.70, 0.70), MLP: (0.40, 0.60, 0.75)}))
    assert [decision.picks[r] for r in RATIOS] == [KD25, G, MLP]
    sequence = decision.sequence
    assert rule.switches(sequence) <= 1 and sum(a == b for a, b in zip(sequence, [KD25, G, MLP])) == 2
    # keeping two picks: [KD25, G, G] sums 2.00, [KD25, KD25, MLP] and [G, G, MLP] 2.05; the tie goes to G first
    assert sequence == [G, G, MLP]


def test_flat_and_bytes_drop_a_design_before_the_picks():
    scores = _scores({G: (0.50, 0.70, 0.90), KD25: (0.60, 0.80, 0.95)})
    flat = pd.DataFrame({"fires": [d == KD25 for d in rule.DESIGNS], "cell_adjusted": 0.5, "pooled_adjusted": 0.01},
                        index=list(rule.DESIGNS))
    decision = rule.decide(scores, flat=flat)
    assert KD25 in decision.dropped and decision.sequence == [G] * 3
    nbytes = pd.DataFrame([{"model": "m", "design": KD25, "multiple": 1.2, "over": True}])
    assert rule.decide(scores, nbytes=nbytes).sequence == [G] * 3


def test_a_missing_score_is_refused():
    with pytest.raises(ValueError, match="without a score"):
        rule.decide(_scores({G: (0.5, 0.7, 0.9)}).drop(columns=[KD25]))


def test_scores_weight_the_models_equally_whatever_their_cell_counts():
    def accuracy(model, task, ratio, press):
        return {("m1", "t1"): 1.0, ("m1", "t2"): 0.0, ("m2", "t1"): 1.0}[(model, task)]
    per_model, scores = rule.design_scores(_records(accuracy, samples=2))
    assert per_model.loc[("m1", 0.5), G] == 0.5 and per_model.loc[("m2", 0.5), G] == 1.0
    assert scores.loc[0.5, G] == pytest.approx(0.75)  # not 2/3, the mean over the three cells
    assert per_model.loc[("m1", 0.5), "cells"] == 2 and per_model.loc[("m2", 0.5), "cells"] == 1


def test_the_pooled_phase_test_finds_a_weak_phase_and_passes_a_flat_truth():
    flat_truth = _records(lambda *a: 0.6, samples=6)
    table = rule.flat_table(flat_truth, runs=[])
    assert not table.fires.any()  # 9 designs x 4 pooled tests at a flat truth: Holm keeps its level
    weak = _records(lambda *a: 0.9, samples=6, weak=(KD25, 3))
    table = rule.flat_table(weak, runs=[])
    assert table.loc[KD25, "fires"] and not table.drop(index=KD25).fires.any()


def test_bytes_over_the_cap_or_unmeasured_are_marked(tmp_path):
    rows = [dict(press=p, ratio=r, bytes_prefill=b, bytes_answer_end=b)
            for r in RATIOS for p, b in (("chunked_stride", 100), (G, 104), (KD25, 106))]
    path = tmp_path / "m.json"
    path.write_text(json.dumps(rows))
    table = rule.bytes_table({"m": rule.read_memory(str(path))}).set_index("design")
    assert table.loc[G, "over"] is False and table.loc[KD25, "over"] is True
    assert table.loc[PA, "over"] is None  # not measured
    (tmp_path / "bad.json").write_text(json.dumps([{"press": "x"}]))
    with pytest.raises(ValueError, match="not an output of benchmarks/bench_press_memory.py"):
        rule.read_memory(str(tmp_path / "bad.json"))


def test_analyse_refuses_an_unfinished_round_with_exit_code_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(dev, "OUTPUT", str(tmp_path))
    with pytest.raises(SystemExit) as exc:
        dev.main(["analyse"])
    assert exc.value.code == 2 and "no run has started" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        dev.main(["analyse", "--memory", "nomodel=x.json"])
    assert exc.value.code == 2 and "MODEL=FILE" in capsys.readouterr().err


def _page(decision):
    records = _records(lambda *a: 0.5, samples=1)
    per_model, scores = rule.design_scores(records)
    flat = pd.DataFrame({"cell_tests": 0, "cell_raw": np.nan, "cell_adjusted": np.nan, "pooled_tests": 0,
                         "pooled_raw": np.nan, "pooled_adjusted": np.nan, "fires": False}, index=list(rule.DESIGNS))
    return per_model, scores, flat, None, decision, "synthetic"


def test_the_paired_interval_covers_a_true_zero_and_excludes_a_large_gap():
    def accuracy(model, task, ratio, press):
        return 0.3 if press == KD25 else 0.6
    records = _records(accuracy, samples=6, seed=3)
    _, scores = rule.design_scores(records)
    decision = rule.decide(scores)
    paired = rule.paired_to_pick(records, decision).set_index(["ratio", "design"])
    assert paired.loc[(0.5, KD25), "high"] < 0  # 0.3 below: found
    equal = paired.loc[(0.5, MLP)]  # same truth as most designs: its interval to the pick covers 0 here
    assert equal["low"] <= 0 <= equal["high"] or decision.picks[0.5] == MLP
    assert (paired.texts == 2 * 6 * 2 + 6 * 2).all()  # m1: 2 tasks x 2 strides x 6; m2: 1 task x 2 strides x 6


def test_the_paired_interval_keeps_its_level_under_a_flat_truth():
    covered = []
    for seed in range(40):
        records = _records(lambda *a: 0.5, samples=4, seed=100 + seed, strides=(8,))
        _, scores = rule.design_scores(records)
        decision = rule.decide(_scores({G: (0.5, 0.5, 0.5)}))  # the pick fixed to G: not chosen on the data
        paired = rule.paired_to_pick(records, decision)
        row = paired[(paired.ratio == 0.5) & (paired.design == KD25)].iloc[0]
        covered.append(row.low <= 0 <= row.high)
    assert np.mean(covered) >= 0.85  # nominal 0.95; 40 draws
