"""The learned-scorer dev round's tables and its pre-registered decision (docs/preregistration-learned-scorer.md).

    python -m studies.learned_dev outputs/learned-dev/agnostic-s8 outputs/learned-dev/agnostic-s12 \\
        outputs/learned-dev/question-s8 outputs/learned-dev/question-s12 [--cost FILE]

Reads the dev round's ``kvpress-phase eval`` directories (one stride each; a dev cell is setting x task x ratio,
pooling the strides) and prints Markdown:

1. every press's accuracy per dev cell and its mean over the 12 cells (``no_press`` per setting and task);
2. every press paired by sample with the best kvpress baseline of each cell (chosen after the fact among every
   registered kvpress baseline the runs answered, :func:`~.common.kvpress_baselines`; the dev round ran
   ``kvzip_plus``, ``adakv``, ``kvzap`` and ``keydiff``; ``--baselines`` restricts them): per setting and ratio,
   pooled over tasks and strides, the mean
   of (the press's mean over a sample's phases - the baseline's) with a 95% t interval; and the count of cells within
   0.03 of the best baseline;
3. the decision rule in its order: flat (the phase tests of a candidate's 24 (cell, stride) pairs, Holm-adjusted at
   family-wise 0.05), cost (``--cost``: a Markdown table of ``benchmarks/bench_compress_cost.py``, at most 0.1
   prefills), the dense candidate D against the frozen ``phase_aware`` (+0.05 over the 12 cells), and the better of
   the masking candidates G and H as an option.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

import numpy as np
import pandas as pd
from scipy import stats

from kvpress_phase.evaluation.metrics import holm
from kvpress_phase.evaluation.presses import parse_press_spec

from studies.common import (ALL_BASELINES, baseline_labels, fmt_number, fmt_p, kvpress_baselines, load,
                            read_summaries)

REFERENCE = "phase_aware"
DENSE = "layer_budget:scorer=kvzap"
MASKING = ("global_budget:scorer=kvzap", "head_budget:scorer=kvzap")
"""The candidates by their labels of today (the dev round's runs, written as ``phase_aware:scorer=kvzap:allocate=...``,
read under them: :mod:`kvpress_phase.evaluation.spellings`)."""
PREREGISTERED = ("kvzip_plus", "adakv", "kvzap", "keydiff")
"""The kvpress baselines the dev round ran; among equal means the best baseline is the first of them."""
BASELINES = tuple(PREREGISTERED) + tuple(b for b in kvpress_baselines() if b not in PREREGISTERED)
"""Every registered kvpress baseline, the dev round's first (the order that breaks ties)."""
CELL = ["setting", "task", "compression_ratio"]
MARGIN, TIE, ALPHA, COST_CAP, NEAR = 0.05, 0.02, 0.05, 0.1, 0.03


def phase_tests(runs: list[str]) -> pd.DataFrame:
    """The phase test of every (setting, task, ratio, stride, press) from the runs' ``summary.json``."""
    return read_summaries(runs)[CELL + ["stride", "press", "p_value"]]


def cell_means(records: pd.DataFrame) -> pd.DataFrame:
    """Mean score per dev cell and press (strides pooled; ``no_press`` per setting and task, at ratio 0)."""
    return records.groupby(CELL + ["press"])["score"].mean().rename("mean").reset_index()


def per_sample(records: pd.DataFrame) -> pd.DataFrame:
    """A sample's value per press: its mean over the phases (a sample is task, stride and sample id)."""
    compressed = records[records.compression_ratio > 0]
    return compressed.groupby(["setting", "compression_ratio", "task", "stride", "sample_id", "press"])["score"] \
        .mean().unstack("press")


def best_baselines(means: pd.DataFrame, baselines: tuple = BASELINES) -> pd.Series:
    """The best kvpress baseline of every compressed cell among ``baselines`` (default: every registered one),
    chosen after the fact (ties: the first of ``baselines``)."""
    base = means[means.press.isin(baselines) & (means.compression_ratio > 0)].copy()
    base["order"] = base.press.map(list(baselines).index)
    base = base.sort_values(CELL + ["mean", "order"], ascending=[True, True, True, False, True])
    return base.groupby(CELL).first()["press"]


