"""The low-ratio dev round's pre-registered rule (docs/preregistration-low-ratio.md, "Dev round" and its reading in
"Deviations"), on the round's answers: :func:`decide` returns the decision and :func:`markdown` prints it.
``python -m studies.low_ratio_dev analyse`` runs it on the four runs.

As coded:

1. **Scores** (:func:`design_scores`): a cell (model, task, context length, ratio) has the mean over its texts of
   each text's mean over its phases, both strides' texts pooled; a model's score at a ratio is the mean over its
   cells; a design's score is the mean of the models' scores (the two models weighted equally).
2. **Flat** (:func:`flat_table`): Holm's adjustment over a design's phase tests in the runs' ``summary.json`` (per
   model, task, length, ratio and stride) and, separately, over its pooled tests
   (:func:`~studies.regimes_runs.pooled_phase_tests`: per model and stride, every text a row); a design with an
   adjusted p < 0.05 in either is dropped before the picks.
3. **Bytes** (:func:`bytes_table`): from ``benchmarks/bench_press_memory.py --json`` per model, a design whose bytes
   after the prefill or at the answer's end exceed 1.05x ``chunked_stride``'s at any ratio is dropped. Without a
   file for every model the decision is provisional.
4. **Per ratio** (:func:`ratio_pick`): the highest score is the top; designs within 0.01 of it tie; the tie goes to
   G, then to the fewer settings (:func:`settings_count`), then to the design listed first (:data:`DESIGNS`).
5. **One design** if one is within 0.01 of each ratio's pick's score at every ratio (several: the tie order);
   otherwise (d) the sequence over the ratios with at most one switch (:func:`one_switch`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

import numpy as np
import pandas as pd

from kvpress_phase.evaluation.metrics import holm
from kvpress_phase.evaluation.presses import parse_press_spec

from studies.common import fmt_p
from studies.regimes_runs import cell_means, phase_tests, pooled_phase_tests

G = "global_budget:scorer=kvzap"
MATCHED = "chunked_stride"
DESIGNS = (G, "global_budget:scorer=kvzap_keydiff_25", "global_budget:scorer=kvzap_keydiff_50",
           "global_budget:scorer=kvzap_keydiff_75", "global_budget:scorer=kvzap_mlp",
           "global_budget:n_local=64:scorer=kvzap", "global_budget:n_local=256:scorer=kvzap", "phase_aware",
           "head_budget:floor=1.0")
"""The candidates and references of the pre-registration's table, in its order (the last tie-break), as the results
label them (the settings sorted: ``global_budget:scorer=kvzap:n_local=64`` is
``global_budget:n_local=64:scorer=kvzap``)."""
BASELINES = ("keydiff", "adakv", "snapkv", "kvzip_plus", "expected_attention", "pyramidkv")
"""The dev round's kvpress baselines: shown beside the designs, never picked."""
MARGIN, TOLERANCE, ALPHA, BYTES_CAP = 0.01, 1e-9, 0.05, 1.05


def settings_count(spec: str) -> int:
    """The number of settings a spec names (``phase_aware`` 0, ``global_budget:scorer=kvzap`` 1, ...)."""
    return len(parse_press_spec(spec).options)


def tie_key(design: str) -> tuple:
    """The tie order: G first, then the fewer settings, then the pre-registration's order."""
    return (design != G, settings_count(design), DESIGNS.index(design) if design in DESIGNS else len(DESIGNS))


# ----------------------------------------------------------------------------------------------------- the inputs
def design_scores(records: pd.DataFrame, presses: tuple = DESIGNS + BASELINES) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(per_model, scores)``: each press's mean over a model's compressed cells per ratio (rows model and ratio,
    a column per press, and ``cells`` the cell count), and the mean of the models' (rows ratio, a column per press)."""
    means = cell_means(records)
    means = means[(means.compression_ratio > 0) & means.press.isin(presses)]
    if means.empty:
        raise ValueError("no compressed answers of the round's designs to score")
    per_model = means.groupby(["model", "compression_ratio", "press"])["mean"].mean().unstack("press")
    per_model["cells"] = means.groupby(["model", "compression_ratio"])[["task", "context_length"]].apply(
        lambda x: len(x.drop_duplicates()))
    scores = per_model.drop(columns="cells").groupby(level="compression_ratio").mean()
    return per_model, scores


