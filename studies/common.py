"""What the study scripts share: reading runs (:func:`load`), the kvpress baselines a cell's best baseline is chosen
among (:func:`kvpress_baselines`, :func:`baseline_labels`), number formats and the paired comparison to one press
(:func:`paired`, :func:`paired_markdown`, :func:`paired_pooled`). The study scripts import this; it imports none of
them."""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Optional

import numpy as np
import pandas as pd
from scipy import stats

from kvpress_phase.evaluation.presses import REGISTRY, parse_press_spec
from kvpress_phase.evaluation.merging import read_runs

ALL_BASELINES = "all"
"""``--baselines`` value (the default) that means every registered kvpress baseline."""


def kvpress_baselines() -> list[str]:
    """Every registered kvpress baseline, in the registry's order: the entries of
    :data:`~kvpress_phase.evaluation.presses.REGISTRY` marked ``matched`` (kvpress's own presses, which
    ``--matched-cache`` runs at ``ChunkedStridePress``'s cache length). "The best baseline" of a cell is chosen among
    these unless a study is told to restrict them."""
    return [name for name, entry in REGISTRY.items() if getattr(entry, "matched", False)]


def baseline_labels(spec: Optional[str] = ALL_BASELINES) -> list[str]:
    """The press labels ``--baselines`` names: every registered kvpress baseline for ``"all"`` (or None), otherwise
    the comma-separated specs as the results name them (``adakv:scorer=kvzap`` included). ValueError for a spec
    that is not a kvpress baseline (ours, ``no_press``, an unknown name)."""
    if spec is None or spec.strip() == ALL_BASELINES:
        return kvpress_baselines()
    registered, labels = set(kvpress_baselines()), []
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            continue
        parsed = parse_press_spec(item)
        if parsed.name not in registered:
            raise ValueError(f"--baselines: {item!r} is not a kvpress baseline (registered: "
                             f"{', '.join(kvpress_baselines())})")
        labels.append(parsed.label)
    return labels


def load(runs: list[str]) -> pd.DataFrame:
    """The answers of ``runs`` merged as ``kvpress-phase report`` merges them
    (:func:`~kvpress_phase.evaluation.merging.read_runs`: every answer of every model and seed kept, identical copies
    collapsed with a line on stderr, conflicting copies refused)."""
    return load_runs(runs)[0]


def load_runs(runs: list[str]) -> tuple[pd.DataFrame, list]:
    """:func:`load`'s answers and each run's ``RunInfo`` (its model, answers held and answers planned)."""
    results, infos, notes = read_runs(runs)
    for note in notes:
        print(f"warning: {note}", file=sys.stderr)
    return results, infos


def model_files(specs: list, models, flag: str) -> dict:
    """``{model: path}`` from ``MODEL=FILE`` values of ``flag`` (one per model). ValueError naming the value: not
    MODEL=FILE, a model not among ``models``, a model given twice."""
    out = {}
    for spec in specs or []:
        model, sep, path = spec.partition("=")
        if not sep or not model or not path:
            raise ValueError(f"{flag} {spec!r}: give MODEL=FILE (a model of the round: {', '.join(sorted(models))})")
        if model not in models:
            raise ValueError(f"{flag} {spec!r}: {model!r} is not a model of the round (give MODEL=FILE with one "
                             f"of {', '.join(sorted(models))})")
        if model in out:
            raise ValueError(f"{flag} is given twice for {model}")
        out[model] = path
    return out


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
                  unit: tuple = ("task", "sample_id"), equal_cells: bool = False) -> dict:
    """``press`` minus ``against`` pooled over every compressed answer of the runs, one value per text: a ``unit``
    (task and sample; the runs of one seed draw the same text for a sample in every setting and length) is its mean
    difference over the settings, lengths, ratios, strides and phases both presses answered, and the 95% t interval
    is over those units. Pooling by text rather than by cell keeps the answers of one text (correlated across its
    ratios, settings and lengths) from counting as independent. ValueError when either press has no answers.

    By default every answer weighs the same, so a cell weighs as many phases as its stride has (strides 5, 13 and
    16 weigh 5:13:16). ``equal_cells``: a unit's difference is first averaged over the phases of each cell (setting,
    length, ratio, stride) and then over its cells, so every cell weighs the same."""
    compressed = records[records.compression_ratio > 0]
    for name in (press, against):
        if name not in set(compressed.press):
            raise ValueError(f"no compressed answers of {name!r} in these runs")
    cell = ["setting", "context_length", "compression_ratio", "stride"]
    keys = list(unit) + cell + ["phase"]
    scores = compressed[compressed.press.isin([press, against])].groupby(keys + ["press"])["score"].mean()
    both = scores.unstack("press").dropna()
    diff = both[press] - both[against]
    if equal_cells:
        diff = diff.groupby(level=list(unit) + cell).mean()
    per_unit = diff.groupby(level=list(unit)).mean()
    n = len(per_unit)
    half = stats.t.ppf(0.975, n - 1) * per_unit.std(ddof=1) / np.sqrt(n) if n > 1 else float("nan")
    return {"press": press, "against": against, "n": n, "answers": len(both), "diff": per_unit.mean(),
            "low": per_unit.mean() - half, "high": per_unit.mean() + half}


def pooled_by_ratio(records: pd.DataFrame, press: str, against: str) -> pd.DataFrame:
    """``press`` minus ``against`` per compression ratio, pooled over the settings, lengths, tasks and strides of
    the runs, both ways (:func:`paired_pooled`, one value per text): every answer weighing the same (``diff``,
    ``low``, ``high``) and every cell weighing the same (``equal``, ``equal_low``, ``equal_high``); ``cells``: the
    cells (setting, task, length, stride) both presses answered at that ratio."""
    compressed = records[(records.compression_ratio > 0) & records.press.isin([press, against])]
    rows = []
    for ratio, part in compressed.groupby("compression_ratio"):
        if set(part.press) != {press, against}:
            continue
        pooled = paired_pooled(part, press, against)
        equal = paired_pooled(part, press, against, equal_cells=True)
        cells = part.groupby(["setting", "task", "context_length", "stride"])["press"].nunique()
        rows.append({"ratio": ratio, "cells": int((cells == 2).sum()), "n": pooled["n"], "diff": pooled["diff"],
                     "low": pooled["low"], "high": pooled["high"], "equal": equal["diff"],
                     "equal_low": equal["low"], "equal_high": equal["high"]})
    return pd.DataFrame(rows)


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
    from kvpress_phase.evaluation.spellings import canonical_label

    frames = []
    for run in runs:
        path = os.path.join(run, "summary.json")
        if not os.path.exists(path):
            raise ValueError(f"{run!r} has no summary.json: is it a finished `kvpress-phase eval` output directory?")
        with open(path) as fh:
            frame = pd.DataFrame(json.load(fh))
        if "press" in frame:  # a run written under a former spelling reads under today's labels, as its answers do
            frame["press"] = frame["press"].map(canonical_label)
        frames.append(frame)
    return pd.concat(frames, ignore_index=True)