def paired_with_best(records: pd.DataFrame, means: pd.DataFrame, baselines: tuple = BASELINES) -> pd.DataFrame:
    best = best_baselines(means, baselines)
    samples = per_sample(records)
    rows = []
    for press in samples.columns:
        if press in baselines:
            continue
        parts = []
        for (setting, task, ratio), baseline in best.items():
            block = samples.xs((setting, ratio, task), level=("setting", "compression_ratio", "task"))
            parts.append(pd.DataFrame({"setting": setting, "ratio": ratio,
                                       "diff": (block[press] - block[baseline]).dropna().to_numpy()}))
        diffs = pd.concat(parts)
        for (setting, ratio), d in diffs.groupby(["setting", "ratio"]):
            n, mean = len(d), d["diff"].mean()
            half = stats.t.ppf(0.975, n - 1) * d["diff"].std(ddof=1) / np.sqrt(n) if n > 1 else float("nan")
            rows.append({"press": press, "setting": setting, "ratio": ratio, "n": n, "diff": mean,
                         "low": mean - half, "high": mean + half})
    return pd.DataFrame(rows)


def accuracy_markdown(means: pd.DataFrame, tests: pd.DataFrame, baselines: tuple = BASELINES) -> str:
    best = best_baselines(means, baselines)
    cells = means[means.compression_ratio > 0][["compression_ratio", "task"]].drop_duplicates()
    cells = cells.sort_values(["compression_ratio", "task"]).itertuples(index=False)
    cells = list(cells)
    head = " | ".join(f"{r:g} {t.replace('niah_', '')}" for r, t in cells)
    min_p = tests.groupby(CELL + ["press"])["p_value"].min()
    lines = []
    for setting, part in means.groupby("setting", sort=False):
        lines += [f"#### {setting}", "", f"| press | {head} | mean | within {NEAR} of best baseline |",
                  "|---|" + "---|" * (len(cells) + 2)]
        nopress = part[part.press == "no_press"].set_index("task")["mean"]
        lines.append("| `no_press` | " + " | ".join(f"{nopress.get(t, float('nan')):.2f}" for _, t in cells)
                     + " | | |")
        for press, rows in part[part.press != "no_press"].groupby("press", sort=False):
            by = rows.set_index(["task", "compression_ratio"])["mean"]
            marks, values, near = [], [], 0
            for ratio, task in cells:
                value = by.get((task, ratio))
                if value is None:
                    marks.append("")
                    continue
                values.append(value)
                top = means[(means.setting == setting) & (means.task == task) & (means.compression_ratio == ratio)
                            & (means.press == best[(setting, task, ratio)])]["mean"].iloc[0]
                near += value >= top - NEAR
                p = min_p.get((setting, task, ratio, press))
                flag = "" if p is None or np.isnan(p) else f" ({fmt_p(p)})"
                marks.append(f"{value:.2f}{flag}")
            mean = fmt_number(float(np.mean(values))) if len(values) == len(cells) else ""
            lines.append(f"| `{press}` | " + " | ".join(marks) + f" | {mean} | {near}/{len(cells)} |")
        lines.append("")
    lines.append("(p): the smaller of the two strides' phase-test p-values, unadjusted; best baseline per cell: "
                 + ", ".join(f"{s} {t.replace('niah_', '')} {r:g}: {b}" for (s, t, r), b in best.items()))
    return "\n".join(lines)


def paired_markdown(table: pd.DataFrame) -> str:
    lines = ["| press | setting | ratio | samples | mean difference to the best baseline [95% CI] |",
             "|---|---|---|---|---|"]
    for r in table.itertuples():
        lines.append(f"| `{r.press}` | {r.setting} | {r.ratio:g} | {r.n} | {r.diff:+.3f} [{r.low:+.3f}, "
                     f"{r.high:+.3f}] |")
    return "\n".join(lines)


def read_costs(path: Optional[str]) -> dict:
    """``{press spec label: compress step in prefills}`` from the Markdown table(s) that
    ``benchmarks/bench_compress_cost.py --output`` appends (the column "in prefills"; a later table wins)."""
    if not path:
        return {}
    costs, column = {}, None
    for line in open(path, encoding="utf-8"):
        cols = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if "in prefills" in cols:
            column = cols.index("in prefills")
            continue
        if column is None or len(cols) <= column:
            continue
        try:
            costs[parse_press_spec(cols[0]).label] = float(cols[column])
        except ValueError:  # the separator row, or a press this version no longer has
            continue
    return costs


