"""Per-phase metrics: accuracy with bootstrap CIs, the phase gap with its CI, and a homogeneity test.

Input is a table of per-example results (one row per example x press variant x phase) with at least the columns
``task``, ``press``, ``compression_ratio``, ``stride``, ``protocol``, ``phase``, ``sample_id`` and ``score``
(1.0 correct, 0.0 wrong, fractions allowed). One summary record comes out per task x press x compression ratio x
stride x protocol:

- ``per_phase``: mean score at every phase ``0 .. stride-1`` (``nan`` where a phase was not run), and
  ``per_phase_ci``: its 95% percentile-bootstrap interval over samples;
- ``mean``: mean over phases;
- ``worst_phase`` / ``best_phase`` and ``gap = best - worst``, taken over the non-boundary phases
  ``0 .. stride-2`` as in the reproduction of the paper, with a 95% CI from a paired bootstrap: base samples are
  resampled once per replicate and every phase is rescored on the same resample, since the phases of one sample
  share their prompt;
- ``boundary``: the score at the boundary phase ``stride - 1``, reported apart;
- ``p_value``: chi-square test of homogeneity of the correct/wrong counts across phases (``scipy.stats``);
  1.0 when every phase scored the same in every sample;
- ``attention_per_phase`` (when the results carry ``needle_attention_ratio``): mean ratio of the needle's
  attention mass under the press to its mass with the full cache, per phase (see :mod:`.diagnostics`).
"""

from __future__ import annotations

import math
from typing import Iterable

import numpy as np
import pandas as pd
from scipy import stats

GROUP_KEYS = ("task", "press", "compression_ratio", "stride", "protocol")


def _phase_matrix(df: pd.DataFrame, stride: int) -> tuple[np.ndarray, list[int]]:
    """``(n_samples, stride)`` matrix of scores (nan where a phase was not run), and the phases present."""
    table = df.pivot_table(index="sample_id", columns="phase", values="score", aggfunc="mean")
    table = table.reindex(columns=range(stride))
    present = [p for p in range(stride) if table[p].notna().any()]
    return table.to_numpy(dtype=float), present


def _bootstrap_replicates(matrix: np.ndarray, n_resamples: int, rng: np.random.Generator) -> np.ndarray:
    """``(n_resamples, stride)`` per-phase means over resampled rows (paired across phases)."""
    n = matrix.shape[0]
    idx = rng.integers(0, n, size=(n_resamples, n))
    with np.errstate(invalid="ignore"), _quiet():
        return np.nanmean(matrix[idx], axis=1)


class _quiet:
    def __enter__(self):
        import warnings

        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("ignore", RuntimeWarning)

    def __exit__(self, *exc):
        self._w.__exit__(*exc)


def homogeneity_p_value(matrix: np.ndarray, present: Iterable[int]) -> float:
    """Chi-square test that the success rate is the same at every phase (scores rounded to correct/wrong)."""
    present = list(present)
    if len(present) < 2:
        return float("nan")
    correct = np.array([np.nansum(matrix[:, p] >= 0.5) for p in present])
    total = np.array([np.sum(~np.isnan(matrix[:, p])) for p in present])
    table = np.stack([correct, total - correct])
    if (table.sum(axis=1) == 0).any():
        return 1.0  # every phase all-correct or all-wrong: no evidence against homogeneity
    return float(stats.chi2_contingency(table, correction=False).pvalue)


def summarize_group(df: pd.DataFrame, stride: int, *, n_resamples: int = 2000, seed: int = 0,
                    confidence: float = 0.95) -> dict:
    """Summary record of one task x press x ratio x stride x protocol group (see the module docstring)."""
    matrix, present = _phase_matrix(df, stride)
    rng = np.random.default_rng(seed)
    with _quiet():
        per_phase = np.nanmean(matrix, axis=0)
    reps = _bootstrap_replicates(matrix, n_resamples, rng)
    alpha = (1 - confidence) / 2
    with _quiet():
        lo = np.nanquantile(reps, alpha, axis=0)
        hi = np.nanquantile(reps, 1 - alpha, axis=0)

    inner = [p for p in present if p != stride - 1] or present
    inner_scores = per_phase[inner]
    worst = inner[int(np.argmin(inner_scores))]
    best = inner[int(np.argmax(inner_scores))]
    gap_reps = np.nanmax(reps[:, inner], axis=1) - np.nanmin(reps[:, inner], axis=1)
    with _quiet():
        gap_lo, gap_hi = np.nanquantile(gap_reps, [alpha, 1 - alpha])

    def clean(x):
        return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)

    return {
        "mean": clean(float(np.nanmean(per_phase[present]))),
        "per_phase": [clean(x) for x in per_phase],
        "per_phase_ci": [[clean(a), clean(b)] for a, b in zip(lo, hi)],
        "worst_phase": int(worst),
        "worst": clean(per_phase[worst]),
        "best_phase": int(best),
        "best": clean(per_phase[best]),
        "gap": clean(per_phase[best] - per_phase[worst]),
        "gap_ci_low": clean(gap_lo),
        "gap_ci_high": clean(gap_hi),
        "boundary": clean(per_phase[stride - 1]) if (stride - 1) in present and stride > 1 else None,
        "p_value": clean(homogeneity_p_value(matrix, present)),
        "n_samples": int(matrix.shape[0]),
        "phases": present,
        "attention_per_phase": _attention_per_phase(df, stride),
    }


def _attention_per_phase(df: pd.DataFrame, stride: int):
    if "needle_attention_ratio" not in df or df["needle_attention_ratio"].isna().all():
        return None
    means = df.groupby("phase")["needle_attention_ratio"].mean().reindex(range(stride))
    return [None if math.isnan(x) else float(x) for x in means]


def summarize(results: pd.DataFrame, *, n_resamples: int = 2000, seed: int = 0) -> list[dict]:
    """One summary record per task x press x compression ratio x stride x protocol."""
    records = []
    for key, group in results.groupby(list(GROUP_KEYS), sort=True, dropna=False):
        record = dict(zip(GROUP_KEYS, key))
        record["compression_ratio"] = float(record["compression_ratio"])
        record["stride"] = int(record["stride"])
        record.update(summarize_group(group, record["stride"], n_resamples=n_resamples, seed=seed))
        records.append(record)
    return records