def flat_table(records: pd.DataFrame, runs: list[str], designs: tuple = DESIGNS) -> pd.DataFrame:
    """Per design: its phase tests of the finished runs' ``summary.json`` (``cell_tests``, the smallest raw and
    Holm-adjusted p) and its pooled tests (``pooled_tests``, the same), and ``fires`` (an adjusted p < 0.05)."""
    finished = [run for run in runs if os.path.exists(os.path.join(run, "summary.json"))]
    cells = phase_tests(finished) if finished else pd.DataFrame(columns=["press", "p_value"])
    pooled = pooled_phase_tests(records, presses=designs)
    rows = []
    for design in designs:
        row = {"design": design}
        for name, tests in (("cell", cells), ("pooled", pooled)):
            p = tests[tests.press == design]["p_value"].astype(float).dropna().to_numpy()
            row.update({f"{name}_tests": len(p), f"{name}_raw": float(p.min()) if len(p) else float("nan"),
                        f"{name}_adjusted": float(holm(p).min()) if len(p) else float("nan")})
        row["fires"] = bool(row["cell_adjusted"] < ALPHA or row["pooled_adjusted"] < ALPHA)
        rows.append(row)
    return pd.DataFrame(rows).set_index("design")


def read_memory(path: str) -> pd.DataFrame:
    """Rows of one ``benchmarks/bench_press_memory.py --json`` file (press, ratio, bytes_prefill, bytes_answer_end);
    ValueError naming the file when it cannot be read or is not such a file."""
    try:
        with open(path) as fh:
            rows = json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--memory {path!r} cannot be read: {exc}") from None
    frame = pd.DataFrame(rows if isinstance(rows, list) else [])
    needed = {"press", "ratio", "bytes_prefill", "bytes_answer_end"}
    if frame.empty or not needed <= set(frame.columns):
        raise ValueError(f"--memory {path!r} is not an output of benchmarks/bench_press_memory.py --json "
                         f"(rows with {', '.join(sorted(needed))})")
    frame["press"] = frame["press"].map(lambda s: parse_press_spec(s).label)
    return frame.groupby(["press", "ratio"])[["bytes_prefill", "bytes_answer_end"]].first().reset_index()


def bytes_table(memory: dict, designs: tuple = DESIGNS, ratios: tuple = (0.25, 0.5, 0.75)) -> pd.DataFrame:
    """Per model and design: the largest multiple of ``chunked_stride``'s bytes (after the prefill or at the answer's
    end) over the ratios, and ``over`` (above 1.05x, or not measured at every ratio: NaN)."""
    rows = []
    for model, frame in memory.items():
        for design in designs:
            worst = []
            for ratio in ratios:
                here = frame[np.isclose(frame.ratio, ratio)].set_index("press")
                if design not in here.index or MATCHED not in here.index:
                    worst.append(float("nan"))
                    continue
                worst.append(max(here.loc[design, col] / here.loc[MATCHED, col]
                                 for col in ("bytes_prefill", "bytes_answer_end")))
            multiple = float("nan") if any(np.isnan(worst)) else max(worst)
            rows.append({"model": model, "design": design, "multiple": multiple,
                         "over": bool(multiple > BYTES_CAP + TOLERANCE) if not np.isnan(multiple) else None})
    return pd.DataFrame(rows, columns=["model", "design", "multiple", "over"])


# ----------------------------------------------------------------------------------------------------- the rule
def ratio_pick(scores: dict, kept: list) -> tuple[str, list]:
    """One ratio's pick from ``{design: score}`` among ``kept``: the designs within 0.01 of the top tie, and the tie
    goes by :func:`tie_key`. Returns the pick and the tied designs."""
    top = max(scores[d] for d in kept)
    tied = [d for d in kept if scores[d] >= top - MARGIN - TOLERANCE]
    return min(tied, key=tie_key), tied


def switches(sequence: list) -> int:
    return sum(a != b for a, b in zip(sequence, sequence[1:]))


def one_switch(picks: list, scores: pd.DataFrame, ratios: list) -> list:
    """(d): of the sequences over ``ratios`` (ascending) with at most one switch, made of the ratios' ``picks``, the
    one that keeps the pick at the most ratios; then the highest summed score; then the fewer switches; then the tie
    order ratio by ratio from the lowest."""
    allowed, n = list(dict.fromkeys(picks)), len(ratios)
    options = {tuple([a] * k + [b] * (n - k)) for a in allowed for b in allowed for k in range(1, n + 1)}

    def key(seq):
        agree = sum(x == y for x, y in zip(seq, picks))
        total = sum(scores.loc[r, d] for r, d in zip(ratios, seq))
        return (-agree, -round(total, 9), switches(list(seq)), tuple(tie_key(d) for d in seq))

    return list(min(options, key=key))