def decide(means: pd.DataFrame, tests: pd.DataFrame, costs: dict) -> str:
    """The pre-registered decision, as Markdown."""
    compressed = means[means.compression_ratio > 0]
    overall = compressed.groupby("press")["mean"].mean()
    n_cells = compressed[compressed.press == REFERENCE].shape[0]
    ref = overall[REFERENCE]
    lines, kept = [], {}
    for press in (DENSE, *MASKING):
        p = tests[tests.press == press]["p_value"].dropna().to_numpy()
        cells = compressed[compressed.press == press].shape[0]
        if cells != n_cells:
            lines.append(f"- `{press}`: {cells} of {n_cells} cells answered, not compared")
            continue
        adjusted = holm(p) if len(p) else np.array([])
        if (adjusted < ALPHA).any():
            lines.append(f"- `{press}`: dropped (rule 1), its phase test fires after Holm's correction over "
                         f"{len(p)} tests (smallest adjusted p {adjusted.min():.3f})")
            continue
        cost = costs.get(press)
        if cost is not None and cost > COST_CAP:
            lines.append(f"- `{press}`: dropped (rule 2), compress step {cost:.3f} prefills > {COST_CAP}")
            continue
        kept[press] = overall[press]
        smallest = f"{adjusted.min():.3f}" if len(p) else "-"
        lines.append(f"- `{press}`: flat (smallest Holm-adjusted p over {len(p)} tests {smallest}), cost "
                     f"{'not measured' if cost is None else f'{cost:.3f} prefills'}; mean {kept[press]:.3f} over "
                     f"{n_cells} cells ({kept[press] - ref:+.3f} against `{REFERENCE}`'s {ref:.3f})")
    if DENSE in kept and kept[DENSE] - ref >= MARGIN:
        lines.append(f"\nRule 3: the default candidate is `{DENSE}` (+{kept[DENSE] - ref:.3f} >= {MARGIN}).")
    else:
        lines.append(f"\nRule 3: `{DENSE}` does not beat `{REFERENCE}` by {MARGIN} (or was dropped): the frozen "
                     "default stays the default candidate.")
    masks = [p for p in MASKING if p in kept]
    if masks:
        top = max(masks, key=lambda p: kept[p])
        if top != MASKING[0] and MASKING[0] in kept and kept[top] - kept[MASKING[0]] <= TIE:
            top = MASKING[0]
        verdict = "goes to the fresh split as an option" if kept[top] - ref >= MARGIN else \
            f"does not beat `{REFERENCE}` by {MARGIN}: no option goes to the fresh split"
        lines.append(f"Rule 4: the better masking candidate is `{top}` ({kept[top]:.3f}); it {verdict}.")
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m studies.learned_dev", description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="the dev round's kvpress-phase eval output directories")
    parser.add_argument("--cost", help="the Markdown output of benchmarks/bench_compress_cost.py --output")
    parser.add_argument("--baselines", default=ALL_BASELINES,
                        help="the kvpress baselines a cell's best baseline is chosen among: 'all' (default: every "
                        "registered kvpress baseline) or a comma-separated list of them to restrict it")
    args = parser.parse_args(argv)
    try:
        chosen = baseline_labels(args.baselines)
        baselines = tuple(b for b in BASELINES if b in chosen) + tuple(b for b in chosen if b not in BASELINES)
        records = load(args.runs)
        tests = phase_tests(args.runs)
        costs = read_costs(args.cost)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    means = cell_means(records)
    print("### Accuracy per dev cell (strides pooled)\n")
    answered = [b for b in baselines if b in set(means.press)]
    print(f"Best baseline of a cell: the best of {len(answered)} kvpress baselines answered in these runs "
          f"({', '.join(answered)}; registered: {len(kvpress_baselines())}).\n")
    print(accuracy_markdown(means, tests, baselines))
    print("\n### Paired with the best kvpress baseline of each cell\n")
    print(paired_markdown(paired_with_best(records, means, baselines)))
    print("\n### The pre-registered decision\n")
    print(decide(means, tests, costs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
