"""Tables and a figure of the phase audit of kvpress's chunked presses (docs/preregistration-chunk-audit.md).

    python -m studies.audit_tables outputs/chunk-audit/L8 outputs/chunk-audit/L20 \\
        outputs/chunk-audit/L32 --figure docs/results/chunk-audit/phase-profiles.png --output audit-tables.md

Reads each run's ``summary.json`` (one chunk length ``L`` = stride per run) and results, keeps the audit's cells
(:data:`AUDIT_CELLS`: the press and ratio pairs the screen admitted), and writes Markdown: per cell the accuracy
against no compression, the cache length, the within-sample permutation p and its Holm adjustment over all audit
cells, the cross-fitted gap with its 95% CI, what the cell can detect, the two weakest phases and the boundary test
(phase ``L-1`` against the others, :func:`~.metrics.boundary_test`); then accuracy by needle depth. The figure shows
every cell's per-phase accuracy, one panel per task and chunk length.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

import numpy as np
import pandas as pd

from kvpress_phase.evaluation.metrics import boundary_test, holm, phase_matrix
from studies.common import emit, fmt_number, fmt_p, read_summaries
from studies.common import load as load_answers
from studies.targets import depth_markdown

AUDIT_CELLS = {"chunk": (0.125, 0.25), "chunk:scorer=keydiff": (0.125,), "chunked_stride": (0.125, 0.25)}
"""The audit's cells by press: the ratios the screen admitted (docs/preregistration-chunk-audit.md, deviation 1)."""

LABELS = {"chunk": "ChunkPress(KnormPress)", "chunk:scorer=keydiff": "ChunkPress(KeyDiffPress)",
          "chunkkv": "ChunkKVPress(SnapKVPress)",
          "chunked_stride": "ChunkedStridePress()", "no_press": "no compression"}


