"""The yardstick of "within 0.03 of the best baseline" on a committed split, and what its phase tests can see.

    python -m studies.yardstick RUN [RUN ...] [--cell setting,task,context_length,compression_ratio,stride]
        [--baselines all|A,B,...] [--press SPEC] [--replicates 2000] [--output FILE]

1. **The yardstick** (:func:`~kvpress_phase.evaluation.metrics.tied_share`): per model, the share of the split's cells
   in which a press whose true accuracy equals the best baseline's would be counted within 0.03 of it, simulated
   under the split's own design (its texts, their phases, the per-text effect and the phase dependence fitted on the
   baselines' answers), with its 90% range over simulated splits; per ratio too. With ``--press``: that press's
   count beside it.
2. **Where the phase test speaks**: per press, the share of texts whose answers differ between two phases of the
   grid. A press whose answers never move with the phase gives a phase test p = 1 by construction; "flat" then says
   nothing about it, and it is reported by its accuracy and interval instead.
3. **Calibration** (``--calibration``): the yardstick against the share a tied press is counted in on simulated
   splits of known truth, drawn from its own model (:func:`copula_split`) and from one it does not assume
   (:func:`beta_split`: a text effect that moves every press alike, clipped, and phases answered by one draw).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

import numpy as np
import pandas as pd

from kvpress_phase.evaluation.metrics import NEAR, Dependence, tied_share

from studies.common import baseline_labels, emit, load

DEFAULT_CELL = "setting,task,context_length,compression_ratio,stride"


def phase_movement(records: pd.DataFrame) -> pd.Series:
    """Per press: the share of (text, ratio) pairs whose scores differ between the phases it was answered at."""
    compressed = records[records.compression_ratio > 0]
    keys = [k for k in ("model", "setting", "task", "context_length", "stride", "sample_id", "compression_ratio")
            if k in compressed]
    moves = compressed.groupby(keys + ["press"])["score"].nunique() > 1
    return moves.groupby(level="press").mean().sort_values()


def counted(records: pd.DataFrame, cell: list, baselines: list, press: str) -> pd.Series:
    """Per cell: whether ``press``'s mean is within 0.03 of the best baseline's."""
    means = records.groupby(cell + ["press"])["score"].mean().unstack("press")
    best = means[[b for b in baselines if b in means]].max(axis=1)
    return (means[press] >= best - NEAR - 1e-9).dropna()


def report(records: pd.DataFrame, cell: list, baselines: list, press: Optional[str], replicates: int) -> str:
    records = records[records.compression_ratio > 0]
    answered = [b for b in baselines if b in set(records.press)]
    lines = ["## The yardstick", "",
             f"Cells: {', '.join(cell)}; the best baseline of a cell is the best of {len(answered)} answered "
             f"({', '.join(f'`{b}`' for b in answered)}). \"Tied\": a press with the best baseline's accuracy in every "
             f"cell, simulated {replicates} times under the split's design.", "",
             "| model | ratio | cells | texts per cell | latent r (texts, phases) | a tied press is counted in | 90% of "
             "splits | " + (f"`{press}` counted in |" if press else ""),
             "|---|---|---|---|---|---|---|" + ("---|" if press else "")]
    models = sorted(records.model.unique()) if "model" in records else [None]
    for model in models:
        part = records if model is None else records[records.model == model]
        ys = tied_share(part, cell=cell, baselines=answered, replicates=replicates)
        texts = part.groupby(cell)[["stride", "sample_id"]].apply(lambda f: len(f.drop_duplicates())).median()
        hits = counted(part, cell, answered, press) if press else None
        rows = [("all", ys.per_cell, hits)]
        for ratio in sorted(part.compression_ratio.unique()):
            level = ys.per_cell.index.get_level_values("compression_ratio") == ratio
            rows.append((f"{ratio:g}", ys.per_cell[level],
                         None if hits is None else hits[hits.index.get_level_values("compression_ratio") == ratio]))
        for label, chances, hit in rows:
            sub = ys if label == "all" else tied_share(
                part[part.compression_ratio == float(label)], cell=cell, baselines=answered, replicates=replicates,
                dependence=ys.dependence)
            own = "" if hit is None else f" {int(hit.sum())} of {len(hit)} ({hit.mean():.0%}) |"
            lines.append(f"| {model} | {label} | {len(chances)} | {texts:g} | {ys.dependence.texts:.2f}, "
                         f"{ys.dependence.phases:.2f} | {chances.mean():.0%} | {sub.low:.0%}-{sub.high:.0%} |{own}")
    moves = phase_movement(records)
    lines += ["", "## Where the phase test speaks", "",
              "Share of texts (and ratios) whose answers differ between two phases of the grid; a press at 0% gives "
              "a phase test p = 1 by construction, so \"flat\" says nothing about it.", "",
              "| press | texts whose answer moves with the phase |", "|---|---|"]
    lines += [f"| `{name}` | {share:.1%} |" for name, share in moves.items()]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------ simulated splits, known truth
def _frame(y: np.ndarray) -> pd.DataFrame:
    """(cells, presses, texts, phases) 0/1 answers as the evaluation's long table; press ``p0`` is the candidate."""
    c, j, t, ph = np.indices(y.shape)
    return pd.DataFrame({"cell": c.ravel(), "stride": y.shape[3], "sample_id": t.ravel(), "phase": ph.ravel(),
                         "press": np.char.add("p", j.ravel().astype(str)), "score": y.ravel().astype(float)})


