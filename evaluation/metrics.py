"""Per-phase metrics that hold under the null: accuracy per phase, a paired test of phase dependence, and a gap
estimate that is about 0 when every phase is equally accurate.

Input is a table of per-example results (one row per example x press variant x phase) with at least the columns
``task``, ``press``, ``compression_ratio``, ``stride``, ``protocol``, ``phase``, ``sample_id`` and ``score``
(1.0 correct, 0.0 wrong, fractions allowed). Every base sample is placed at every phase, so the results of one
group form an ``(n_samples, stride)`` matrix whose rows share a prompt: the design is **paired**, and every
statistic here uses that. One summary record comes out per task x context length x press x compression ratio x stride x
protocol (and per model and per seed when the table holds several, :func:`group_keys`):

- ``per_phase``: mean score at every phase ``0 .. stride-1`` (``None`` where a phase was not run), and
  ``per_phase_ci``: its 95% interval (Wilson score interval for 0/1 scores, percentile bootstrap over samples
  otherwise);
- ``mean``: mean over phases;
- ``p_value``: **within-sample permutation test** of "accuracy does not depend on phase". Under that null the
  phase labels of one sample are exchangeable, so shuffling them inside every sample gives the exact null
  distribution of any statistic. The statistic is the range (max - min) of the per-phase means over all phases
  run, which reacts to a single weak phase. Monte Carlo p-value ``(1 + #{T* >= T}) / (1 + n_permutations)``.
  ``cochran_p``: Cochran's Q test (``statsmodels``) on the same paired 0/1 matrix, as a cross-check;
- ``gap_xfit`` with ``gap_xfit_ci_low`` / ``gap_xfit_ci_high``: the **cross-fitted gap**. The samples are split
  at random into halves; the best and worst non-boundary phases (``0 .. stride-2``, as in the reproduction of
  the paper) are chosen on one half and their paired difference is measured on the other, and the roles are
  swapped; ``gap_xfit`` is the mean of these held-out differences over ``n_splits`` random splits. Its
  expectation is 0 when every phase is equally accurate (the half that measures never saw the selection), and
  it is at most the true gap otherwise (a wrong selection only lowers it). The CI: every held-out difference gets
  a two-sided Wald interval with Agresti and Min's adjustment for matched pairs (half a pseudo-pair in each
  cell), computed on the held-out half alone; the reported bounds are the medians of
  those bounds over all splits. A median of bounds that each exceed the truth with probability 2.5% exceeds it
  with probability at most 5% (Markov's inequality on the share of splits that do), so ``gap_xfit_ci_low > 0``
  is evidence of a phase effect at level 5% (``tests/evaluation/test_metrics_calibration.py`` checks the rates
  on simulated flat truths);
- ``gap``: the **plug-in** gap ``best - worst`` of the noisy per-phase means over the non-boundary phases, with
  ``worst_phase`` / ``best_phase``. It is biased upward (the max of noisy means is too high, the min too low):
  about 0.3 at a flat 0.45 with 16 samples per phase. Report it as a description of the sample, never as
  evidence;
- ``boundary``: the score at the boundary phase ``stride - 1``, reported apart;
- ``detectable_gap``: the smallest drop of one phase below all others that the permutation test detects with
  80% power at level 0.05 with this many samples and phases, whatever the accuracy level (see
  :func:`detectable_gap`): what the cell can and cannot see;
- ``partial_mean`` (tasks that need every reference of several, when the results carry ``prediction`` and
  ``answer``): the mean over phases of RULER's credit, the share of the references an answer holds
  (:func:`~.tasks.partial_score`); it reads "three values of four" where ``score`` reads 0, for comparison with
  RULER's published figures. Every statistic above is computed on ``score``;
- ``attention_per_phase`` (when the results carry ``needle_attention_ratio``): mean ratio of the needle's
  attention mass under the press to its mass with the full cache, per phase (see :mod:`.diagnostics`).

Samples that miss some of the phases run (an interrupted run) are left out of the paired statistics
(``p_value``, ``cochran_p``, ``gap_xfit``); the per-phase means use every result.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Iterable, Optional

import numpy as np
import pandas as pd
from scipy import stats

GROUP_KEYS = ("task", "context_length", "press", "compression_ratio", "stride", "protocol", "setting")
DEPTH_BINS = 5
"""Accuracy by needle depth is reported in this many equal bins of the depth (0 = start of the context, 1 = end)."""

N_PERMUTATIONS = 2000
N_SPLITS = 100
DETECTABLE_POWER = 0.8
ALPHA = 0.05


# ---------------------------------------------------------------------------------------------- the matrix
def phase_matrix(df: pd.DataFrame, stride: int) -> tuple[np.ndarray, list[int]]:
    """``(n_samples, stride)`` matrix of scores (nan where a phase was not run), and the phases present."""
    table = df.pivot_table(index="sample_id", columns="phase", values="score", aggfunc="mean")
    table = table.reindex(columns=range(stride))
    present = [p for p in range(stride) if table[p].notna().any()]
    return table.to_numpy(dtype=float), present


def complete_rows(matrix: np.ndarray, phases: Iterable[int]) -> np.ndarray:
    """The rows of ``matrix`` restricted to ``phases`` that have a score at every one of them."""
    sub = matrix[:, list(phases)]
    return sub[~np.isnan(sub).any(axis=1)]


def _is_binary(x: np.ndarray) -> bool:
    x = x[~np.isnan(x)]
    return bool(np.isin(x, (0.0, 1.0)).all())


# ---------------------------------------------------------------------------------------------- per phase
def phase_intervals(matrix: np.ndarray, *, confidence: float = 0.95, n_resamples: int = 2000,
                    rng: Optional[np.random.Generator] = None) -> np.ndarray:
    """``(stride, 2)`` interval for every phase's mean score (nan where a phase has no result).

    0/1 scores get the Wilson score interval (``statsmodels``), which keeps its coverage with few samples and at
    accuracies near 0 or 1, where a percentile bootstrap collapses to a point. Fractional scores get a percentile
    bootstrap over samples.
    """
    from statsmodels.stats.proportion import proportion_confint

    rng = rng or np.random.default_rng(0)
    out = np.full((matrix.shape[1], 2), np.nan)
    alpha = 1 - confidence
    for p in range(matrix.shape[1]):
        col = matrix[:, p]
        col = col[~np.isnan(col)]
        if col.size == 0:
            continue
        if _is_binary(col):
            out[p] = proportion_confint(int(col.sum()), col.size, alpha=alpha, method="wilson")
        else:
            means = col[rng.integers(0, col.size, size=(n_resamples, col.size))].mean(axis=1)
            out[p] = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return out


# ---------------------------------------------------------------------------------------------- phase test
def _range_of_means(sums: np.ndarray) -> np.ndarray:
    return sums.max(axis=-1) - sums.min(axis=-1)


def permutation_p_value(rows: np.ndarray, *, n_permutations: int = N_PERMUTATIONS,
                        rng: Optional[np.random.Generator] = None) -> float:
    """Within-sample permutation test that the mean score is the same at every phase.

    ``rows`` is ``(n_samples, n_phases)`` without missing values. Every permutation shuffles the phase labels
    inside each sample independently; the statistic is the range of the per-phase means. Samples that scored the
    same at every phase are unchanged by any shuffle and shift every phase mean alike, so they are left out of
    the resampling (the statistic's permutation distribution is exactly the same). Returns ``nan`` with fewer
    than two phases or no sample, and 1.0 when no sample varies across phases.
    """
    rows = np.asarray(rows, dtype=float)
    if rows.ndim != 2 or rows.shape[1] < 2 or rows.shape[0] == 0:
        return float("nan")
    varying = rows[np.ptp(rows, axis=1) > 0]
    if varying.shape[0] == 0:
        return 1.0
    rng = rng or np.random.default_rng(0)
    observed = _range_of_means(varying.sum(axis=0))
    n, k = varying.shape
    exceed = 0
    chunk = max(1, 2_000_000 // (n * k))
    done = 0
    while done < n_permutations:
        m = min(chunk, n_permutations - done)
        order = rng.random((m, n, k)).argsort(axis=2)
        shuffled = np.take_along_axis(np.broadcast_to(varying, (m, n, k)), order, axis=2)
        exceed += int((_range_of_means(shuffled.sum(axis=1)) >= observed - 1e-9).sum())
        done += m
    return (1 + exceed) / (1 + n_permutations)


def holm(ps) -> np.ndarray:
    """Holm's step-down adjustment of the p-values ``ps`` (family-wise error over all of them)."""
    ps = np.asarray(ps, float)
    order = np.argsort(ps)
    adjusted = np.empty_like(ps)
    running = 0.0
    for i, j in enumerate(order):
        running = max(running, (len(ps) - i) * ps[j])
        adjusted[j] = min(1.0, running)
    return adjusted


def boundary_test(matrix: np.ndarray, *, n_permutations: int = N_PERMUTATIONS,
                  rng: Optional[np.random.Generator] = None) -> tuple[Optional[float], Optional[float]]:
    """Whether the boundary phase (the last column, S-1) differs from the others: ``(difference, p)``.

    The difference is the mean over samples of (score at S-1) minus (mean score at the other phases); the p-value is
    a two-sided within-sample permutation test (under the null every phase of a sample is exchangeable, so the
    boundary's column is a random one of the row's). Rows with a missing phase are dropped; ``(None, None)`` when
    no row is complete.
    """
    rows = matrix[~np.isnan(matrix).any(axis=1)]
    if rows.shape[0] == 0 or rows.shape[1] < 2:
        return None, None
    rng = rng or np.random.default_rng(0)
    n, s = rows.shape
    totals = rows.sum(axis=1)

    def statistic(column_values):
        return float(np.mean(column_values - (totals - column_values) / (s - 1)))

    observed = statistic(rows[:, -1])
    picks = rng.integers(0, s, size=(n_permutations, n))
    null = np.array([statistic(rows[np.arange(n), pick]) for pick in picks])
    p = (np.sum(np.abs(null) >= abs(observed) - 1e-12) + 1) / (n_permutations + 1)
    return observed, float(p)


def cochran_p_value(rows: np.ndarray) -> Optional[float]:
    """Cochran's Q test on paired 0/1 outcomes (``statsmodels``); ``None`` for fractional scores or < 2 phases."""
    rows = np.asarray(rows, dtype=float)
    if rows.ndim != 2 or rows.shape[1] < 2 or rows.shape[0] < 2 or not _is_binary(rows):
        return None
    if not (np.ptp(rows, axis=1) > 0).any():
        return 1.0
    from statsmodels.stats.contingency_tables import cochrans_q

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return float(cochrans_q(rows.astype(int)).pvalue)


# ---------------------------------------------------------------------------------------------- the gap
def crossfit_gap(rows: np.ndarray, *, n_splits: int = N_SPLITS, confidence: float = 0.95,
                 rng: Optional[np.random.Generator] = None) -> tuple[Optional[float], Optional[float], Optional[float]]:
    """Cross-fitted gap between the best and the worst phase, with its CI (see the module docstring).

    ``rows`` is ``(n_samples, n_phases)`` without missing values, restricted to the phases the gap is taken
    over. Returns ``(gap, ci_low, ci_high)``, all ``None`` with fewer than 4 samples or 2 phases (a half must
    hold at least two samples for a held-out interval).
    """
    rows = np.asarray(rows, dtype=float)
    n, k = rows.shape if rows.ndim == 2 else (0, 0)
    if n < 4 or k < 2:
        return None, None, None
    rng = rng or np.random.default_rng(0)
    half = n // 2
    z = stats.norm.ppf(0.5 + confidence / 2)
    rank = rng.random((n_splits, n)).argsort(axis=1).argsort(axis=1)
    in_a = rank < half  # (splits, n)
    estimates, lows, highs = [], [], []
    for select, measure in ((in_a, ~in_a), (~in_a, in_a)):
        sel = select.astype(float)
        means = (sel @ rows) / sel.sum(axis=1, keepdims=True)  # (splits, k) on the selecting half
        means = means + rng.random(means.shape) * 1e-9  # random tie-break, so ties favour no phase
        best, worst = means.argmax(axis=1), means.argmin(axis=1)
        diff = rows[:, best].T - rows[:, worst].T  # (splits, n): each sample's best - worst difference
        m = measure.sum(axis=1)
        d = np.where(measure, diff, 0.0)
        mean = d.sum(axis=1) / m
        # Agresti-Min adjustment for matched pairs: half a pseudo-pair at +1 and at -1, one at 0 (each cell of
        # the 2x2 table of a pair's outcomes gets 0.5), so a held-out half whose differences are all equal still
        # gets an interval of sensible width
        m_adj = m + 2
        center = d.sum(axis=1) / m_adj
        var = (np.where(measure, diff**2, 0.0).sum(axis=1) + 1.0) / m_adj - center**2
        half_width = z * np.sqrt(var / m_adj)
        estimates.append(mean)
        lows.append(np.maximum(center - half_width, -1.0))  # differences of scores in [0, 1] lie in [-1, 1]
        highs.append(np.minimum(center + half_width, 1.0))
    estimates, lows, highs = (np.concatenate(x) for x in (estimates, lows, highs))
    return float(estimates.mean()), float(np.median(lows)), float(np.median(highs))


# ---------------------------------------------------------------------------------------------- power
@functools.lru_cache(maxsize=256)
def detectable_gap(n_samples: int, n_phases: int, *, power: float = DETECTABLE_POWER, alpha: float = ALPHA,
                   n_sim: int = 4000, seed: int = 0) -> Optional[float]:
    """Smallest drop ``delta`` (in steps of 0.05) of one phase below the others that the phase test detects
    with probability ``power`` at level ``alpha``, for every accuracy level of the other phases.

    Simulated with 0/1 outcomes independent across phases (the least favourable case for a paired design:
    outcomes correlated within a sample make phase differences less noisy), the range of per-phase means as the
    statistic and its critical value from a flat truth at the same overall accuracy. ``None`` when even a drop
    of 1.0 is not detected that often (too few samples). Cached: a report reuses one figure per sample count.
    """
    if n_samples < 1 or n_phases < 2:
        return None
    rng = np.random.default_rng(seed)
    deltas = np.round(np.arange(0.05, 1.0001, 0.05), 2)
    for delta in deltas:
        worst_power = 1.0
        for high in np.minimum(np.arange(delta, 1.0001, 0.05), 1.0):
            low = max(0.0, high - delta)
            base = (high * (n_phases - 1) + low) / n_phases
            null = rng.binomial(n_samples, base, size=(n_sim, n_phases)) / n_samples
            critical = np.quantile(_range_of_means(null), 1 - alpha, method="higher")
            alt = rng.binomial(n_samples, [high] * (n_phases - 1) + [low], size=(n_sim, n_phases)) / n_samples
            worst_power = min(worst_power, float((_range_of_means(alt) > critical).mean()))
            if worst_power < power:
                break
        if worst_power >= power:
            return float(delta)
    return None


# ---------------------------------------------------------------------------------------------- summaries
def _clean(x):
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def summarize_group(df: pd.DataFrame, stride: int, *, n_resamples: int = 2000, n_permutations: int = N_PERMUTATIONS,
                    n_splits: int = N_SPLITS, seed: int = 0, confidence: float = 0.95) -> dict:
    """Summary record of one task x press x ratio x stride x protocol group (see the module docstring)."""
    matrix, present = phase_matrix(df, stride)
    rng = np.random.default_rng(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        per_phase = np.nanmean(matrix, axis=0)
    intervals = phase_intervals(matrix, confidence=confidence, n_resamples=n_resamples, rng=rng)

    inner = [p for p in present if p != stride - 1] or present
    worst = inner[int(np.argmin(per_phase[inner]))]
    best = inner[int(np.argmax(per_phase[inner]))]
    paired = complete_rows(matrix, present)
    gap_xfit, gap_lo, gap_hi = crossfit_gap(complete_rows(matrix, inner), n_splits=n_splits,
                                            confidence=confidence, rng=rng)
    return {
        "mean": _clean(float(np.mean(per_phase[present]))),
        "partial_mean": _partial_mean(df, stride),
        "per_phase": [_clean(x) for x in per_phase],
        "per_phase_ci": [[_clean(a), _clean(b)] for a, b in intervals],
        "worst_phase": int(worst),
        "worst": _clean(per_phase[worst]),
        "best_phase": int(best),
        "best": _clean(per_phase[best]),
        "gap": _clean(per_phase[best] - per_phase[worst]),
        "gap_xfit": _clean(gap_xfit),
        "gap_xfit_ci_low": _clean(gap_lo),
        "gap_xfit_ci_high": _clean(gap_hi),
        "boundary": _clean(per_phase[stride - 1]) if (stride - 1) in present and stride > 1 else None,
        "p_value": _clean(permutation_p_value(paired, n_permutations=n_permutations, rng=rng)),
        "cochran_p": _clean(cochran_p_value(paired)),
        "detectable_gap": detectable_gap(int(paired.shape[0]), len(present)) if paired.shape[0] else None,
        "n_samples": int(matrix.shape[0]),
        "n_paired": int(paired.shape[0]),
        "phases": present,
        "attention_per_phase": _attention_per_phase(df, stride),
        "cache_length": _clean(float(df["cache_length"].mean())) if "cache_length" in df else None,
        "cache_bytes": _mean_of(df, "cache_bytes"),
        "achieved_ratio": _mean_of(df, "achieved_ratio"),
        "window_ratio": _mean_of(df, "window_ratio"),
        "per_depth": _per_depth(df),
    }


def _partial_mean(df: pd.DataFrame, stride: int):
    """The mean over phases of RULER's credit per answer (:func:`~.tasks.partial_score`), as ``mean`` is of the
    scores; None where a task needs any one reference or the answers hold one each (the credit is the score), or the
    answers are not in ``df``."""
    from .tasks import TASKS, partial_score, references

    if df.empty or not {"task", "prediction", "answer"} <= set(df.columns) or df["task"].nunique() != 1:
        return None
    task = df["task"].iloc[0]
    answers = [references(a) for a in df["answer"]]
    if task not in TASKS or not TASKS[task].require_all or max(map(len, answers)) < 2:
        return None
    credit = [partial_score("" if p is None else str(p), a, task) for p, a in zip(df["prediction"], answers)]
    matrix, present = phase_matrix(df.assign(score=credit), stride)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return _clean(float(np.mean(np.nanmean(matrix, axis=0)[present])))


def _mean_of(df: pd.DataFrame, column: str):
    if column not in df or df[column].isna().all():
        return None
    return _clean(float(df[column].astype(float).mean()))


def _per_depth(df: pd.DataFrame):
    """Accuracy in :data:`DEPTH_BINS` equal bins of the needle's depth, ``[mean or None, count]`` per bin: beside
    accuracy by phase, it tells position luck (which part of the context a press keeps) from phase."""
    if "depth" not in df or df["depth"].isna().all():
        return None
    bins = np.clip((df["depth"].astype(float) * DEPTH_BINS).astype(int), 0, DEPTH_BINS - 1)
    grouped = df["score"].astype(float).groupby(bins)
    means, counts = grouped.mean(), grouped.size()
    return [[_clean(means.get(b)) if b in means else None, int(counts.get(b, 0))] for b in range(DEPTH_BINS)]


def _attention_per_phase(df: pd.DataFrame, stride: int):
    if "needle_attention_ratio" not in df or df["needle_attention_ratio"].isna().all():
        return None
    means = df.groupby("phase")["needle_attention_ratio"].mean().reindex(range(stride))
    return [None if math.isnan(x) else float(x) for x in means]


def group_keys(results: pd.DataFrame) -> list[str]:
    """The columns :func:`summarize` groups ``results`` by: :data:`GROUP_KEYS` present, after ``model`` when the table
    has one (runs merged by ``kvpress-phase report``: models are never pooled) and ``seed`` when it holds more than
    one seed (a sample's ``sample_id`` is its index within its seed, so seeds are summarised apart too)."""
    keys = ["model"] if "model" in results else []
    keys += ["seed"] if "seed" in results and results["seed"].nunique() > 1 else []
    return keys + [k for k in GROUP_KEYS if k in results]


def summarize(results: pd.DataFrame, *, n_resamples: int = 2000, seed: int = 0, **kwargs) -> list[dict]:
    """One summary record per task x context length x press x compression ratio x stride x protocol, and per model
    and per seed where the table holds several (see :func:`group_keys`).

    Extra keyword arguments (``n_permutations``, ``n_splits``, ``confidence``) go to :func:`summarize_group`.
    Tables without a ``context_length`` column are grouped without it.
    """
    keys = group_keys(results)
    records = []
    for key, group in results.groupby(keys, sort=True, dropna=False):
        record = dict(zip(keys, key))
        record["compression_ratio"] = float(record["compression_ratio"])
        record["stride"] = int(record["stride"])
        if "context_length" in record:
            record["context_length"] = int(record["context_length"])
        if "seed" in record:
            record["seed"] = None if pd.isna(record["seed"]) else int(record["seed"])
        if "model" in record:
            record["model"] = str(record["model"])
        record.update(summarize_group(group, record["stride"], n_resamples=n_resamples, seed=seed, **kwargs))
        records.append(record)
    return records


# ------------------------------------------------------------------------ across cells: the best of several presses
NEAR = 0.03
""""Within 0.03 of the best": a press is counted in a cell where its mean is at least the best baseline's - NEAR."""
_TOLERANCE = 1e-9


@dataclasses.dataclass(frozen=True)
class Dependence:
    """How the answers of one cell depend on each other, as correlations of a latent normal score (a Gaussian
    copula: an answer is right where its latent score falls below the probit of the press's accuracy).

    ``texts``: two presses' answers on one text (the text's difficulty, which every press meets);
    ``phases``: one press's answers at two phases of one text (the text is drawn once and placed at every phase;
    a press that does not move with the phase answers every phase alike, ``phases`` near 1). ``phases >= texts``."""

    texts: float
    phases: float


@dataclasses.dataclass(frozen=True)
class TiedShare:
    """What "within 0.03 of the best" can say on a split (:func:`tied_share`).

    ``expected``: the share of the split's cells in which a press whose true accuracy equals the best baseline's
    is counted within ``near`` of the best baseline, in expectation; ``low`` / ``high``: the 5th and 95th
    percentiles of that share over simulated replicates of the split (the realised share of a tied press falls
    below ``low`` one time in 20); ``per_cell``: each cell's chance; ``dependence``: the latent correlations used;
    ``replicates``."""

    expected: float
    low: float
    high: float
    cells: int
    per_cell: pd.Series
    dependence: Dependence
    replicates: int

    def sentence(self) -> str:
        return (f"a press tied with the best would be counted in {self.expected:.0%} of these {self.cells} cells "
                f"(90% of splits: {self.low:.0%}-{self.high:.0%}; simulated under the split's own design, texts "
                f"{self.dependence.texts:.2f} and phases {self.dependence.phases:.2f} correlated)")


def _probit(p: np.ndarray) -> np.ndarray:
    return stats.norm.ppf(np.clip(p, 1e-6, 1 - 1e-6))


def _both_below(a: np.ndarray, b: np.ndarray, rho: float) -> np.ndarray:
    """P(Z1 < a, Z2 < b) for standard normals correlated ``rho``, elementwise."""
    if rho >= 1 - 1e-9:
        return stats.norm.cdf(np.minimum(a, b))
    points = np.stack([a, b], axis=-1)
    return np.atleast_1d(stats.multivariate_normal(mean=[0.0, 0.0], cov=[[1.0, rho], [rho, 1.0]]).cdf(points))


def _solve_rho(observed: float, a: np.ndarray, b: np.ndarray, weights: np.ndarray) -> float:
    """The latent correlation at which the expected sum of ``weights * P(both right)`` is ``observed``."""
    from scipy.optimize import brentq

    def excess(rho):
        return float((weights * _both_below(a, b, rho)).sum()) - observed

    if excess(0.0) >= 0:
        return 0.0  # no positive dependence seen (a negative one is not modelled)
    if excess(1.0) <= 0:
        return 1.0
    return float(brentq(excess, 0.0, 1.0, xtol=1e-4))


def _groups(answers: pd.DataFrame, cell: list, presses) -> list:
    """Per cell: ``(key, blocks)``, a block per stride: a ``(presses, texts, phases)`` array of scores (NaN where
    a text misses a phase)."""
    answers = answers[answers.press.isin(presses)]
    out = []
    for key, frame in answers.groupby(cell, sort=True):
        blocks = []
        for _, block in frame.groupby("stride", sort=True):
            cube = block.pivot_table(index=["press", "sample_id"], columns="phase", values="score", aggfunc="mean")
            names = [p for p in presses if p in cube.index.get_level_values(0)]
            texts = sorted(set(cube.index.get_level_values(1)))
            full = pd.MultiIndex.from_product([names, texts], names=["press", "sample_id"])
            values = cube.reindex(full).to_numpy(dtype=float).reshape(len(names), len(texts), -1)
            blocks.append((names, values))
        out.append((key, blocks))
    return out


def answer_dependence(answers: pd.DataFrame, *, cell: list, presses) -> Dependence:
    """The latent correlations of :class:`Dependence`, fitted by moments on ``presses``' answers (0/1 ``score``;
    columns ``cell`` + ``stride``, ``sample_id``, ``phase``, ``press``): pooled over the cells, the observed count
    of pairs of right answers (two phases of one press on one text; two presses on one text) is matched to its
    expectation under the copula, each press at its own accuracy in its cell."""
    presses = list(presses)
    w_obs, w_a, w_n, x_obs, x_a, x_b, x_n = 0.0, [], [], 0.0, [], [], []
    for _, blocks in _groups(answers, cell, presses):
        for names, values in blocks:
            complete = ~np.isnan(values).any(axis=(0, 2))        # texts every press answered at every phase
            values = values[:, complete]
            n_press, n_text, n_phase = values.shape
            if n_text == 0:
                continue
            p = values.mean(axis=(1, 2))
            a = _probit(p)
            sums = values.sum(axis=2)                             # (presses, texts)
            if n_phase > 1:                                       # pairs of phases within a press and text
                w_obs += float((sums ** 2 - (values ** 2).sum(axis=2)).sum())
                w_a.append(a)
                w_n.append(np.full(n_press, n_text * n_phase * (n_phase - 1), dtype=float))
            for j in range(n_press):                              # pairs of presses on one text, any phases
                for k in range(j + 1, n_press):
                    x_obs += float((sums[j] * sums[k]).sum())
                    x_a.append(a[j])
                    x_b.append(a[k])
                    x_n.append(n_text * n_phase * n_phase)
    if not x_n or not w_n:
        raise ValueError("answer_dependence needs at least two presses and two phases answered on common texts")
    texts = _solve_rho(x_obs, np.array(x_a), np.array(x_b), np.array(x_n, dtype=float))
    wa = np.concatenate(w_a)
    phases = _solve_rho(w_obs, wa, wa, np.concatenate(w_n))
    return Dependence(texts=texts, phases=max(phases, texts))


def tied_share(answers: pd.DataFrame, *, cell: list, baselines, near: float = NEAR,
               dependence: Optional[Dependence] = None, replicates: int = 2000, seed: int = 0) -> TiedShare:
    """The yardstick of "within ``near`` of the best baseline", by simulation under the split's own design.

    In every cell of ``answers`` (grouped by ``cell``; within a cell, texts are ``(stride, sample_id)`` and each is
    answered at its stride's phases) each baseline answers with its observed accuracy in that cell, and a candidate
    with the best baseline's accuracy (a press tied with the best). Answers are drawn from the Gaussian copula of
    :class:`Dependence` (fitted on the baselines' own answers by :func:`answer_dependence` unless given): every
    press meets each text's difficulty, and a press's phases of one text share most of their draw. The candidate is
    counted where its mean over the cell's answers is at least the best baseline's mean - ``near``. The best of
    several noisy means is biased upwards, and more so when texts, not answers, are the unit of noise; so a tied
    press is counted in fewer cells than one might think, and the target of a "within ``near``" count reads
    against this share.

    Each baseline's truth is its observed accuracy (a plug-in): the observed best is the largest of several noisy
    means, so with few texts per cell and several baselines just below the best the share is too high (a stricter
    target than a tied press meets: docs/statistics.md gives the calibration on simulated splits). Assumes 0/1
    scores. Returns a :class:`TiedShare`; ``tests/evaluation/test_yardstick.py`` checks it against splits drawn from
    known truths, including truths not drawn from its own model.
    """
    baselines = list(baselines)
    dependence = dependence or answer_dependence(answers, cell=cell, presses=baselines)
    rt, rp = dependence.texts, dependence.phases
    rng = np.random.default_rng(seed)
    chances, counted, keys = [], [], []
    for key, blocks in _groups(answers, cell, baselines):
        names = blocks[0][0]
        totals = np.zeros((replicates, len(names) + 1))
        n_answers = 0
        means = {}
        if any(names_b != names for names_b, _ in blocks):
            raise ValueError(f"tied_share: cell {key} has different baselines at different strides")
        for names_b, values in blocks:
            for name, v in zip(names_b, values):
                s, n = means.get(name, (0.0, 0))
                means[name] = (s + np.nansum(v), n + int((~np.isnan(v)).sum()))
        accuracy = np.array([means[name][0] / max(means[name][1], 1) for name in names])
        thresholds = _probit(np.append(accuracy, accuracy.max()))            # the candidate last
        for _, values in blocks:
            n_text, n_phase = values.shape[1], values.shape[2]
            shared = rng.standard_normal((replicates, 1, n_text, 1)) * math.sqrt(rt)
            own = rng.standard_normal((replicates, len(names) + 1, n_text, 1)) * math.sqrt(max(rp - rt, 0.0))
            noise = rng.standard_normal((replicates, len(names) + 1, n_text, n_phase)) * math.sqrt(max(1 - rp, 0.0))
            right = (shared + own + noise) < thresholds[None, :, None, None]
            totals += right.sum(axis=(2, 3))
            n_answers += n_text * n_phase
        cell_means = totals / n_answers
        hit = cell_means[:, -1] >= cell_means[:, :-1].max(axis=1) - near - _TOLERANCE
        counted.append(hit)
        chances.append(hit.mean())
        keys.append(key)
    if not counted:
        raise ValueError("tied_share: no cell holds answers of the baselines")
    shares = np.mean(counted, axis=0)
    keys = [key if isinstance(key, tuple) else (key,) for key in keys]
    index = pd.MultiIndex.from_tuples(keys, names=cell)
    return TiedShare(expected=float(shares.mean()), low=float(np.quantile(shares, 0.05)),
                     high=float(np.quantile(shares, 0.95)), cells=len(keys),
                     per_cell=pd.Series(chances, index=index, name="tied_counted"), dependence=dependence,
                     replicates=replicates)
