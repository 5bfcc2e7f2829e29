"""The spread that sizes the ratio-regimes dev round (docs/preregistration-ratio-regimes.md, deviation 1): in runs
answered before it, the standard deviation of a text's difference to its cell's best kvpress baseline, per model and
ratio, for every press of ours (every press that is neither ``no_press`` nor a kvpress baseline).

    python -m studies.regimes_sizing outputs/learned-test/* outputs/qwen-replication/agnostic \\
        outputs/qwen-replication/question [--samples 3]

A cell is (model, setting, task, context length, ratio) with the runs' strides pooled, as in the dev round; a text is
one sample of one stride, its value its mean over the phases; the best baseline of a cell is the best of the kvpress
baselines present in the runs (:mod:`studies.regimes_runs`). Prints, per model and ratio, the texts, the mean and the
largest standard deviation over the presses of ours, and what the dev round as planned detects at that spread
(``--samples`` per phase for the runs deviation 1 sizes).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from studies.common import emit, load
from studies.regimes import detectable, paired_with_best
from studies.regimes_runs import BASELINES, Design, best_baselines, cell_means


def spread(runs: list[str]):
    """Per model and ratio: texts, mean and largest standard deviation of a text's difference to its cell's best
    baseline over the presses of ours, and which press is the largest."""
    records = load(runs)
    records = records[records.compression_ratio > 0]
    ours = tuple(p for p in records.press.unique() if p not in BASELINES and p != "no_press")
    table = paired_with_best(records, best_baselines(cell_means(records)), presses=ours)
    table = table[table.model != "both"]
    rows = []
    for (model, ratio), block in table.groupby(["model", "ratio"]):
        top = block.loc[block.sd.idxmax()]
        rows.append({"model": model, "ratio": ratio, "presses": len(block), "texts": int(block.n.max()),
                     "mean_sd": block.sd.mean(), "max_sd": top.sd, "max_press": top.press})
    return rows


def markdown(rows: list, samples: int) -> str:
    design = Design(samples=samples, samples_by_run=())
    per_model, per_ratio = design.texts_planned(design.models[0]), design.texts_planned()
    lines = ["| model | ratio | presses of ours | texts | sd (mean over presses) | sd (largest, press) | "
             f"detectable, a model and ratio ({per_model} texts) | detectable, a ratio ({per_ratio} texts) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['ratio']:g} | {r['presses']} | {r['texts']} | {r['mean_sd']:.3f} | "
                     f"{r['max_sd']:.3f} (`{r['max_press']}`) | {detectable(per_model, r['mean_sd']):.3f} | "
                     f"{detectable(per_ratio, r['mean_sd']):.3f} |")
    lines += ["", f"Detectable at the mean spread, 80% power, two-sided 0.05, with {samples} samples per phase in "
              "every dev run; at the bound sd = 0.5: "
              f"{detectable(per_model):.3f} per model and ratio, {detectable(per_ratio):.3f} per ratio."]
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m studies.regimes_sizing", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="kvpress-phase eval output directories answered before the round")
    parser.add_argument("--samples", type=int, default=3, help="samples per phase of a dev run (default 3)")
    parser.add_argument("--output", help="also write the Markdown here")
    args = parser.parse_args(argv)
    if args.samples < 1:
        parser.error(f"--samples must be >= 1, got {args.samples}")
    try:
        rows = spread(args.runs)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not rows:
        print("error: no press of ours has a text paired with a kvpress baseline in these runs", file=sys.stderr)
        return 2
    emit(markdown(rows, args.samples), args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
