"""Reports of a phase evaluation: summary JSON, results tables, plots and a Markdown report.

Everything is written into the run's output directory:

- ``summary.json``: one record per task x press x compression ratio x stride x protocol (see
  :mod:`.metrics`), with the run's config;
- ``results.csv`` and ``results.parquet``: the merged per-example results;
- ``phase_<task>_s<stride>_r<ratio>_<protocol>.png``: accuracy versus phase for every press, with 95% CI bands
  and the uncompressed control;
- ``report.md``: the tables and the plots, for people.
"""

from __future__ import annotations

import json
import math
import os
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


def summary_table(records: list[dict]) -> pd.DataFrame:
    """A compact table of the summary records, one row each (the calibrated statistics first)."""
    rows = []
    for r in records:
        rows.append({
            "task": r["task"], "length": r.get("context_length"), "press": r["press"],
            "ratio": r["compression_ratio"], "achieved": r.get("achieved_ratio"), "stride": r["stride"],
            "protocol": r["protocol"], "setting": SETTING_LABELS.get(r.get("setting"), r.get("setting") or "-"),
            "mean": r["mean"], "worst": r["worst"], "boundary": r["boundary"],
            "p (phase test)": r["p_value"], "gap (cross-fit)": r["gap_xfit"],
            "gap 95% CI": f"[{_fmt(r['gap_xfit_ci_low'])}, {_fmt(r['gap_xfit_ci_high'])}]",
            "detectable gap": r["detectable_gap"], "plug-in gap": r["gap"], "n": r["n_samples"],
            "per phase": " ".join(_fmt(x) for x in r["per_phase"]),
            "by depth": " ".join(_fmt(m) for m, _ in r["per_depth"]) if r.get("per_depth") else "-",
        })
    return pd.DataFrame(rows)


def console_table(records: list[dict]) -> str:
    df = summary_table(records)
    if df.empty:
        return "(no results)"
    return df.to_string(index=False, float_format=lambda x: f"{x:.3f}")


def plot_group(records: list[dict], path: str, title: str) -> None:
    """Accuracy versus phase, one line per press with its 95% CI band; the boundary phase is shaded.

    When the results carry the attention diagnostic, a second panel shows the needle's attention mass relative
    to the full cache, per phase.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_attention = any(r.get("attention_per_phase") for r in records if r["press"] != "no_press")
    fig, axes = plt.subplots(2 if with_attention else 1, 1, figsize=(7, 6.5 if with_attention else 4.2),
                             sharex=True, squeeze=False)
    ax = axes[0, 0]
    stride = records[0]["stride"]
    phases = list(range(stride))
    colors = {}
    # one colour per press: matplotlib's default cycle repeats after 10 lines, a sweep of every baseline has 14
    n_lines = sum(r["press"] != "no_press" for r in records)
    palette = plt.get_cmap("tab10" if n_lines <= 10 else "tab20")
    markers = "osD^v<>ph*"
    drawn = 0
    for r in records:
        acc = [float("nan") if x is None else x for x in r["per_phase"]]
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
        (line,) = ax.plot(phases, acc, label=label + ")", **style)
        colors[r["press"]] = line.get_color()
        ax.fill_between(phases, lo, hi, alpha=0.15, color=line.get_color())
    for a in axes[:, 0]:
        a.axvspan(stride - 1.5, stride - 0.5, color="grey", alpha=0.1)
    ax.set_ylabel("accuracy (95% CI)")
    n = records[0].get("n_samples")
    detectable = records[0].get("detectable_gap")
    if n:
        title += (f"\n{n} samples per phase: a single phase {_fmt(detectable)} lower is detected with 80% power"
                  if detectable is not None else f"\n{n} samples per phase: too few to detect one weak phase")
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


def write_reports(results: pd.DataFrame, output_dir: str, config: Optional[dict] = None, *,
                  n_resamples: int = 2000, seed: int = 0) -> list[dict]:
    """Write summary.json, the results tables, the plots and report.md; return the summary records."""
    os.makedirs(output_dir, exist_ok=True)
    records = summarize(results, n_resamples=n_resamples, seed=seed) if len(results) else []
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
        key = (r["task"], r.get("context_length") or 0, r["stride"], r["compression_ratio"], r["protocol"],
               r.get("setting") or "query_agnostic")
        groups.setdefault(key, []).append(r)
    for (task, length, stride, ratio, protocol, setting), group in sorted(groups.items()):
        control = [c for c in controls
                   if (c["task"], c.get("context_length") or 0, c["stride"], c["protocol"],
                       c.get("setting") or "query_agnostic") == (task, length, stride, protocol, setting)]
        tag = "" if setting == "query_agnostic" else "_question"
        name = f"phase_{task}_n{length}_s{stride}_r{ratio:g}_{protocol}{tag}.png"
        achieved = group[0].get("window_ratio")
        asked = f"compression ratio {ratio:g}" + (f" (per window {achieved:.3g})" if achieved is not None
                                                   and abs(achieved - ratio) > 1e-9 else "")
        where = "query-aware (question compressed with the context)" if setting == "question_compressed" \
            else "query-agnostic"
        plot_group(control + group, os.path.join(output_dir, name),
                   f"{task}, {length} tokens, stride {stride}, {asked}, {protocol} protocol, {where}")
        plots.append((name, task, length, stride, ratio, f"{protocol}, {where}"))

    lines = ["# Phase evaluation report", ""]
    if config:
        lines += ["Configuration:", "", "```json", json.dumps(config, indent=2), "```", ""]
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
        "per-window ratio is `1 - k/S`, with k from the rounding rule). `setting`: `query-agnostic` = the question "
        "is appended after compression (kvpress's pipeline), `query-aware` = the question is compressed with the "
        "context (`--query-aware`, kvpress's `query_aware`). `by depth` = "
        "accuracy in five equal bins of the needle's depth in the context, start to end.",
        "",
    ]
    table = summary_table(records)
    if not table.empty:
        lines += [table.to_markdown(index=False, floatfmt=".3f"), ""]
    for name, task, length, stride, ratio, protocol in plots:
        lines += [f"## {task}, {length} tokens, stride {stride}, ratio {ratio:g}, {protocol}", "",
                  f"![{name}]({name})", ""]
    with open(os.path.join(output_dir, "report.md"), "w") as fh:
        fh.write("\n".join(lines))
    return records
