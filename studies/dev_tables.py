"""The budget dev round's tables and its pre-registered decision (docs/preregistration-budgets.md).

    python -m studies.dev_tables RUN [RUN ...] [--reference phase_aware] [--against kvzip]
        [--exclude SPEC,...]

Reads ``kvpress-phase eval`` output directories of the dev round (both settings, any split of the presses between
directories; a cell answered in two directories is taken from the first) and prints Markdown:

1. every press's accuracy per cell (task x ratio) and setting, with the permutation p of its phase test where it
   has one, and its mean over the cells;
2. every press against ``--against`` (KVzip), paired by sample: per setting and ratio, pooled over the tasks, the
   mean over samples of (the press's mean over a sample's phases - the other press's), with a 95% t interval;
3. the decision rule, in its order: a candidate whose phase test fires (p < 0.05) in any cell is dropped; of the
   rest the one with the highest mean over all cells of both settings is chosen if it beats ``--reference`` (the
   frozen default) by at least 0.05, otherwise the reference stays; candidates within 0.02 of the best are listed
   as ties (the cheaper one wins; cost is measured separately, benchmarks/bench_presses.py).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

import numpy as np
import pandas as pd

from kvpress_phase.evaluation.presses import parse_press_spec

from studies.common import fmt_number, fmt_p, load, paired, paired_markdown, read_summaries

CELL = ["setting", "task", "compression_ratio"]
NOT_CANDIDATES = ("no_press", "chunked_stride", "kvzip", "keydiff", "snapkv")
MARGIN, TIE, ALPHA = 0.05, 0.02, 0.05


def summaries(runs: list[str]) -> pd.DataFrame:
    return read_summaries(runs).drop_duplicates(CELL + ["press"], keep="first")


def accuracy_markdown(table: pd.DataFrame) -> str:
    lines = []
    cells = table[table.press != "no_press"][["task", "compression_ratio"]].drop_duplicates()
    cells = cells.sort_values(["compression_ratio", "task"])
    head = " | ".join(f"{r:g} {t.replace('niah_', '')}" for t, r in cells.itertuples(index=False))
    for setting, part in table.groupby("setting", sort=False):
        lines += [f"#### {setting}", "", f"| press | {head} | mean |", "|---|" + "---|" * (len(cells) + 1)]
        for press, rows in part.groupby("press", sort=False):
            by = {(r.task, r.compression_ratio): r for r in rows.itertuples()}
            values, marks = [], []
            for task, ratio in cells.itertuples(index=False):
                r = by.get((task, ratio)) or (by.get((task, 0.0)) if press == "no_press" else None)
                if r is None:
                    marks.append("")
                    continue
                values.append(r.mean)
                flag = "" if r.p_value is None or np.isnan(r.p_value) else f" (p {fmt_p(r.p_value)})"
                marks.append(f"{r.mean:.2f}{flag}")
            mean = fmt_number(np.mean(values), 3) if len(values) == len(cells) else ""
            lines.append(f"| `{press}` | " + " | ".join(marks) + f" | {mean} |")
        lines.append("")
    return "\n".join(lines)


def decide(table: pd.DataFrame, reference: str, candidates: Optional[list] = None) -> tuple[str, str]:
    """The pre-registered decision: (the chosen press, Markdown saying why)."""
    ours = table[table.compression_ratio > 0]
    names = candidates or [p for p in ours.press.unique() if p not in NOT_CANDIDATES and p != reference]
    n_cells = ours[ours.press == reference].shape[0]
    lines, kept = [], {}
    ref_mean = ours[ours.press == reference]["mean"].mean()
    for name in names:
        rows = ours[ours.press == name]
        fired = rows[rows.p_value.notna() & (rows.p_value < ALPHA)]
        if len(rows) != n_cells:
            lines.append(f"- `{name}`: {len(rows)} of {n_cells} cells answered, not compared")
        elif len(fired):
            where = ", ".join(f"{r.setting} {r.task} {r.compression_ratio:g} (p {fmt_p(r.p_value)})"
                              for r in fired.itertuples())
            lines.append(f"- `{name}`: dropped, its phase test fires in {where}")
        else:
            kept[name] = rows["mean"].mean()
            lines.append(f"- `{name}`: mean {kept[name]:.3f} over {n_cells} cells ({kept[name] - ref_mean:+.3f} "
                         f"against `{reference}`'s {ref_mean:.3f})")
    if not kept:
        return reference, "\n".join(lines + [f"\nNo candidate is left: `{reference}` stays."])
    best = max(kept, key=kept.get)
    ties = [n for n in kept if n != best and kept[best] - kept[n] <= TIE]
    if kept[best] < ref_mean + MARGIN:
        verdict = (f"\nThe best candidate, `{best}` ({kept[best]:.3f}), beats `{reference}` by "
                   f"{kept[best] - ref_mean:+.3f}, less than {MARGIN}: `{reference}` stays.")
        return reference, "\n".join(lines + [verdict])
    verdict = f"\nChosen by the rule: `{best}` ({kept[best]:.3f}, {kept[best] - ref_mean:+.3f} against `{reference}`)."
    if ties:
        verdict += (" Within " + f"{TIE} of it (the cheaper one wins): " + ", ".join(f"`{n}` ({kept[n]:.3f})"
                                                                              for n in ties) + ".")
    return best, "\n".join(lines + [verdict])


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m studies.dev_tables", description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="kvpress-phase eval output directories of the dev round")
    parser.add_argument("--reference", default="phase_aware", help="the frozen default (default: phase_aware)")
    parser.add_argument("--against", default="kvzip", help="the press every other is paired with (default: kvzip)")
    parser.add_argument("--candidates", default=None, help="comma-separated candidate specs (default: every press "
                        "but the baselines, the reference and --exclude)")
    parser.add_argument("--exclude", default="", help="comma-separated press specs shown but not candidates (a "
                        "descriptive run, a press above the cost cap)")
    args = parser.parse_args(argv)
    try:
        table = summaries(args.runs)
        records = load(args.runs)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        excluded = {parse_press_spec(text).label for text in args.exclude.split(",") if text}
        candidates = [parse_press_spec(text).label for text in args.candidates.split(",")] if args.candidates else \
            [p for p in table.press.unique() if p not in NOT_CANDIDATES and p != args.reference and p not in excluded]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    chosen, why = decide(table, args.reference, candidates)
    print(accuracy_markdown(table))
    print(paired_markdown(paired(records, args.against), args.against))
    print("\n" + why)
    return 0


if __name__ == "__main__":
    sys.exit(main())
