"""The yardstick of "within 0.03 of the best baseline" (:func:`~kvpress_phase.evaluation.metrics.tied_share`)
against splits drawn from known truths: its own model (where it must be calibrated) and a model it does not assume
(where it must not be lenient)."""

import numpy as np
import pandas as pd
import pytest

from kvpress_phase.evaluation.metrics import NEAR, Dependence, answer_dependence, tied_share


def _frame(y: np.ndarray) -> pd.DataFrame:
    """(cells, presses, texts, phases) 0/1 answers as the evaluation's long table; press 0 is the candidate."""
    c, j, t, ph = np.indices(y.shape)
    return pd.DataFrame({"cell": c.ravel(), "stride": y.shape[3], "sample_id": t.ravel(), "phase": ph.ravel(),
                         "press": np.char.add("p", j.ravel().astype(str)), "score": y.ravel().astype(float)})


def copula_split(rng, truths, texts, phases, dep: Dependence) -> pd.DataFrame:
    from scipy import stats

    n_c, n_p = truths.shape
    z = (rng.standard_normal((n_c, 1, texts, 1)) * np.sqrt(dep.texts)
         + rng.standard_normal((n_c, n_p, texts, 1)) * np.sqrt(dep.phases - dep.texts)
         + rng.standard_normal((n_c, n_p, texts, phases)) * np.sqrt(1 - dep.phases))
    return _frame(z < stats.norm.ppf(truths)[:, :, None, None])


def beta_split(rng, truths, texts, phases, share=0.9) -> pd.DataFrame:
    """Not the copula: a text moves every press's accuracy by one Beta(2, 2) amount (clipped), and a press answers
    all phases of a text with one draw with probability ``share``."""
    n_c, n_p = truths.shape
    u = rng.beta(2, 2, (n_c, 1, texts, 1)) - 0.5
    p = np.clip(truths[:, :, None, None] + 1.6 * u * np.sqrt(truths * (1 - truths))[:, :, None, None], 0, 1)
    one = rng.random((n_c, n_p, texts, 1)) < share
    y = np.where(one, rng.random((n_c, n_p, texts, 1)) < p, rng.random((n_c, n_p, texts, phases)) < p)
    return _frame(np.broadcast_to(y, (n_c, n_p, texts, phases)))


def realised(frame: pd.DataFrame) -> float:
    means = frame.groupby(["cell", "press"]).score.mean().unstack()
    best = means.drop(columns="p0").max(axis=1)
    return float((means["p0"] >= best - NEAR - 1e-9).mean())


def truths_with(cells, candidate, ties, below, gap):
    t = np.full((cells, 1 + ties + below), candidate - gap)
    t[:, : 1 + ties] = candidate
    return t


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
