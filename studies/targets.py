"""Cell-by-cell targets and phase science of a pre-registered study, from ``kvpress-phase eval`` output directories.

    python -m studies.targets outputs/real-test/agnostic-1024 outputs/real-test/question-1024 \\
        --output docs/results/real-model-tables.md

A *cell* is task x context length x stride x compression ratio x setting. For every cell it reads the runs' per-example
results (merged as ``kvpress-phase report`` merges them) and writes Markdown:

* the targets of ``docs/preregistration-real-model.md`` for ``--press`` (default ``phase_aware``) against
  ``--reference`` (default ``chunked_stride``) and the kvpress baselines: (1) no detectable phase effect
  (permutation p >= 0.05), (2) mean >= the reference's + 0.10 where the reference loses 0.10 or more to
  ``no_press``, (3) mean >= the best baseline's - 0.03; met or missed, with the figures, and the counts per setting
  and over all settings, with the mean difference to the best baseline per ratio, every answer weighing the same
  and every cell weighing the same. The best baseline of a cell is the best of every registered kvpress baseline
  the runs answered (:func:`~.common.kvpress_baselines`; ``--baselines`` restricts them);
* the science: the reference's phase effect (p, cross-fitted gap with its CI, the lowest phases, and whether the
  boundary phase S-1 differs from the others, :func:`~.metrics.boundary_test`), for every ``chunked_stride``
  variant in the runs;
* accuracy by needle depth for every press.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Optional

import numpy as np
import pandas as pd

from kvpress_phase.evaluation.metrics import boundary_test, phase_matrix, summarize
from kvpress_phase.evaluation.presses import parse_press_spec

from studies.common import (ALL_BASELINES, baseline_labels, emit, fmt_number, fmt_p, kvpress_baselines, load, paired,
                            paired_markdown, paired_pooled, pooled_by_ratio)

CELL = ["setting", "task", "context_length", "stride", "compression_ratio"]


def targets(records: pd.DataFrame, press: str, reference: str, baselines: list[str]) -> pd.DataFrame:
    rows = []
    compressed = records[records.compression_ratio > 0]
    for key, cell in compressed.groupby(CELL):
        setting, task, length, stride, ratio = key
        control = records[(records.setting == setting) & (records.task == task) &
                          (records.context_length == length) & (records.stride == stride) &
                          (records.press == "no_press")]
        by = {r.press: r for r in cell.itertuples()}
        if press not in by or reference not in by:
            continue
        ours, ref = by[press], by[reference]
        base = {name: by[name].mean for name in baselines if name in by}
        best = max(base, key=base.get) if base else None
        full = control["mean"].iloc[0] if len(control) else None
        loses = full is not None and full - ref.mean >= 0.10
        answers = getattr(ours, "n_samples", None)
        answers = answers * len(ours.phases) if answers is not None and hasattr(ours, "phases") else None
        rows.append({
            "setting": setting, "task": task, "length": length, "stride": stride, "ratio": ratio,
            "no_press": full, "reference": ref.mean, "press": ours.mean, "p": ours.p_value, "answers": answers,
            "best_baseline": best, "best_mean": base.get(best),
            "t1": ours.p_value is None or ours.p_value >= 0.05,
            "t2": (ours.mean >= ref.mean + 0.10 - 1e-9) if loses else None,
            "t3": (ours.mean >= base[best] - 0.03 - 1e-9) if best else None,
        })
    return pd.DataFrame(rows)


def targets_markdown(table: pd.DataFrame, press: str, reference: str) -> str:
    lines = []
    for setting, part in table.groupby("setting", sort=False):
        lines += [f"### Targets, {setting}", "",
                  f"| task | tokens | S | ratio | no_press | {reference} | {press} | p | best baseline | "
                  "T1 p>=0.05 | T2 +0.10 | T3 >= best - 0.03 |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in part.itertuples():
            mark = {True: "met", False: "**missed**", None: "n/a"}
            t2 = mark[r.t2] if r.t2 is None else f"{mark[r.t2]} ({r.press - r.reference:+.2f})"
            t3 = mark[r.t3] if r.t3 is None else f"{mark[r.t3]} ({r.press - r.best_mean:+.2f})"
            lines.append(f"| {r.task} | {r.length} | {r.stride} | {r.ratio:g} | {fmt_number(r.no_press, 2)} | "
                         f"{fmt_number(r.reference)} | {fmt_number(r.press)} | {fmt_p(r.p)} | {r.best_baseline} {fmt_number(r.best_mean)} | {mark[r.t1]} | "
                         f"{t2} | {t3} |")
        n = len(part)
        t2 = part["t2"].dropna()
        t3 = part["t3"].dropna()
        lines += ["", f"{setting}: T1 met in {int(part['t1'].sum())} of {n} cells; T2 met in {int(t2.sum())} of "
                      f"{len(t2)} cells where {reference} loses 0.10 or more; T3 met in {int(t3.sum())} of {len(t3)} "
                      f"cells ({t3.mean():.0%}; target 80%).", ""]
    return "\n".join(lines)


def baselines_markdown(baselines: list[str], answered: set) -> str:
    """Which baselines the best of a cell was chosen among."""
    registered = kvpress_baselines()
    scope = (f"every registered kvpress baseline ({len(registered)})" if baselines == registered
             else f"{len(baselines)} of the {len(registered)} registered kvpress baselines (`--baselines`)")
    there = [b for b in baselines if b in answered]
    absent = [b for b in baselines if b not in answered]
    return (f"Best baseline of a cell: the best of {scope}; answered in these runs: "
            f"{', '.join(f'`{b}`' for b in there) or 'none'}"
            + (f"; not answered: {', '.join(f'`{b}`' for b in absent)}" if absent else "") + ".")


def overall_markdown(table: pd.DataFrame, press: str) -> str:
    """T3 over every setting, and ``press`` minus the best baseline of each cell per ratio: every answer weighing
    the same (a cell weighs its samples x phases) and every cell weighing the same."""
    part = table.dropna(subset=["t3"])
    if part.empty:
        return ""
    lines = [f"### {press} against the best baseline, all settings", "",
             f"T3 met in {int(part['t3'].sum())} of {len(part)} cells ({part['t3'].mean():.0%}; target 80%).", "",
             "| ratio | cells | T3 met | mean difference to the best baseline, answers weighted | "
             "equal cell weights |", "|---|---|---|---|---|"]
    for ratio, cells in part.groupby("ratio"):
        diff = cells["press"] - cells["best_mean"]
        weights = cells["answers"].astype(float)
        weighted = float((diff * weights).sum() / weights.sum()) if weights.notna().all() and weights.sum() else None
        lines.append(f"| {ratio:g} | {len(cells)} | {int(cells['t3'].sum())} | "
                     f"{'-' if weighted is None else format(weighted, '+.3f')} | "
                     f"{diff.mean():+.3f} |")
    diff = part["press"] - part["best_mean"]
    lines += ["", f"Over every cell: {diff.mean():+.3f} with equal cell weights (the best baseline is chosen per cell, "
                  "after the fact).", ""]
    return "\n".join(lines)


def science(results: pd.DataFrame, records: pd.DataFrame) -> str:
    lines = ["### ChunkedStridePress's phase effect", "",
             "| setting | task | tokens | S | ratio | press | mean | p | cross-fitted gap [95% CI] | detectable | "
             "lowest phases | boundary S-1 minus others (p) |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    variants = sorted(p for p in records.press.unique() if p.split(":")[0] == "chunked_stride")
    for key, cell in records[records.press.isin(variants)].groupby(CELL + ["press"]):
        setting, task, length, stride, ratio, press = key
        r = cell.iloc[0]
        sub = results[(results.setting == setting) & (results.task == task) & (results.context_length == length)
                      & (results.stride == stride) & (results.compression_ratio == ratio) & (results.press == press)]
        matrix, _ = phase_matrix(sub, stride)
        diff, p_boundary = boundary_test(matrix)
        per = np.asarray([np.nan if x is None else x for x in r.per_phase])
        order = [int(i) for i in np.argsort(per)[:2]]
        lowest = ", ".join(f"{i} ({per[i]:.2f})" for i in order)
        gap = "-" if r.gap_xfit is None or pd.isna(r.gap_xfit) else \
            f"{r.gap_xfit:.2f} [{r.gap_xfit_ci_low:.2f}, {r.gap_xfit_ci_high:.2f}]"
        lines.append(f"| {setting} | {task} | {length} | {stride} | {ratio:g} | {press} | {r['mean']:.3f} | "
                     f"{fmt_p(r.p_value)} | {gap} | {fmt_number(r.detectable_gap, 2)} | {lowest} | "
                     f"{fmt_number(diff, 2)} ({fmt_p(p_boundary)}) |")
    return "\n".join(lines) + "\n"


def depth_markdown(records: pd.DataFrame) -> str:
    lines = ["### Accuracy by needle depth (five bins, start to end of the context; mean over the cells)", "",
             "| setting | press | ratio | 0-0.2 | 0.2-0.4 | 0.4-0.6 | 0.6-0.8 | 0.8-1 |", "|---|---|---|---|---|---|---|---|"]
    for (setting, press, ratio), part in records.groupby(["setting", "press", "compression_ratio"]):
        bins = np.array([[np.nan if m is None else m for m, _ in r] for r in part.per_depth if r], dtype=float)
        if not len(bins):
            continue
        with warnings.catch_warnings():  # a depth bin no needle fell into stays empty: "-"
            warnings.simplefilter("ignore", RuntimeWarning)
            means = np.nanmean(bins, axis=0)
        lines.append(f"| {setting} | {press} | {ratio:g} | " + " | ".join(fmt_number(x, 2) for x in means) + " |")
    return "\n".join(lines) + "\n"


def against_markdown(records: pd.DataFrame, results: pd.DataFrame, press: str, against: str) -> str:
    """``press`` against one press (``--against``, e.g. KVzip): its mean, the other's and the difference per cell, and
    the difference paired by sample per setting, length and ratio (the two tasks pooled; a sample's value is its mean
    over the strides and phases), with a 95% t interval (:func:`~.common.paired`); and the difference pooled over all
    the runs given, one value per text (:func:`~.common.paired_pooled`)."""

    lines = [f"### {press} against {against}", "", f"| setting | task | tokens | S | ratio | {press} | {against} | "
             "difference |", "|---|---|---|---|---|---|---|---|"]
    means = records[records.compression_ratio > 0].set_index(CELL + ["press"])["mean"]
    for key, cell in means.groupby(level=CELL):
        by = cell.droplevel(CELL)
        if press in by and against in by:
            setting, task, length, stride, ratio = key
            lines.append(f"| {setting} | {task} | {length} | {stride} | {ratio:g} | {by[press]:.2f} | "
                         f"{by[against]:.2f} | {by[press] - by[against]:+.2f} |")
    table = paired(results, against,
                   by=("setting", "context_length", "compression_ratio"))
    lines += ["", paired_markdown(table[table.press == press], against), ""]
    pooled = paired_pooled(results, press, against)
    equal = paired_pooled(results, press, against, equal_cells=True)
    lines += [f"Pooled over these runs, one value per text (task and sample: its mean difference over the settings, "
              f"lengths, ratios, strides and phases; {pooled['answers']} paired answer groups): "
              f"{pooled['diff']:+.3f} [{pooled['low']:+.3f}, {pooled['high']:+.3f}] over {pooled['n']} texts "
              f"(95% t interval); with every cell weighing the same (a text's difference averaged over the phases of "
              f"each cell, then over its cells): {equal['diff']:+.3f} [{equal['low']:+.3f}, {equal['high']:+.3f}].",
              "", "Per ratio, pooled over the settings, lengths, tasks and strides (one value per text, 95% t "
              "interval): every answer weighing the same (a stride weighs its phases) and every cell weighing the "
              "same.", "", f"| ratio | cells | {press} - {against}, answers weighted | equal cell weights |",
              "|---|---|---|---|"]
    for r in pooled_by_ratio(results, press, against).itertuples():
        lines.append(f"| {r.ratio:g} | {r.cells} | {r.diff:+.3f} [{r.low:+.3f}, {r.high:+.3f}] | "
                     f"{r.equal:+.3f} [{r.equal_low:+.3f}, {r.equal_high:+.3f}] |")
    lines.append("")
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--press", default="phase_aware")
    parser.add_argument("--reference", default="chunked_stride")
    parser.add_argument("--baselines", default=ALL_BASELINES,
                        help="the kvpress baselines a cell's best baseline is chosen among: 'all' (default: every "
                        "registered kvpress baseline, " + ",".join(kvpress_baselines()) + ") or a comma-separated "
                        "list of them to restrict it")
    parser.add_argument("--against", help="also compare --press with this press cell by cell and paired by sample "
                        "(e.g. kvzip)")
    parser.add_argument("--output", help="write the Markdown here as well as to stdout")
    args = parser.parse_args(argv)
    try:
        results = load(args.runs)
    except ValueError as exc:
        print(f"targets: error: {exc}", file=sys.stderr)
        return 2
    try:  # specs as the results name them (``share_heads=false`` is stored as ``share_heads=False``)
        press, reference = parse_press_spec(args.press).label, parse_press_spec(args.reference).label
        against = parse_press_spec(args.against).label if args.against else None
        baselines = baseline_labels(args.baselines)
    except ValueError as exc:
        print(f"targets: error: {exc}", file=sys.stderr)
        return 2
    answered = set(results.press)
    for role, name in (("--press", press), ("--reference", reference), ("--against", against)):
        if name is None:
            continue
        if name not in answered:
            print(f"targets: error: {role} {name!r} has no answers in these runs; presses answered: "
                  f"{', '.join(sorted(answered))}", file=sys.stderr)
            return 2
    records = pd.DataFrame(summarize(results, n_resamples=1000))
    table = targets(records, press, reference, baselines)
    if table.empty:
        print(f"targets: error: no compressed cell has answers of both {press!r} and {reference!r} (--reference is a "
              "compressing press answered in the same cells, such as chunked_stride)", file=sys.stderr)
        return 2
    parts = [baselines_markdown(baselines, answered) + "\n", targets_markdown(table, press, reference),
             overall_markdown(table, press)]
    if against:
        parts.append(against_markdown(records, results, press, against))
    text = "\n".join(parts + [science(results, records), depth_markdown(records)])
    emit(text, args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
