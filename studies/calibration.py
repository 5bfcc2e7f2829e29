"""How often the phase statistics fire when they should not, and when they should: seeded simulations.

Every statistic of :mod:`.metrics` is checked here on simulated score matrices whose truth is known: a **flat**
truth (every phase equally accurate; outcomes independent across phases, or strongly correlated within a sample
because the phases of one sample share a prompt) and a **weak phase** (one phase lower than the others). The
test suite runs a small grid of these (``tests/evaluation/test_metrics_calibration.py``); the command below
prints the full table that ``RESULTS.md`` quotes::

    python -m studies.calibration --replicates 400
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from kvpress_phase.evaluation.metrics import crossfit_gap, permutation_p_value


@dataclass(frozen=True)
class Scenario:
    """A simulated truth: per-phase accuracies and the within-sample correlation of outcomes.

    With probability ``shared`` a sample's outcomes at every phase are one draw (the prompt decides), otherwise
    every phase is drawn independently; both keep each phase's accuracy at ``rates[phase]`` when the rates are
    flat. (With a weak phase the shared draw uses the mean rate, so ``shared`` is only used for flat truths.)
    """

    rates: tuple
    n_samples: int
    shared: float = 0.0

    @property
    def stride(self) -> int:
        return len(self.rates)

    @property
    def true_gap(self) -> float:
        inner = self.rates[:-1]
        return float(max(inner) - min(inner))

    def draw(self, rng: np.random.Generator) -> np.ndarray:
        rates = np.asarray(self.rates, dtype=float)
        independent = rng.random((self.n_samples, self.stride)) < rates
        if self.shared == 0:
            return independent.astype(float)
        one_draw = rng.random((self.n_samples, 1)) < rates.mean()
        use_shared = rng.random((self.n_samples, 1)) < self.shared
        return np.where(use_shared, one_draw, independent).astype(float)


def flat(rate: float, n_samples: int, stride: int, shared: float = 0.0) -> Scenario:
    return Scenario(tuple([rate] * stride), n_samples, shared)


def weak_phase(low: float, high: float, n_samples: int, stride: int, phase: int) -> Scenario:
    rates = [high] * stride
    rates[phase] = low
    return Scenario(tuple(rates), n_samples)


@dataclass
class Rates:
    """Share of replicates in which each statistic fired (and the gap CI's coverage of the true gap)."""

    p_below: float
    xfit_ci_excludes_zero: float
    xfit_covers_truth: float
    mean_gap_xfit: float
    mean_gap_plugin: float


def simulate(scenario: Scenario, replicates: int, *, seed: int = 0, alpha: float = 0.05,
             n_permutations: int = 2000, n_splits: int = 100) -> Rates:
    """Run the permutation test and the cross-fitted gap on ``replicates`` draws of ``scenario``."""
    rng = np.random.default_rng(seed)
    fired = excluded = covered = 0
    xfit, plugin = [], []
    inner = slice(0, scenario.stride - 1)
    for _ in range(replicates):
        m = scenario.draw(rng)
        fired += permutation_p_value(m, n_permutations=n_permutations, rng=rng) < alpha
        gap, lo, hi = crossfit_gap(m[:, inner], n_splits=n_splits, rng=rng)
        excluded += lo is not None and lo > 0
        covered += lo is not None and lo <= scenario.true_gap <= hi
        xfit.append(gap if gap is not None else np.nan)
        means = m[:, inner].mean(axis=0)
        plugin.append(means.max() - means.min())
    return Rates(fired / replicates, excluded / replicates, covered / replicates, float(np.nanmean(xfit)),
                 float(np.mean(plugin)))


def calibration_table(replicates: int = 400, seed: int = 0, rates: Sequence[float] = (0.2, 0.45, 0.8, 0.95),
                      samples: Sequence[int] = (8, 16, 50), strides: Sequence[int] = (4, 8, 16),
                      shared: Sequence[float] = (0.0, 0.8), n_permutations: int = 1000):
    """Rows of (scenario description, :class:`Rates`) over flat truths and a few weak-phase truths."""
    import pandas as pd

    rows = []
    for i, (rate, n, stride, rho) in enumerate(itertools.product(rates, samples, strides, shared)):
        r = simulate(flat(rate, n, stride, rho), replicates, seed=seed + i, n_permutations=n_permutations)
        rows.append({"truth": "flat", "accuracy": rate, "samples/phase": n, "stride": stride, "shared": rho,
                     "p < 0.05": r.p_below, "gap_xfit CI excludes 0": r.xfit_ci_excludes_zero,
                     "mean gap_xfit": r.mean_gap_xfit, "mean plug-in gap": r.mean_gap_plugin})
    for j, (low, high, n, stride) in enumerate([(0.0, 0.8, 16, 8), (0.4, 0.8, 16, 8), (0.0, 0.8, 8, 8),
                                                (0.6, 0.8, 50, 8), (0.0, 0.8, 16, 4), (0.0, 0.8, 16, 16)]):
        r = simulate(weak_phase(low, high, n, stride, 2), replicates, seed=seed + 1000 + j,
                     n_permutations=n_permutations)
        rows.append({"truth": f"phase 2 at {low}, others {high}", "accuracy": high, "samples/phase": n,
                     "stride": stride, "shared": 0.0, "p < 0.05": r.p_below,
                     "gap_xfit CI excludes 0": r.xfit_ci_excludes_zero, "CI covers true gap": r.xfit_covers_truth,
                     "mean gap_xfit": r.mean_gap_xfit, "mean plug-in gap": r.mean_gap_plugin})
    return pd.DataFrame(rows)


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description="Calibration of the phase statistics on simulated truths.")
    parser.add_argument("--replicates", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.replicates < 10:
        parser.error(f"--replicates must be >= 10, got {args.replicates}")
    table = calibration_table(args.replicates, args.seed)
    print(table.to_markdown(index=False, floatfmt=".3f"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
