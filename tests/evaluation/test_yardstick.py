"""The yardstick of "within 0.03 of the best baseline" (:func:`~kvpress_phase.evaluation.metrics.tied_share`)
against splits drawn from known truths: its own model (where it must be calibrated) and a model it does not assume
(where it must not be lenient)."""

import numpy as np
import pandas as pd
import pytest

from kvpress_phase.evaluation.metrics import Dependence, answer_dependence, tied_share

from studies.yardstick import _frame, beta_split, copula_split, realised, truths_with


BASELINES = [f"p{j}" for j in range(1, 8)]


def test_the_dependence_is_recovered_from_answers():
    rng = np.random.default_rng(0)
    truths = rng.uniform(0.2, 0.9, (30, 6))
    for dep in (Dependence(0.4, 0.9), Dependence(0.1, 0.3)):
        fitted = answer_dependence(copula_split(rng, truths, 16, 8, dep), cell=["cell"],
                                   presses=[f"p{j}" for j in range(6)])
        assert fitted.texts == pytest.approx(dep.texts, abs=0.07)
        assert fitted.phases == pytest.approx(dep.phases, abs=0.07)


def test_calibrated_where_the_truth_is_its_model():
    """Many texts per cell (the plug-in truths are close to the true ones): the yardstick is the share a tied
    press is counted in, and the realised share falls below its 5% bound rarely."""
    rng = np.random.default_rng(1)
    dep = Dependence(0.3, 0.95)
    truths = truths_with(10, 0.8, ties=1, below=6, gap=0.2)
    realised_shares, yardsticks, below_low = [], [], 0
    for r in range(30):
        split = copula_split(rng, truths, 64, 4, dep)
        ys = tied_share(split, cell=["cell"], baselines=BASELINES, replicates=300, seed=r)
        realised_shares.append(realised(split))
        yardsticks.append(ys.expected)
        below_low += realised_shares[-1] < ys.low
    assert np.mean(yardsticks) == pytest.approx(np.mean(realised_shares), abs=0.06)
    assert below_low <= 4  # about 5% of 30 expected


@pytest.mark.parametrize("candidate,ties,gap", [(0.8, 1, 0.15), (0.5, 3, 0.1), (0.95, 1, 0.2)])
def test_not_lenient_on_a_truth_outside_its_model(candidate, ties, gap):
    """Few texts, a text effect and phase sharing it does not model: the plug-in yardstick may be too high (a
    stricter target), never well below the share a tied press reaches."""
    rng = np.random.default_rng(2)
    truths = truths_with(12, candidate, ties=ties, below=7 - ties, gap=gap)
    realised_shares, yardsticks = [], []
    for r in range(20):
        split = beta_split(rng, truths, 8, 8)
        yardsticks.append(tied_share(split, cell=["cell"], baselines=BASELINES, replicates=300, seed=r).expected)
        realised_shares.append(realised(split))
    assert np.mean(yardsticks) >= np.mean(realised_shares) - 0.05


def test_texts_not_answers_are_the_unit_of_noise():
    """Every phase of a text answered alike (a press that does not move with the grid): fewer independent draws,
    a noisier best, a tied press counted in fewer cells than if the phases were independent."""
    rng = np.random.default_rng(3)
    split = copula_split(rng, truths_with(24, 0.8, ties=2, below=5, gap=0.1), 8, 8, Dependence(0.3, 1.0))
    fitted = tied_share(split, cell=["cell"], baselines=BASELINES, replicates=1000)
    assert fitted.dependence.phases > 0.9
    independent = tied_share(split, cell=["cell"], baselines=BASELINES, replicates=1000,
                             dependence=Dependence(fitted.dependence.texts, fitted.dependence.texts))
    assert fitted.expected < independent.expected - 0.02
    assert fitted.low <= fitted.expected <= fitted.high and len(fitted.per_cell) == 24
    assert "would be counted in" in fitted.sentence()


def test_clear_errors():
    with pytest.raises(ValueError, match="no cell holds answers"):
        tied_share(_frame(np.zeros((2, 3, 4, 4))), cell=["cell"], baselines=["nope"], dependence=Dependence(0, 0))
    with pytest.raises(ValueError, match="at least two presses"):
        answer_dependence(_frame(np.zeros((2, 3, 4, 4))), cell=["cell"], presses=["p1"])


def test_the_study_reports_the_yardstick_and_where_the_phase_test_speaks():
    """studies.yardstick on a split of known truth: the table per model and ratio, the candidate's count, and a
    press whose answers never move with the phase shown at 0%."""
    from studies.yardstick import phase_movement, report

    rng = np.random.default_rng(4)
    split = copula_split(rng, truths_with(6, 0.8, ties=1, below=3, gap=0.2), 8, 4, Dependence(0.3, 1.0))
    split["model"], split["task"] = "m", split.cell.astype(str)
    split["compression_ratio"] = np.where(split.cell < 3, 0.25, 0.5)
    moving = split[split.press == "p0"].copy()
    moving["press"], moving["score"] = "mover", (moving.phase == 0).astype(float)
    split = pd.concat([split, moving])
    text = report(split, ["model", "cell", "compression_ratio"], BASELINES[:4], "p0", replicates=200)
    assert "| m | all | 6 | 8 |" in text and "| m | 0.25 | 3 |" in text and "`p0` counted in" in text
    moves = phase_movement(split)
    assert moves["mover"] == 1.0 and moves["p1"] == 0.0
