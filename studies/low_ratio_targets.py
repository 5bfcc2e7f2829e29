"""R10's targets (docs/preregistration-low-ratio.md, "R10, the fresh split"), written before R10's first answer.

    python -m studies.low_ratio_split targets --output docs/results/low-ratio/tables.md

A *cell* is (model, setting, task, context length, stride, ratio), as in R9; a text is one sample of one stride,
its value its mean over the phases, and a cell's mean is over its texts. Per model and ratio (:func:`targets`):

1. the recommendation's mean over the cells against the best single baseline's (the registered kvpress baseline
   with the highest mean over the same cells): met when at least that minus 0.01;
2. the cells where the recommendation is within 0.03 of the cell's best baseline, against the yardstick
   (:func:`~kvpress_phase.evaluation.metrics.tied_share` on the split's own answers: the share a press tied with
   the best would reach, an upper estimate): met when the share is at least the yardstick's expected share;
3. the paired difference by text to the best single baseline with its 95% t interval
   (:func:`~studies.common.paired_pooled`: one value per text, its answers of every setting, length and stride).

Every press of ours the split answered is reported the same way (:func:`targets` with ``press``), whatever the
recommendation; the recommendation's phase tests are reported with Holm's correction over each model's cells
(the test speaks only for windowed presses).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd

from kvpress_phase.evaluation.metrics import NEAR, holm, tied_share

from studies.common import fmt_p, paired_pooled
from studies.regimes_split import SPLIT_CELL, phase_p

MEAN_MARGIN, TOLERANCE = 0.01, 1e-9


def cell_means(records: pd.DataFrame) -> pd.DataFrame:
    """Mean per split cell (rows) and press (columns), each text its mean over its phases; compressed cells only."""
    compressed = records[records.compression_ratio > 0]
    per_text = compressed.groupby(SPLIT_CELL + ["sample_id", "press"])["score"].mean()
    return per_text.groupby(level=SPLIT_CELL + ["press"]).mean().unstack("press")


def targets(records: pd.DataFrame, press: str, baselines: list, replicates: int = 2000) -> pd.DataFrame:
    """Per model and ratio: ``press``'s targets 1-3 against the baselines the split answered (module docstring).
    ValueError when ``press`` or every baseline is missing from the answers."""
    answered = [b for b in baselines if b in set(records.press)]
    if press not in set(records.press):
        raise ValueError(f"no answers of {press!r} in the split")
    if not answered:
        raise ValueError("no answers of any kvpress baseline in the split")
    means = cell_means(records)
    rows = []
    for (model, ratio), cells in means.groupby(level=["model", "compression_ratio"]):
        cells = cells.dropna(subset=[press])
        base = cells[[b for b in answered if b in cells]].dropna(axis=1, how="all")
        if cells.empty or base.empty:
            continue
        over = base.mean()
        best_single = over.idxmax()
        cell_best = base.max(axis=1)
        near = cells[press] >= cell_best - NEAR - TOLERANCE
        part = records[(records.model == model) & (records.compression_ratio == ratio)]
        yardstick = tied_share(part[part.press.isin(base.columns)], cell=SPLIT_CELL, baselines=list(base.columns),
                               replicates=replicates)
        paired = paired_pooled(part, press, best_single)
        mean = float(cells[press].mean())
        rows.append({"model": model, "ratio": ratio, "cells": len(cells), "mean": mean, "best_single": best_single,
                     "best_mean": float(over.max()),
                     "target1": bool(mean >= over.max() - MEAN_MARGIN - TOLERANCE),
                     "near": int(near.sum()), "share": float(near.mean()), "yardstick": yardstick.expected,
                     "yardstick_low": yardstick.low, "target2": bool(near.mean() >= yardstick.expected - TOLERANCE),
                     "texts": paired["n"], "diff": paired["diff"], "low": paired["low"], "high": paired["high"]})
    return pd.DataFrame(rows)


def phase_markdown(records: pd.DataFrame, press: str) -> list[str]:
    """``press``'s phase tests per model: how many cells, the smallest p, and the smallest after Holm."""
    lines = ["| model | cells tested | smallest p | after Holm (model's cells) | phase effect |",
             "|---|---|---|---|---|"]
    for model, part in records.groupby("model"):
        p = phase_p(part, press).dropna()
        if not len(p):
            continue
        adjusted = holm(p.to_numpy())
        lines.append(f"| {model} | {len(p)} | {fmt_p(p.min())} | {fmt_p(adjusted.min())} | "
                     f"{'yes' if adjusted.min() < 0.05 else 'none found'} |")
    return lines


def markdown(tables: dict, recommendation: str, records: pd.DataFrame, answers: str) -> str:
    """The page: the recommendation's targets, its phase tests, then every other press of ours the same way."""
    lines = ["## R10: the targets", "", answers, "",
             "Per model and ratio. Target 1: the mean over the cells at least the best single baseline's mean minus "
             "0.01. Target 2: the share of cells within 0.03 of the cell's best baseline at least the yardstick's "
             "(the share a press tied with the best would reach, simulated on the split's own answers; an upper "
             "estimate). The paired difference is by text to the best single baseline, with its 95% t interval.", ""]
    header = ["| model | ratio | cells | mean | best single baseline | target 1 | within 0.03 | yardstick (5th pct) | "
              "target 2 | minus the best single, by text [95% CI] |", "|---|---|---|---|---|---|---|---|---|---|"]

    def rows(table: pd.DataFrame) -> list[str]:
        return [f"| {r.model} | {r.ratio:g} | {r.cells} | {r.mean:.3f} | `{r.best_single}` {r.best_mean:.3f} | "
                f"{'met' if r.target1 else 'missed'} | {r.near} of {r.cells} ({r.share:.0%}) | {r.yardstick:.0%} "
                f"({r.yardstick_low:.0%}) | {'met' if r.target2 else 'missed'} | {r.diff:+.3f} [{r.low:+.3f}, "
                f"{r.high:+.3f}] ({r.texts} texts) |" for r in table.itertuples()]

    lines += [f"### The recommendation, `{recommendation}`", ""] + header + rows(tables[recommendation])
    counts = summary_counts(tables[recommendation])
    lines += ["", f"**{counts}.**" if counts else "No cell of the split holds both the recommendation and a baseline."]
    lines += ["", "Its phase tests (permutation test per cell):", ""] + phase_markdown(records, recommendation)
    for press, table in tables.items():
        if press != recommendation:
            lines += ["", f"### `{press}` (reported, not a target)", ""] + header + rows(table)
    return "\n".join(lines) + "\n"


def report(records: pd.DataFrame, recommendation: str, ours: list, baselines: list, answers: str,
           replicates: int = 2000) -> str:
    tables = {press: targets(records, press, baselines, replicates)
              for press in dict.fromkeys([recommendation, *ours]) if press in set(records.press)}
    return markdown(tables, recommendation, records, answers)


def summary_counts(table: pd.DataFrame) -> Optional[str]:
    """"met at N of M (model, ratio)" for targets 1 and 2, or None for an empty table."""
    if table.empty:
        return None
    return (f"target 1 met at {int(table.target1.sum())} of {len(table)}, target 2 at {int(table.target2.sum())} of "
            f"{len(table)} (model, ratio); mean difference to the best single baseline {np.mean(table['diff']):+.3f}")