@dataclasses.dataclass
class Decision:
    ratios: list
    kept: list
    dropped: dict
    """``{design: why}`` for the designs the flat and bytes checks drop."""
    picks: dict
    tied: dict
    holds: list
    """The designs within 0.01 of each ratio's pick at every ratio."""
    sequence: list
    provisional: Optional[str] = None

    @property
    def single(self) -> bool:
        return len(set(self.sequence)) == 1


def decide(scores: pd.DataFrame, flat: Optional[pd.DataFrame] = None, nbytes: Optional[pd.DataFrame] = None,
           designs: tuple = DESIGNS, provisional: Optional[str] = None) -> Decision:
    """The rule on ``scores`` (rows ratio, a column per design), after dropping the designs ``flat`` (its ``fires``)
    and ``nbytes`` (its ``over``) drop. ValueError when no design is left or a design has no score."""
    missing = [d for d in designs if d not in scores.columns or scores[d].isna().any()]
    if missing:
        raise ValueError(f"designs without a score at every ratio: {', '.join(missing)}")
    dropped = {}
    if flat is not None:
        for design in designs:
            if design in flat.index and flat.loc[design, "fires"]:
                p = min(flat.loc[design, "cell_adjusted"], flat.loc[design, "pooled_adjusted"])
                dropped[design] = f"not flat (Holm p {fmt_p(p)})"
    if nbytes is not None and len(nbytes):
        for row in nbytes[nbytes.over.fillna(False).astype(bool)].itertuples():
            dropped.setdefault(row.design, f"bytes {row.multiple:.3f}x chunked_stride's on {row.model}")
    kept = [d for d in designs if d not in dropped]
    if not kept:
        raise ValueError("every design is dropped by the flat or bytes checks")
    ratios = sorted(scores.index)
    picks, tied = {}, {}
    for ratio in ratios:
        picks[ratio], tied[ratio] = ratio_pick(scores.loc[ratio].to_dict(), kept)
    holds = [d for d in kept
             if all(scores.loc[r, d] >= scores.loc[r, picks[r]] - MARGIN - TOLERANCE for r in ratios)]
    if holds:
        sequence = [min(holds, key=tie_key)] * len(ratios)
    else:
        sequence = one_switch([picks[r] for r in ratios], scores, ratios)
    return Decision(ratios, kept, dropped, picks, tied, holds, sequence, provisional)


def paired_to_pick(records: pd.DataFrame, decision: "Decision", designs: tuple = DESIGNS) -> pd.DataFrame:
    """What the round can tell apart: per ratio and design, its score minus the ratio's pick's, computed from the
    paired differences by text (a text: model, task, length, stride and sample; its value the mean over its phases),
    with a 95% normal interval that treats the texts of a cell as independent (a cell's variance: its texts'
    variance / their count; a model's: the sum over its cells / cells squared; the score's: the sum over the models
    / models squared)."""
    from scipy import stats

    keys = ["model", "task", "context_length", "compression_ratio", "stride", "sample_id"]
    compressed = records[(records.compression_ratio > 0) & records.press.isin(designs)]
    per_text = compressed.groupby(keys + ["press"])["score"].mean().unstack("press")
    z = stats.norm.ppf(0.975)
    rows = []
    for ratio in decision.ratios:
        here = per_text.xs(ratio, level="compression_ratio")
        pick = decision.picks[ratio]
        for design in designs:
            d = (here[design] - here[pick]).dropna()
            cells = d.groupby(level=["model", "task", "context_length"]).agg(["mean", "var", "size"])
            cells["var_mean"] = cells["var"].fillna(0.0) / cells["size"]
            models = cells.groupby(level="model").agg(mean=("mean", "mean"), var=("var_mean", "sum"),
                                                      n=("mean", "size"))
            diff = models["mean"].mean()
            se = float(np.sqrt((models["var"] / models["n"] ** 2).sum()) / len(models))
            rows.append({"ratio": ratio, "design": design, "diff": diff, "low": diff - z * se,
                         "high": diff + z * se, "texts": len(d)})
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------------------------------- the page
def _score_table(per_model: pd.DataFrame, scores: pd.DataFrame, decision: Decision, presses: tuple) -> list[str]:
    models = list(dict.fromkeys(per_model.index.get_level_values("model")))
    lines = ["| ratio | press | " + " | ".join(f"{m}" for m in models) + " | score | |",
             "|---|---|" + "---|" * len(models) + "---|---|"]
    for ratio in decision.ratios:
        for press in presses:
            if press not in scores.columns:
                continue
            cells = " | ".join(f"{per_model.loc[(m, ratio), press]:.3f}" if (m, ratio) in per_model.index else "-"
                               for m in models)
            mark = ("**pick**" if decision.picks[ratio] == press else "tie" if press in decision.tied[ratio] else
                    "dropped" if press in decision.dropped else "baseline" if press in BASELINES else "")
            lines.append(f"| {ratio:g} | `{press}` | {cells} | {scores.loc[ratio, press]:.3f} | {mark} |")
    return lines


