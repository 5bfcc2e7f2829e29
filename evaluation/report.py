"""Reports of a phase evaluation: summary JSON, results tables, plots and a Markdown report.

Everything is written into the run's output directory:

- ``summary.json``: one record per task x press x compression ratio x stride x protocol (see
  :mod:`.metrics`), with the run's config;
- ``results.csv`` and ``results.parquet``: the merged per-example results;
- ``phase_<task>_s<stride>_r<ratio>_<protocol>.png``: accuracy versus phase with 95% CIs for the uncompressed
  control, our presses and the few other presses of highest mean accuracy (:func:`drawn_presses`; every press is in
  the tables);
- ``report.md``: the tables and the plots, for people.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Optional

import pandas as pd

from .metrics import summarize


SETTING_LABELS = {"query_agnostic": "query-agnostic", "question_compressed": "query-aware"}
"""Labels of the ``setting`` column in tables (the stored values stay ``query_agnostic`` and ``question_compressed``;
``query-aware`` is kvpress's name for compressing the question with the context, formerly ``compress_questions``)."""


def _fmt(x, digits=2) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _fmt_p(p) -> str:
    return "-" if p is None else f"{p:.2g}" if p >= 0.001 else "<0.001"


def split_columns(records: list[dict]) -> list[str]:
    """``model`` when the records hold more than one model, and ``seed`` when they are summarised per seed: the
    columns that tell apart records of one cell (see :func:`.metrics.group_keys`)."""
    columns = ["model"] if len({r.get("model") for r in records}) > 1 else []
    return columns + (["seed"] if any("seed" in r for r in records) else [])


def _seed_order(seed) -> int:
    return -1 if seed is None else int(seed)


def has_credit(records: list[dict]) -> bool:
    """Whether a summary record has RULER's credit (``partial_mean``), which the report then shows."""
    return any(r.get("partial_mean") is not None for r in records)


def summary_table(records: list[dict]) -> pd.DataFrame:
    """A compact table of the summary records, one row each (the calibrated statistics first), with ``model`` and
    ``seed`` columns first when the records hold several (:func:`split_columns`), and ``RULER credit`` beside the
    mean when a record has one (``partial_mean``: tasks that need every reference)."""
    split = split_columns(records)
    partial = has_credit(records)
    rows = []
    for r in records:
        rows.append({
            **{column: r.get(column) for column in split},
            "task": r["task"], "length": r.get("context_length"), "press": r["press"],
            "ratio": r["compression_ratio"], "achieved": r.get("achieved_ratio"), "cache": r.get("cache_length"),
            "cache MiB": None if r.get("cache_bytes") is None else round(r["cache_bytes"] / 2**20, 3),
            "stride": r["stride"],
            "protocol": r["protocol"], "setting": SETTING_LABELS.get(r.get("setting"), r.get("setting") or "-"),
            "mean": r["mean"], **({"RULER credit": r.get("partial_mean")} if partial else {}),
            "worst": r["worst"], "boundary": r["boundary"],
            "p (phase test)": r["p_value"], "gap (cross-fit)": r["gap_xfit"],
            "gap 95% CI": f"[{_fmt(r['gap_xfit_ci_low'])}, {_fmt(r['gap_xfit_ci_high'])}]",
            "detectable gap": r["detectable_gap"], "plug-in gap": r["gap"], "n": r["n_samples"],
            "per phase": " ".join(_fmt(x) for x in r["per_phase"]),
            "by depth": " ".join(_fmt(m) for m, _ in r["per_depth"]) if r.get("per_depth") else "-",
        })
    return pd.DataFrame(rows)


def _missing(x) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def _cell(x, digits: Optional[int] = None) -> str:
    """``x`` for the console: ``-`` when missing, floats with ``digits`` decimals (None: as short as exact; a value
    that rounds to zero is ``0``, never ``-0``)."""
    if _missing(x):
        return "-"
    if isinstance(x, float):
        text = f"{x:g}" if digits is None else f"{x:.{digits}f}"
        return text[1:] if text.startswith("-") and float(text) == 0 else text
    return str(x)


def console_table(records: list[dict]) -> str:
    """The summary records as a table for a terminal (under 120 columns): the cell, the mean and worst accuracy,
    the phase test's p and the cross-fitted gap with its 95% CI; missing values are ``-``. The full table is in
    report.md (:func:`summary_table`) and every statistic in summary.json."""
    if not records:
        return "(no results)"
    # in front, the columns that tell records apart when they vary: model and seed (:func:`split_columns`), protocol
    optional = split_columns(records) + (["protocol"] if len({str(r.get("protocol")) for r in records}) > 1 else [])
    header = optional + ["task", "length", "press", "ratio", "stride", "setting", "mean", "worst", "p",
                         "gap [95% CI]", "n"]
    left = set(optional) | {"task", "press", "setting"}
    rows = []
    for r in records:
        setting = r.get("setting")
        p = r.get("p_value")
        gap = r.get("gap_xfit")
        rows.append([_cell(r.get(c)) for c in optional] + [
            _cell(r.get("task")), _cell(r.get("context_length")), _cell(r.get("press")),
            _cell(r.get("compression_ratio")), _cell(r.get("stride")),
            "-" if _missing(setting) else SETTING_LABELS.get(setting, str(setting)),
            _cell(r.get("mean"), 2), _cell(r.get("worst"), 2), "-" if _missing(p) else _fmt_p(p),
            "-" if _missing(gap) else f"{_cell(gap, 2)} [{_cell(r.get('gap_xfit_ci_low'), 2)}, "
                                      f"{_cell(r.get('gap_xfit_ci_high'), 2)}]",
            _cell(r.get("n_samples")),
        ])
    widths = [max(len(row[i]) for row in rows + [header]) for i in range(len(header))]
    lines = [" ".join(text.ljust(w) if name in left else text.rjust(w)
                       for name, text, w in zip(header, row, widths)).rstrip()
             for row in [header] + rows]
    return "\n".join(lines)


BASELINES_DRAWN = 3
"""kvpress presses a plot draws beside ours and the control: those of highest mean accuracy (:func:`drawn_presses`)."""


def drawn_presses(records: list[dict], baselines: int = BASELINES_DRAWN) -> tuple[list[dict], list[dict]]:
    """``(drawn, left out)`` of one plot's records, each in the order given: the control ``no_press``, every press
    of ours (a registry entry whose spec takes its fields, :mod:`.presses`) and the ``baselines`` other presses of
    highest mean accuracy (the earlier on a tie) are drawn; the others are left to the report's table, so that a
    sweep of every baseline does not draw a dozen lines on top of each other."""
    from .presses import REGISTRY

    def ours(r: dict) -> bool:
        entry = REGISTRY.get(str(r["press"]).split(":")[0])
        return r["press"] == "no_press" or (entry is not None and entry.settings == "fields")

    others = [i for i, r in enumerate(records) if not ours(r)]
    best = sorted(others, key=lambda i: -(records[i]["mean"] if records[i].get("mean") is not None else -1.0))
    keep = set(best[:baselines])
    drawn = [r for i, r in enumerate(records) if ours(r) or i in keep]
    return drawn, [r for i, r in enumerate(records) if not ours(r) and i not in keep]


def plot_group(records: list[dict], path: str, title: str) -> list[str]:
    """Accuracy versus phase, one line per press drawn (:func:`drawn_presses`) with its 95% CIs; the boundary
    phase is shaded, and the legend names the presses left to the table. The presses drawn, in order.

    When the results carry the attention diagnostic, a second panel shows the needle's attention mass relative
    to the full cache, per phase.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records, left_out = drawn_presses(records)
    with_attention = any(r.get("attention_per_phase") for r in records if r["press"] != "no_press")
    fig, axes = plt.subplots(2 if with_attention else 1, 1, figsize=(7, 6.5 if with_attention else 4.2),
                             sharex=True, squeeze=False)
    ax = axes[0, 0]
    stride = records[0]["stride"]
    phases = list(range(stride))
    colors = {}
    # one colour per press: matplotlib's default cycle repeats after 10 lines, a sweep of many specs of ours has more
    n_lines = sum(r["press"] != "no_press" for r in records)
    palette = plt.get_cmap("tab10" if n_lines <= 10 else "tab20")
    markers = "osD^v<>ph*"
    drawn = 0
    # each press's points side by side within its phase (a phase is a category), so that presses of equal accuracy
    # stay apart; the 95% intervals are error bars (bands of a dozen presses at 1.00 would cover each other)
    dodge = 0.6 / max(len(records) - 1, 1)
    for i, r in enumerate(records):
        x = [p + (i - (len(records) - 1) / 2) * dodge for p in phases]
        acc = [float("nan") if v is None else v for v in r["per_phase"]]
        lo = [float("nan") if a is None else a for a, _ in r["per_phase_ci"]]
        hi = [float("nan") if b is None else b for _, b in r["per_phase_ci"]]
        if r["press"] == "no_press":
            style = dict(linestyle="--", color="black", marker="o")
        else:
            style = dict(color=palette(drawn % palette.N), marker=markers[drawn % len(markers)])
            drawn += 1
        label = f"{r['press']} (mean {_fmt(r['mean'])}"
        if r["press"] != "no_press":
            label += f", p {_fmt_p(r['p_value'])}, gap {_fmt(r['gap_xfit'])} [{_fmt(r['gap_xfit_ci_low'])}, " \
                     f"{_fmt(r['gap_xfit_ci_high'])}]"
        (line,) = ax.plot(x, acc, label=label + ")", markersize=5, linewidth=1.2, **style)
        colors[r["press"]] = line.get_color()
        below = [max(a - b, 0.0) for a, b in zip(acc, lo)]  # max: an interval's rounding, never its width
        above = [max(b - a, 0.0) for a, b in zip(acc, hi)]
        ax.errorbar(x, acc, yerr=[below, above], fmt="none", ecolor=line.get_color(), elinewidth=0.8, alpha=0.5)
    for a in axes[:, 0]:
        a.axvspan(stride - 1.5, stride - 0.5, color="grey", alpha=0.1)
    ax.set_ylabel("accuracy (95% CI)")
    n = records[0].get("n_samples")
    detectable = records[0].get("detectable_gap")
    if n:
        title += (f"\n{n} samples per phase: a single phase {_fmt(detectable)} lower is detected with 80% power"
                  if detectable is not None else f"\n{n} samples per phase: too few to detect one weak phase")
    if left_out:
        import textwrap

        names = ", ".join(r["press"] for r in left_out)
        ax.plot([], [], " ", label=textwrap.fill(f"not drawn (in report.md's table): {names}", 60))
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    if with_attention:
        ax2 = axes[1, 0]
        for r in records:
            att = r.get("attention_per_phase")
            if r["press"] == "no_press" or not att:
                continue
            ax2.plot(phases, [float("nan") if x is None else x for x in att], marker=".", color=colors[r["press"]],
                     label=r["press"])
        ax2.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
        ax2.set_ylabel("needle attention / full cache")
    axes[-1, 0].set_xlabel("phase of the answer's first token, (position - offset) mod stride; shaded: boundary")
    axes[-1, 0].set_xticks(phases)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return [r["press"] for r in records]


def _slug(text: str) -> str:
    name = os.path.basename(str(text).rstrip("/\\")) or str(text)
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "model"


def _runs_lines(runs: list[dict]) -> list[str]:
    """report.md's list of the runs merged: model, seed, answers held and planned, and a sentence per incomplete run."""
    table = pd.DataFrame([{"run": f"`{r['run']}`", "model": r.get("model") or "-",
                           "seed": "-" if r.get("seed") is None else r["seed"], "answers": r["answers"],
                           "planned": "-" if r.get("planned") is None else r["planned"]} for r in runs])
    lines = ["Runs merged:", "", table.to_markdown(index=False), ""]
    for r in runs:
        if r.get("planned") is not None and r["answers"] < r["planned"]:
            lines += [f"`{r['run']}` holds {r['answers']} of {r['planned']} planned answers: an incomplete run, whose "
                      "cells may hold fewer samples than planned.", ""]
    return lines


def write_reports(results: pd.DataFrame, output_dir: str, config: Optional[dict] = None, *,
                  n_resamples: int = 2000, seed: int = 0, runs: Optional[list[dict]] = None) -> list[dict]:
    """Write summary.json, the results tables, the plots and report.md; return the summary records.

    ``runs`` (``kvpress-phase report``): one dict per run merged, with ``run``, ``model``, ``seed``, ``answers`` and
    ``planned`` (None when unknown), listed in report.md with a sentence for every incomplete run. Results of several
    models or seeds are summarised, plotted and tabled apart (:func:`.metrics.group_keys`).
    """
    os.makedirs(output_dir, exist_ok=True)
    records = summarize(results, n_resamples=n_resamples, seed=seed) if len(results) else []
    split = split_columns(records)
    models = sorted({str(r.get("model")) for r in records})
    slugs: dict[str, str] = {}
    for model in models:  # one file-name tag per model, unique even when two paths end in the same folder name
        slug = _slug(model)
        slugs[model] = slug if slug not in slugs.values() else f"{slug}-{len(slugs)}"
    with open(os.path.join(output_dir, "summary.json"), "w") as fh:
        json.dump(records, fh, indent=2)
    results.to_csv(os.path.join(output_dir, "results.csv"), index=False)
    results.to_parquet(os.path.join(output_dir, "results.parquet"), index=False)

    controls = [r for r in records if r["press"] == "no_press"]
    plots = []
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if r["press"] == "no_press":
            continue
        key = (str(r.get("model")), _seed_order(r.get("seed")), r["task"], r.get("context_length") or 0, r["stride"],
               r["compression_ratio"], r["protocol"], r.get("setting") or "query_agnostic")
        groups.setdefault(key, []).append(r)
    for (model, run_seed, task, length, stride, ratio, protocol, setting), group in sorted(groups.items()):
        control = [c for c in controls
                   if (str(c.get("model")), _seed_order(c.get("seed")), c["task"], c.get("context_length") or 0,
                       c["stride"], c["protocol"], c.get("setting") or "query_agnostic")
                   == (model, run_seed, task, length, stride, protocol, setting)]
        tag = "" if setting == "query_agnostic" else "_question"
        tag += f"_{slugs[model]}" if "model" in split else ""
        tag += f"_seed{group[0]['seed']}" if "seed" in split and group[0].get("seed") is not None else ""
        name = f"phase_{task}_n{length}_s{stride}_r{ratio:g}_{protocol}{tag}.png"
        achieved = group[0].get("window_ratio")
        asked = f"compression ratio {ratio:g}" + (f" (per window {achieved:.3g})" if achieved is not None
                                                   and abs(achieved - ratio) > 1e-9 else "")
        where = "query-aware (question compressed with the context)" if setting == "question_compressed" \
            else "query-agnostic"
        which = (f"model {model}, " if "model" in split else "") + \
            (f"seed {group[0].get('seed')}, " if "seed" in split else "")
        drawn = plot_group(control + group, os.path.join(output_dir, name),
                           f"{which}{task}, {length} tokens, stride {stride}, {asked}, {protocol} protocol, {where}")
        left = [r["press"] for r in group if r["press"] not in drawn]
        plots.append((name, f"{which}{task}", length, stride, ratio, f"{protocol}, {where}", left))

    lines = ["# Phase evaluation report", ""]
    if config:
        lines += ["Configuration:", "", "```json", json.dumps(config, indent=2), "```", ""]
    if runs:
        lines += _runs_lines(runs)
    lines += [
        "Accuracy per phase of the answer's first token (95% Wilson intervals in the plots). `p (phase test)` = "
        "within-sample permutation test that accuracy does not depend on phase (paired: every sample is placed at "
        "every phase). `gap (cross-fit)` = best - worst non-boundary phase (0..S-2), the two chosen on one random "
        "half of the samples and measured on the other, averaged over splits: about 0 when phase does not matter; "
        "its 95% CI excludes 0 only on evidence of a phase effect. `detectable gap` = the smallest drop of a single "
        "phase below the others that the phase test detects with 80% power at this sample count, whatever the "
        "accuracy level: smaller effects may be present unseen. `plug-in gap` = best - worst of the observed means, "
        "biased upward (a description of the sample, not evidence). `boundary` = phase S-1, reported apart. "
        "`no_press` is the uncompressed control on the same prompts. `ratio` is the compression ratio asked for, "
        "`achieved` the fraction of the whole cache removed (protected sink and recent tokens included; our presses' "
        "per-window ratio is `1 - k/S`, with k from the rounding rule), `cache` the entries decoding attends to per "
        "layer and KV head, the mean over the answers (under `--matched-cache` kvpress's chunk wrappers keep a few "
        "fewer than ours: they round per chunk). `setting`: `query-agnostic` = the question "
        "is appended after compression (kvpress's pipeline), `query-aware` = the question is compressed with the "
        "context (`--query-aware`, kvpress's `query_aware`). `by depth` = "
        "accuracy in five equal bins of the needle's depth in the context, start to end."
        + (" `RULER credit` (tasks that need every reference): the mean over phases of the share of the references "
           "an answer holds, RULER's `string_match_all`; `mean` and every statistic count an answer right only "
           "when it holds them all." if has_credit(records) else "")
        + (f" {' and '.join(f'`{c}`' for c in split)}: the answers of each {' and each '.join(split)} are "
           "summarised apart, never pooled." if split else ""),
        "",
    ]
    table = summary_table(records)
    if not table.empty:
        lines += [table.to_markdown(index=False, floatfmt=".3f"), ""]
    for name, task, length, stride, ratio, protocol, left in plots:
        lines += [f"## {task}, {length} tokens, stride {stride}, ratio {ratio:g}, {protocol}", "",
                  f"![{name}]({name})", ""]
        if left:
            lines += [f"Drawn: no_press, our presses and the {BASELINES_DRAWN} other presses of highest mean accuracy; "
                      f"in the table only: {', '.join(f'`{p}`' for p in left)}.", ""]
    with open(os.path.join(output_dir, "report.md"), "w") as fh:
        fh.write("\n".join(lines))
    return records
