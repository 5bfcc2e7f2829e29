"""What the study scripts share: reading runs (:func:`load`), number formats and the paired comparison to one press
(:func:`paired`, :func:`paired_markdown`). The study scripts import this; it imports none of them."""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
import pandas as pd
from scipy import stats

from kvpress_phase.evaluation.store import read_runs


def load(runs: list[str]) -> pd.DataFrame:
    """The answers of ``runs`` merged as ``kvpress-phase report`` merges them (:func:`~kvpress_phase.evaluation.store.read_runs`: every answer
    of every model and seed kept, identical copies collapsed with a line on stderr, conflicting copies refused)."""
    results, _, notes = read_runs(runs)
    for note in notes:
        print(f"warning: {note}", file=sys.stderr)
    return results


def emit(text: str, output=None) -> None:
    """Print a study's Markdown, and write it to ``output`` as well when one is given."""
    print(text)
    if output:
        with open(output, "w") as fh:
            fh.write(text)


def fmt_number(x, digits=3) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def fmt_p(p) -> str:
    if p is None or (isinstance(p, float) and math.isnan(p)):
        return "-"
    return "<0.001" if p < 0.001 else f"{p:.3f}"


def paired(records: pd.DataFrame, against: str, by: tuple = ("setting", "compression_ratio")) -> pd.DataFrame:
    """Per press and group ``by`` (setting and ratio), pooled over tasks: mean paired difference to ``against`` and
    its 95% t CI. A sample's value is its mean over every answer of the group (phases, and strides where the runs
    have several); ``by`` may add ``context_length`` for runs of several lengths."""
    compressed = records[records.compression_ratio > 0]
    groups = list(by) + ["task", "sample_id", "press"]
    per_sample = compressed.groupby(groups)["score"].mean().unstack("press")
    if against not in per_sample:
        raise ValueError(f"no answers of {against!r} in these runs")
    rows = []
    for press in per_sample.columns:
        if press == against:
            continue
        diff = (per_sample[press] - per_sample[against]).dropna()
        for key, d in diff.groupby(level=list(by)):
            n = len(d)
            se = d.std(ddof=1) / np.sqrt(n) if n > 1 else float("nan")
            half = stats.t.ppf(0.975, n - 1) * se if n > 1 else float("nan")
            group = dict(zip(by, key if isinstance(key, tuple) else (key,)))
            rows.append({"press": press, "setting": group.pop("setting"), "ratio": group.pop("compression_ratio"),
                         **group, "n": n, "diff": d.mean(), "low": d.mean() - half, "high": d.mean() + half})
    return pd.DataFrame(rows)


def paired_pooled(records: pd.DataFrame, press: str, against: str,
                  unit: tuple = ("task", "sample_id")) -> dict:
    """``press`` minus ``against`` pooled over every compressed answer of the runs, one value per text: a ``unit``
    (task and sample; the runs of one seed draw the same text for a sample in every setting and length) is its mean
    difference over the settings, lengths, ratios, strides and phases both presses answered, and the 95% t interval
    is over those units. Pooling by text rather than by cell keeps the answers of one text (correlated across its
    ratios, settings and lengths) from counting as independent. ValueError when either press has no answers."""
    compressed = records[records.compression_ratio > 0]
    for name in (press, against):
        if name not in set(compressed.press):
            raise ValueError(f"no compressed answers of {name!r} in these runs")
    keys = list(unit) + ["setting", "context_length", "compression_ratio", "stride", "phase"]
    scores = compressed[compressed.press.isin([press, against])].groupby(keys + ["press"])["score"].mean()
    both = scores.unstack("press").dropna()
    per_unit = (both[press] - both[against]).groupby(level=list(unit)).mean()
    n = len(per_unit)
    half = stats.t.ppf(0.975, n - 1) * per_unit.std(ddof=1) / np.sqrt(n) if n > 1 else float("nan")
    return {"press": press, "against": against, "n": n, "answers": len(both), "diff": per_unit.mean(),
            "low": per_unit.mean() - half, "high": per_unit.mean() + half}


def paired_markdown(table: pd.DataFrame, against: str) -> str:
    tokens = "context_length" in table
    lines = [f"| press | setting |{' tokens |' if tokens else ''} ratio | samples | mean difference to `{against}` "
             "[95% CI] |", "|---|---|---|---|---|" + ("---|" if tokens else "")]
    for r in table.itertuples():
        length = f" {r.context_length} |" if tokens else ""
        lines.append(f"| `{r.press}` | {r.setting} |{length} {r.ratio:g} | {r.n} | {r.diff:+.3f} [{r.low:+.3f}, "
                     f"{r.high:+.3f}] |")
    return "\n".join(lines)


def read_summaries(runs: list[str]) -> pd.DataFrame:
    """Every cell of the runs' ``summary.json`` (accuracy, phase test, ...), one row per cell and press; ValueError
    naming a run without one."""
    frames = []
    for run in runs:
        path = os.path.join(run, "summary.json")
        if not os.path.exists(path):
            raise ValueError(f"{run!r} has no summary.json: is it a finished `kvpress-phase eval` output directory?")
        with open(path) as fh:
            frames.append(pd.DataFrame(json.load(fh)))
    return pd.concat(frames, ignore_index=True)