def markdown(per_model: pd.DataFrame, scores: pd.DataFrame, flat: pd.DataFrame, nbytes: pd.DataFrame,
             decision: Decision, answers: str, paired: Optional[pd.DataFrame] = None) -> str:
    lines = ["## The low-ratio dev round's decision", "", answers, ""]
    if decision.provisional:
        lines += [f"**Provisional: {decision.provisional}.**", ""]
    counts = ", ".join(f"{m} {int(per_model.loc[(m, r), 'cells'])}" for m, r in per_model.index
                       if r == decision.ratios[0])
    lines += ["### Scores", "", f"Mean accuracy over a model's dev cells (cells per ratio: {counts}); the score is the "
              "two models' mean. Designs within 0.01 of a ratio's top tie; the tie goes to G, then to the fewer "
              "settings, then to the pre-registration's order. Baselines are shown, never picked.", ""]
    lines += _score_table(per_model, scores, decision, DESIGNS + BASELINES)
    if paired is not None and len(paired):
        lines += ["", "### What the round can tell apart", "",
                  "Each design's score minus the ratio's pick's, from the paired differences by text, with a 95% "
                  "interval (normal; the texts of a cell independent). The rule decides on the scores alone; an "
                  "interval that spans 0 says the dev round cannot tell the two apart.", "",
                  "| ratio | design | texts | minus the pick | 95% interval |", "|---|---|---|---|---|"]
        for r in paired[paired.design != paired.ratio.map(decision.picks)].itertuples():
            lines.append(f"| {r.ratio:g} | `{r.design}` | {r.texts} | {r.diff:+.3f} | {r.low:+.3f} to {r.high:+.3f} |")
    lines += ["", "### Flat (Holm, family-wise 0.05)", "",
              "| design | cell tests | smallest p | Holm | pooled tests | smallest p | Holm | dropped |",
              "|---|---|---|---|---|---|---|---|"]
    for design, r in flat.iterrows():
        lines.append(f"| `{design}` | {r.cell_tests} | {fmt_p(r.cell_raw)} | {fmt_p(r.cell_adjusted)} | "
                     f"{r.pooled_tests} | {fmt_p(r.pooled_raw)} | {fmt_p(r.pooled_adjusted)} | "
                     f"{'yes' if r.fires else 'no'} |")
    lines += ["", "### Bytes (largest multiple of `chunked_stride`'s over the ratios; cap 1.05)", ""]
    if nbytes is None or not len(nbytes):
        lines.append("Not measured yet.")
    else:
        lines += ["| model | design | multiple | dropped |", "|---|---|---|---|"]
        for r in nbytes.itertuples():
            over = "not measured" if r.over is None else "yes" if r.over else "no"
            lines.append(f"| {r.model} | `{r.design}` | {r.multiple:.3f} | {over} |")
    lines += ["", "### Decision", ""]
    for design, why in decision.dropped.items():
        lines.append(f"- `{design}` dropped: {why}.")
    for ratio in decision.ratios:
        tied = ", ".join(f"`{d}`" for d in decision.tied[ratio])
        lines.append(f"- ratio {ratio:g}: pick `{decision.picks[ratio]}` (tied within 0.01: {tied}).")
    if decision.single:
        holds = ", ".join(f"`{d}`" for d in decision.holds)
        lines.append(f"- Within 0.01 of each ratio's pick at every ratio: {holds}. "
                     f"**Recommendation at every ratio: `{decision.sequence[0]}`.**")
    else:
        steps = ", ".join(f"`{d}` at {r:g}" for r, d in zip(decision.ratios, decision.sequence))
        at = next(i for i in range(len(decision.sequence) - 1) if decision.sequence[i] != decision.sequence[i + 1])
        point = (decision.ratios[at] + decision.ratios[at + 1]) / 2
        lines.append(f"- No design is within 0.01 of each ratio's pick at every ratio: (d), one entry with one switch "
                     f"point: **{steps}**; it switches at ratio {point:g} (the midpoint of the two dev ratios).")
    return "\n".join(lines) + "\n"