def load(runs: list[str], cells: Optional[dict] = AUDIT_CELLS) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The audit cells' summary records (with the control's accuracy and the Holm-adjusted p), and every summary
    record of the runs (the control's included).

    ``cells`` maps a press label to its audited ratios (default: this study's :data:`AUDIT_CELLS`); None audits every
    press and ratio of the runs but ``no_press`` (an audit of one's own press with ``kvpress-phase audit``)."""
    summary = read_summaries(runs)
    results = load_answers(runs)
    control = summary[summary.press == "no_press"].set_index(["task", "stride"])["mean"]
    keep = [press != "no_press" if cells is None else ratio in cells.get(press, ())
            for press, ratio in zip(summary.press, summary.compression_ratio)]
    audited = summary[keep].copy()
    audited["control"] = [control.get((t, s), np.nan) for t, s in zip(audited.task, audited.stride)]
    audited["holm_p"] = holm(audited.p_value.fillna(1.0))
    boundary, models = [], []
    for r in audited.itertuples():
        sub = results[(results.task == r.task) & (results.stride == r.stride) & (results.press == r.press)
                      & (results.compression_ratio == r.compression_ratio)]
        boundary.append(boundary_test(phase_matrix(sub, r.stride)[0]))
        models.append(", ".join(sorted(sub.model.unique())))
    audited["model"] = models
    audited["boundary_diff"] = [d for d, _ in boundary]
    audited["boundary_p"] = [p for _, p in boundary]
    return audited.sort_values(["press", "stride", "compression_ratio", "task"]).reset_index(drop=True), summary


def cells_markdown(cells: pd.DataFrame) -> str:
    setting = ", ".join(f"{', '.join(str(v) for v in sorted(cells[col].unique()))}{unit}"
                        for col, unit in (("model", ""), ("protocol", " protocol"), ("setting", ""),
                                          ("context_length", " tokens")))
    lines = [f"Audit cells: {len(cells)} (Holm over all of them). {setting.replace('_', '-')}.", "",
             "| press | L | ratio | task | cache | accuracy | no compression | p | Holm p | cross-fitted gap [95% CI] | "
             "detectable | weakest phases | boundary L-1 minus others (p) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in cells.itertuples():
        per = np.asarray([np.nan if x is None else x for x in r.per_phase], dtype=float)
        weakest = ", ".join(f"{i} ({per[i]:.2f})" for i in np.argsort(per, kind="stable")[:2])
        gap = "-" if r.gap_xfit is None or pd.isna(r.gap_xfit) else \
            f"{r.gap_xfit:.2f} [{r.gap_xfit_ci_low:.2f}, {r.gap_xfit_ci_high:.2f}]"
        lines.append(f"| {r.press} | {r.stride} | {r.compression_ratio:g} | {r.task} | {fmt_number(r.cache_length, 0)} | "
                     f"{r.mean:.3f} | {fmt_number(r.control, 3)} | {fmt_p(r.p_value)} | {fmt_p(r.holm_p)} | {gap} | "
                     f"{fmt_number(r.detectable_gap, 2)} | {weakest} | {fmt_number(r.boundary_diff, 2)} ({fmt_p(r.boundary_p)}) |")
    return "\n".join(lines) + "\n"


def figure(cells: pd.DataFrame, summary_control: pd.DataFrame, path: str) -> None:
    """Per-phase accuracy of every audit cell: one panel per task (rows) and chunk length (columns)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks, strides = sorted(cells.task.unique()), sorted(cells.stride.unique())
    fig, axes = plt.subplots(len(tasks), len(strides), figsize=(4.4 * len(strides), 3.4 * len(tasks) + 0.8),
                             squeeze=False, sharey=True)
    colours = {}
    for i, task in enumerate(tasks):
        for j, stride in enumerate(strides):
            ax = axes[i][j]
            flagged = []
            for r in cells[(cells.task == task) & (cells.stride == stride)].itertuples():
                name = f"{LABELS.get(r.press, r.press)} at {r.compression_ratio:g}"
                colour = colours.setdefault(name, f"C{len(colours)}")
                significant = r.holm_p < 0.05
                ax.plot(range(stride), [np.nan if x is None else x for x in r.per_phase], marker=".", color=colour,
                        linewidth=2.4 if significant else 1.0, label=name)
                if significant:
                    flagged.append(f"{name}: Holm p {fmt_p(r.holm_p)}")
            ctrl = summary_control[(summary_control.task == task) & (summary_control.stride == stride)]
            if len(ctrl):
                ax.axhline(float(ctrl["mean"].iloc[0]), color="grey", linestyle=":", label="no compression")
            ax.set_title(f"{task}, L = {stride}" + "".join("\n" + f for f in flagged), fontsize=8)
            ax.set_xlabel("phase (position mod L)")
            ax.set_ylim(-0.05, 1.05)
            ax.xaxis.get_major_locator().set_params(integer=True)
        axes[i][0].set_ylabel("accuracy")
    entries = {}  # every press of every panel, once
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    legend = fig.legend(list(entries.values()), list(entries), loc="lower center", ncol=3, fontsize=8, frameon=False)
    for handle in legend.legend_handles:
        handle.set_linewidth(1.5)
    fig.suptitle(f"Phase audit of kvpress's chunked presses ({', '.join(sorted(cells.model.unique()))}, "
                 f"{', '.join(sorted(cells.protocol.unique()))} protocol)\nthick lines: a phase effect after Holm over "
                 f"the {len(cells)} cells)", fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m studies.audit_tables",
                                     description="Tables of the phase audit of kvpress's chunked presses.")
    parser.add_argument("runs", nargs="+", help="the audit's output folders (one chunk length each)")
    parser.add_argument("--output", help="write the Markdown here as well as to stdout")
    parser.add_argument("--figure", help="write the per-phase figure here (PNG)")
    parser.add_argument("--all-cells", action="store_true",
                        help="audit every press and ratio of the runs (an audit of your own press), not only the "
                             "cells this study's screen admitted")
    args = parser.parse_args(argv)
    try:
        cells, summary = load(args.runs, None if args.all_cells else AUDIT_CELLS)
    except ValueError as exc:
        print(f"audit_tables: error: {exc}", file=sys.stderr)
        return 2
    text = cells_markdown(cells) + "\n" + depth_markdown(cells)
    emit(text, args.output)
    if args.figure:
        figure(cells, summary[summary.press == "no_press"], args.figure)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
