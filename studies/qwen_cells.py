"""Cells that separate the presses on Qwen2.5-Coder-0.5B: the sizing's rule (docs/results/qwen-cells/sizing.md) on
its runs.

    python -m studies.qwen_cells outputs/qwen-sizing/n2048 [outputs/qwen-sizing/n4096 ...] [--output FILE]

Per (task, context length): the uncompressed accuracy, each baseline's accuracy at ratio 0.5 (our recommended press
beside them), the largest set of baselines whose accuracies lie pairwise more than 0.1 apart, and whether the cell
qualifies (uncompressed below 0.95, at least three such baselines). Cells are ranked as the rule ranks them.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

import pandas as pd

from studies.common import emit, kvpress_baselines, load

RATIO = 0.5
CEILING = 0.95
APART = 0.1
AT_LEAST = 3


def separated(accuracies: pd.Series, apart: float = APART) -> list[str]:
    """The largest set of presses whose accuracies lie pairwise more than ``apart`` apart (greedy from the lowest,
    which is optimal on a line)."""
    chosen, last = [], None
    for name, value in accuracies.sort_values().items():
        if last is None or value - last > apart:
            chosen.append(name)
            last = value
    return chosen


def cells(records: pd.DataFrame) -> pd.DataFrame:
    baselines = set(kvpress_baselines())
    rows = []
    for (task, length), part in records.groupby(["task", "context_length"], sort=True):
        means = part.groupby(["press", "compression_ratio"])["score"].mean()
        plain = means.get(("no_press", 0.0), float("nan"))
        at = means.xs(RATIO, level="compression_ratio") if RATIO in means.index.get_level_values(1) else pd.Series()
        base = at[[p for p in at.index if p in baselines]]
        apart = separated(base)
        ours = {p: at[p] for p in at.index if p not in baselines}
        rows.append({"task": task, "tokens": int(length), "texts": part.sample_id.nunique(), "no_press": plain,
                     "baselines": len(base), "lowest": base.min(), "highest": base.max(),
                     "apart": len(apart), "apart_presses": ", ".join(f"{p} {base[p]:.2f}" for p in apart),
                     **{f"ours {p}": v for p, v in ours.items()},
                     "qualifies": bool(plain < CEILING and len(apart) >= AT_LEAST)})
    frame = pd.DataFrame(rows)
    if frame.empty:
        return frame
    frame["answers"] = frame.no_press > 0.5
    return frame.sort_values(["qualifies", "apart", "answers", "no_press"], ascending=[False, False, False, True])


def markdown(frame: pd.DataFrame, runs: list) -> str:
    if frame.empty:
        return "No answers yet."
    show = frame.drop(columns=["answers"]).copy()
    for column in show.columns:
        if show[column].dtype == float:
            show[column] = show[column].map(lambda x: f"{x:.2f}")
    return (f"Runs: {', '.join(f'`{r}`' for r in runs)}. Ratio {RATIO}; a cell qualifies when `no_press` < {CEILING} "
            f"and at least {AT_LEAST} baselines lie pairwise more than {APART} apart (`apart`).\n\n"
            + show.to_markdown(index=False) + "\n")


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    emit(markdown(cells(load(args.runs)), args.runs), args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