def copula_split(rng, truths: np.ndarray, texts: int, phases: int, dependence: Dependence) -> pd.DataFrame:
    """Answers of ``truths`` (cells, presses; press 0 the candidate) from :func:`tied_share`'s own model."""
    from scipy import stats

    n_c, n_p = truths.shape
    z = (rng.standard_normal((n_c, 1, texts, 1)) * np.sqrt(dependence.texts)
         + rng.standard_normal((n_c, n_p, texts, 1)) * np.sqrt(dependence.phases - dependence.texts)
         + rng.standard_normal((n_c, n_p, texts, phases)) * np.sqrt(1 - dependence.phases))
    return _frame(z < stats.norm.ppf(truths)[:, :, None, None])


def beta_split(rng, truths: np.ndarray, texts: int, phases: int, share: float = 0.9) -> pd.DataFrame:
    """Not :func:`tied_share`'s model: a text moves every press's accuracy by one Beta(2, 2) amount (clipped to
    [0, 1]), and a press answers every phase of a text with one draw with probability ``share``."""
    n_c, n_p = truths.shape
    u = rng.beta(2, 2, (n_c, 1, texts, 1)) - 0.5
    p = np.clip(truths[:, :, None, None] + 1.6 * u * np.sqrt(truths * (1 - truths))[:, :, None, None], 0, 1)
    one = rng.random((n_c, n_p, texts, 1)) < share
    y = np.where(one, rng.random((n_c, n_p, texts, 1)) < p, rng.random((n_c, n_p, texts, phases)) < p)
    return _frame(np.broadcast_to(y, (n_c, n_p, texts, phases)))


def realised(frame: pd.DataFrame) -> float:
    """The share of cells in which the candidate ``p0`` is counted within 0.03 of the best of the others."""
    means = frame.groupby(["cell", "press"]).score.mean().unstack()
    best = means.drop(columns="p0").max(axis=1)
    return float((means["p0"] >= best - NEAR - 1e-9).mean())


def truths_with(cells: int, candidate: float, ties: int, below: int, gap: float) -> np.ndarray:
    """The candidate and ``ties`` baselines at ``candidate``, ``below`` baselines ``gap`` lower."""
    t = np.full((cells, 1 + ties + below), candidate - gap)
    t[:, : 1 + ties] = candidate
    return t


SCENARIOS = [(0.8, 1, 0.15), (0.8, 4, 0.15), (0.5, 1, 0.15), (0.95, 2, 0.15), (0.8, 1, 0.4)]
"""(accuracy of the best, baselines tied with it, how far the other baselines are below); 13 baselines."""


def calibration(splits: int = 20, cells: int = 12, replicates: int = 300, seed: int = 0) -> pd.DataFrame:
    from tqdm.auto import tqdm

    rng = np.random.default_rng(seed)
    rows = []
    grid = [(model, texts, scenario) for model in ("its own (copula 0.3, 0.95)", "outside it (Beta, shared draws)")
            for texts in (8, 32) for scenario in SCENARIOS]
    for model, texts, (acc, ties, gap) in tqdm(grid, desc="calibration"):
        truths = truths_with(cells, acc, ties, 13 - ties, gap)
        seen, said, below = [], [], 0
        for r in range(splits):
            split = (copula_split(rng, truths, texts, 8, Dependence(0.3, 0.95)) if model.startswith("its")
                     else beta_split(rng, truths, texts, 8))
            ys = tied_share(split, cell=["cell"], baselines=[f"p{j}" for j in range(1, truths.shape[1])],
                            replicates=replicates, seed=r)
            seen.append(realised(split))
            said.append(ys.expected)
            below += seen[-1] < ys.low
        rows.append({"truth drawn from": model, "texts per cell": texts, "best": acc, "tied baselines": ties,
                     "others below by": gap, "tied press counted in": np.mean(seen), "yardstick": np.mean(said),
                     "yardstick - counted": np.mean(said) - np.mean(seen), "below its 5% bound": below / splits})
    return pd.DataFrame(rows)


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--cell", default=DEFAULT_CELL, help=f"the columns a cell is (default: {DEFAULT_CELL})")
    parser.add_argument("--baselines", default="all", help="all (every registered kvpress baseline answered) or a list")
    parser.add_argument("--press", default=None, help="a press whose count to show beside the yardstick")
    parser.add_argument("--replicates", type=int, default=2000)
    parser.add_argument("--calibration", action="store_true",
                        help="append the yardstick's calibration on simulated splits of known truth (minutes)")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    if args.replicates < 100:
        parser.error("--replicates must be at least 100")
    try:
        baselines = baseline_labels(args.baselines)
    except ValueError as exc:
        parser.error(str(exc))
    records = load(args.runs)
    cell = ["model"] * ("model" in records) + [c.strip() for c in args.cell.split(",")]
    missing = [c for c in cell if c not in records]
    if missing:
        parser.error(f"--cell: no column {', '.join(missing)} in the runs' answers")
    if args.press and args.press not in set(records.press):
        parser.error(f"--press {args.press!r}: not answered in these runs")
    text = report(records, cell, baselines, args.press, args.replicates)
    if args.calibration:
        table = calibration()
        text += ("\n## Calibration on simulated splits\n\n12 cells, 8 phases, 13 baselines, 20 splits per row, "
                 "300 replicates per yardstick. The yardstick takes each baseline's observed accuracy as its truth; "
                 "the observed best is the largest of several noisy means, so with few texts and several baselines "
                 "just below the best it overstates the share (a stricter target than a tied press meets).\n\n"
                 + table.to_markdown(index=False, floatfmt=".2f") + "\n")
    emit(text, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
