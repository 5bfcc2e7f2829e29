"""The ratio-regimes dev round's pre-registered decision rule (docs/preregistration-ratio-regimes.md, rules 1-6) on
the complete round: :func:`decide` (rules 1-5, as Markdown) and :func:`mechanisms_markdown` (rule 6), with what they
are made of (:func:`with_best`, :func:`holm_tests`, :func:`rule3_scores`, :class:`Ranking`, :func:`pick`,
:func:`one_switch`, :func:`recommendation_text`). :mod:`studies.regimes` prints them once every planned run holds
every answer it plans; the runs, the means and the costs they read come from :mod:`studies.regimes_runs`.

The rules as coded (:func:`decide`):

1. Flat: Holm's adjustment (:func:`~kvpress_phase.evaluation.metrics.holm`) over each press's phase tests in every
   run's ``summary.json`` (per model, cell and stride: 144 tests), family-wise 0.05; a candidate with any adjusted
   p < 0.05 is dropped. And (deviation 2) Holm's adjustment over its pooled tests
   (:func:`~.regimes_runs.pooled_phase_tests`: per model and stride, every text of the round a row; 4 tests),
   family-wise 0.05: any adjusted p < 0.05 drops it too.
2. Cost and bytes, per model: a compress step above 0.1 prefills, or stored bytes above 1.05x ``chunked_stride``'s,
   drops a candidate; T is dropped as well when its mean cache length over the dev answers is above 1.05x G's
   over the same examples (:func:`~.regimes_runs.entry_shares`). A drop on either model drops the candidate.
3. Per ratio: a candidate's score is the count of that ratio's 24 dev cells where its mean is >= the best baseline's
   - 0.03 (tolerance 1e-9); candidates within one cell of the top score tie, and the tie goes to the lower bytes
   (the multiple of ``chunked_stride``'s, mean over the models), then the lower cost (prefills, mean over the
   models), then the fewer wrappers (then the pre-registration's order). Candidates: G, G with floors, T,
   ``phase_aware``, ``layer_budget:scorer=kvzap``.
4. A candidate within 2 cells of the top at every ratio is the recommendation at every ratio (several:
   :data:`ONE_SWITCH_RULE`); otherwise rule 3's pick per ratio, resolved to at most one switch point as
   :data:`ONE_SWITCH_RULE` says.
5. T replaces G at a ratio where G is recommended and T's score is within one cell of G's; where G scores more,
   G stays and T's cost in cells and mean accuracy is printed.
6. Every mechanism's score per ratio (:func:`mechanisms_markdown`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd

from kvpress_phase.evaluation.metrics import holm
from kvpress_phase.evaluation.presses import REGISTRY, parse_press_spec

from studies.common import fmt_p
from studies.regimes_runs import (CANDIDATES, CELL, DEV, G, G_FLOOR, MATCHED, OURS, REFERENCE, SHARE_HEADS, D, Design,
                                  T, best_baselines)

NEAR, TOLERANCE = 0.03, 1e-9
ALPHA = 0.05
COST_CAP, BYTES_CAP, ENTRIES_CAP = 0.1, 1.05, 1.05
TIE_CELLS, ONE_PRESS_CELLS = 1, 2


# ----------------------------------------------------------------------------------------------------- the rules
def with_best(means: pd.DataFrame, best: pd.DataFrame) -> pd.DataFrame:
    """``means`` of the compressed cells with the cell's best baseline, the difference to it and whether the press
    is within 0.03 of it (``near``)."""
    out = means[means.compression_ratio > 0].join(best, on=CELL, how="inner")
    out["diff"] = out["mean"] - out["best_mean"]
    out["near"] = out["mean"] >= out["best_mean"] - NEAR - TOLERANCE
    return out


def holm_tests(tests: pd.DataFrame, press: str) -> dict:
    """Rule 1 for ``press``: Holm's adjustment over its phase tests (every model, cell and stride with a p-value)."""
    p = tests[tests.press == press]["p_value"].astype(float).dropna().to_numpy()
    if not len(p):
        return {"n": 0, "raw": float("nan"), "adjusted": float("nan"), "fires": False}
    adjusted = holm(p)
    return {"n": len(p), "raw": float(p.min()), "adjusted": float(adjusted.min()),
            "fires": bool((adjusted < ALPHA).any())}


def rule3_scores(means: pd.DataFrame, best: pd.DataFrame, presses: tuple, design: Design = DEV) -> pd.DataFrame:
    """Per ratio and press: the dev cells of that ratio (both models) where the press's mean is at least the best
    baseline's - 0.03 (``within``), of ``cells``; and its mean difference to the best baseline over them."""
    joined = with_best(means[means.press.isin(presses)], best)
    rows = []
    for ratio in design.ratios:
        for press in presses:
            part = joined[(joined.compression_ratio == ratio) & (joined.press == press)]
            rows.append({"ratio": ratio, "press": press, "within": int(part["near"].sum()), "cells": len(part),
                         "diff": part["diff"].mean() if len(part) else float("nan")})
    return pd.DataFrame(rows)


def wrappers(label: str) -> int:
    """How many wrappers a press of ours has around its ``PhaseAwarePress`` (a budget wrapper: one)."""
    return int(getattr(REGISTRY[parse_press_spec(label).name], "wraps", None) is not None)


@dataclasses.dataclass
class Ranking:
    """What rule 3 breaks ties with, per candidate: bytes as a multiple of ``chunked_stride``'s and cost in prefills
    (each the mean over the models), and wrappers."""

    bytes: dict
    cost: dict

    def key(self, press: str) -> tuple:
        return (round(self.bytes[press], 4), round(self.cost[press], 4), wrappers(press), CANDIDATES.index(press))

    def describe(self, press: str) -> str:
        return (f"{self.bytes[press]:.3f}x bytes, {self.cost[press]:.3f} prefills, {wrappers(press)} "
                f"wrapper{'s' if wrappers(press) != 1 else ''}")


def pick(scores: dict, kept: list, ranking: Ranking) -> tuple[str, list]:
    """Rule 3's pick among ``kept`` from ``{press: cells within}``: the most cells; candidates within one cell of
    the most tie, and the tie goes to the lower bytes, then the lower cost, then the fewer wrappers (then the
    pre-registration's order). Returns the pick and the tied candidates."""
    top = max(scores[p] for p in kept)
    tied = [p for p in kept if scores[p] >= top - TIE_CELLS]
    return min(tied, key=ranking.key), tied


def switches(sequence: list) -> int:
    return sum(a != b for a, b in zip(sequence, sequence[1:]))


def one_switch(desired: list, allowed: list, within: dict, ratios: tuple, ranking: Ranking) -> list:
    """The sequence of presses over ``ratios`` (ascending) with at most one switch point, from ``allowed``, that
    keeps ``desired``'s press at the most ratios; then the one with the most cells within 0.03 summed over the
    ratios; then the fewer switches; then, ratio by ratio from the lowest, rule 3's tie order."""
    n = len(ratios)
    options = {tuple([a] * k + [b] * (n - k)) for a in allowed for b in allowed for k in range(1, n + 1)}

    def score(seq):
        agree = sum(x == y for x, y in zip(seq, desired))
        cells = sum(within[r][p] for r, p in zip(ratios, seq))
        return (-agree, -cells, switches(list(seq)), tuple(ranking.key(p) for p in seq))

    return list(min(options, key=score))


ONE_SWITCH_RULE = (
    "Several candidates within 2 cells of the best at every ratio: the one that is rule 3's pick at the most ratios, "
    "and among those rule 3's pick over the round's cells together (the most cells over every ratio; within one cell, "
    "a tie to the lower bytes, cost, wrappers). Rule 3's picks that switch more than once (a non-monotone pick, or "
    "three presses over three ratios): the recommendation is the sequence over the ratios, ascending, with at most "
    "one switch point and only rule 3's picks in it, that keeps rule 3's pick at the most ratios; then the one with "
    "the most cells within 0.03 summed over the ratios; then the fewer switches; then rule 3's tie order (bytes, "
    "cost, wrappers) ratio by ratio from the lowest. Rule 5 resolves T in G's place the same way, with T added.")
"""How rule 4 is read where the pre-registration leaves a choice (printed with the decision)."""


def recommendation_text(sequence: list, ratios: tuple) -> str:
    if switches(sequence) > 1:
        raise ValueError(f"a recommendation switches at most once over the ratios, not {sequence}")
    if len(set(sequence)) == 1:
        return f"`{sequence[0]}` at every ratio"
    k = next(i for i in range(1, len(sequence)) if sequence[i] != sequence[i - 1])
    low, high = ", ".join(f"{r:g}" for r in ratios[:k]), ", ".join(f"{r:g}" for r in ratios[k:])
    return (f"`{sequence[0]}` below ratio {ratios[k]:g} (ratios {low}), `{sequence[k]}` from ratio {ratios[k]:g} "
            f"(ratios {high})")


def decide(means: pd.DataFrame, tests: pd.DataFrame, pooled: pd.DataFrame, costs: dict, shares: pd.DataFrame,
           design: Design = DEV) -> str:
    """The pre-registered decision (rules 1-5), as Markdown, on the complete round: ``means`` from
    :func:`~.regimes_runs.cell_means`, ``tests`` from :func:`~.regimes_runs.phase_tests`, ``pooled`` from
    :func:`~.regimes_runs.pooled_phase_tests`, ``costs`` from
    :func:`~.regimes_runs.read_costs` (every model), ``shares`` from :func:`~.regimes_runs.entry_shares` (T against
    G). ValueError when a model's cost of a candidate or of ``chunked_stride`` is not measured."""
    best = best_baselines(means)
    per_model = len(design.settings) * len(design.tasks) * len(design.lengths) * len(design.ratios)
    lines = ["#### Rule 1: flat", "",
             f"Holm's correction over each press's phase tests in the dev round (per model, cell and stride; "
             f"{len(design.models)} x {per_model} x {len(design.stride_seeds)} tests planned), family-wise {ALPHA}; "
             f"and (deviation 2) over its pooled tests (per model and stride, every text a row; "
             f"{len(design.models) * len(design.stride_seeds)} tests), family-wise {ALPHA}. Either firing drops a "
             "candidate.", "",
             "| press | tests per cell | smallest p | smallest Holm-adjusted p | pooled tests (texts) | smallest p | "
             "smallest Holm-adjusted p | rule 1 |", "|---|---|---|---|---|---|---|---|"]
    dropped = {}
    for press in OURS:
        h, g = holm_tests(tests, press), holm_tests(pooled, press)
        role = "" if press in CANDIDATES else " (reported; not a rule-3 candidate)"
        fires = h["fires"] or g["fires"]
        verdict = "**fires: dropped**" if fires else "flat"
        if fires and press in CANDIDATES:
            which = [f"{what} (smallest adjusted p {fmt_p(r['adjusted'])} over {r['n']} tests)"
                     for what, r in (("per cell", h), ("pooled", g)) if r["fires"]]
            dropped[press] = "rule 1: its phase tests fire after Holm's correction, " + " and ".join(which)
        texts = int(pooled[pooled.press == press]["texts"].sum()) if len(pooled) else 0
        lines.append(f"| `{press}`{role} | {h['n']} | {fmt_p(h['raw'])} | {fmt_p(h['adjusted'])} | "
                     f"{g['n']} ({texts:,}) | {fmt_p(g['raw'])} | {fmt_p(g['adjusted'])} | "
                     f"{verdict if press in CANDIDATES else verdict.replace(': dropped', '')} |")

    lines += ["", "#### Rule 2: cost and bytes", "",
              f"A compress step above {COST_CAP} prefills, stored bytes above {BYTES_CAP}x `{MATCHED}`'s (the ragged "
              f"figure for ours), or (T) a mean share of entries kept above {ENTRIES_CAP}x G's over the dev answers, "
              "drops a candidate (on either model).", "",
              "| press | model | compress step (prefills) | bytes (MiB) | x chunked_stride | entries x G's | rule 2 |",
              "|---|---|---|---|---|---|---|"]
    multiple = {model: {} for model in design.models}
    prefills = {model: {} for model in design.models}
    for model in design.models:
        table = costs.get(model)
        if table is None:
            raise ValueError(f"the cost of {model} is not measured: give --cost {model}=FILE")
        for press in (MATCHED,) + CANDIDATES:
            if press not in table:
                raise ValueError(f"--cost for {model} has no row for `{press}`: measure it with "
                                 "benchmarks/bench_compress_cost.py")
        for press in CANDIDATES:
            multiple[model][press] = table[press]["bytes"] / table[MATCHED]["bytes"]
            prefills[model][press] = table[press]["prefills"]
    share = {}
    if len(shares):
        overall = shares[shares.ratio == "all"].set_index("model")["multiple"]
        share = {model: float(overall[model]) for model in overall.index}
    for press in CANDIDATES:
        for model in design.models:
            why = []
            if prefills[model][press] > COST_CAP:
                why.append(f"{prefills[model][press]:.3f} prefills > {COST_CAP}")
            if multiple[model][press] > BYTES_CAP + TOLERANCE:
                why.append(f"{multiple[model][press]:.3f}x bytes > {BYTES_CAP}x")
            entries = "-"
            if press == T:
                if model not in share:
                    raise ValueError(f"no answers of both `{T}` and `{G}` on {model}: the entries they keep cannot "
                                     "be compared")
                entries = f"{share[model]:.3f}x"
                if share[model] > ENTRIES_CAP + TOLERANCE:
                    why.append(f"{share[model]:.3f}x G's entries > {ENTRIES_CAP}x")
            if why and press not in dropped:
                dropped[press] = f"rule 2 ({model}): " + ", ".join(why)
            lines.append(f"| `{press}` | {model} | {prefills[model][press]:.3f} | "
                         f"{costs[model][press]['bytes']:.2f} | {multiple[model][press]:.3f}x | {entries} | "
                         f"{'**dropped**: ' + ', '.join(why) if why else 'kept'} |")
    ranking = Ranking(bytes={p: float(np.mean([multiple[m][p] for m in design.models])) for p in CANDIDATES},
                      cost={p: float(np.mean([prefills[m][p] for m in design.models])) for p in CANDIDATES})
    kept = [p for p in CANDIDATES if p not in dropped]
    for press, why in dropped.items():
        lines.append(f"\n`{press}` is dropped by {why}.")

    scores = rule3_scores(means, best, CANDIDATES, design)
    within = {r: dict(zip(part.press, part.within)) for r, part in scores.groupby("ratio")}
    n_cells = design.cells_per_ratio()
    lines += ["", "#### Rule 3: per ratio", "",
              f"A candidate's score at a ratio: the dev cells of that ratio, both models together ({n_cells}), where "
              f"its mean is at least the best baseline's - {NEAR}. Candidates within {TIE_CELLS} cell of the most "
              "tie; a tie goes to the lower bytes (the multiple of `chunked_stride`'s, mean over the models), then "
              "the lower cost (prefills, mean over the models), then the fewer wrappers.", "",
              "| candidate | " + " | ".join(f"ratio {r:g}" for r in design.ratios) + " | bytes, cost, wrappers | "
              "status |", "|---|" + "---|" * (len(design.ratios) + 2)]
    for press in CANDIDATES:
        cells = []
        for ratio in design.ratios:
            row = scores[(scores.ratio == ratio) & (scores.press == press)].iloc[0]
            cells.append(f"{row.within}/{row.cells} ({'-' if np.isnan(row['diff']) else format(row['diff'], '+.3f')})")
        status = "dropped" if press in dropped else "kept"
        lines.append(f"| `{press}` | " + " | ".join(cells) + f" | {ranking.describe(press)} | {status} |")
    lines.append("\n(k/N: cells within 0.03 of the best baseline; in brackets the mean difference to it over the "
                 "ratio's cells.)")
    if not kept:
        lines += ["", "**No candidate survives rules 1 and 2: no recommendation.**"]
        return "\n".join(lines)
    picks = {}
    for ratio in design.ratios:
        chosen, tied = pick(within[ratio], kept, ranking)
        picks[ratio] = chosen
        note = "" if len(tied) == 1 else " (tied within one cell: " + ", ".join(
            f"`{p}` {within[ratio][p]}" for p in tied) + f"; to `{chosen}` by {ranking.describe(chosen)})"
        lines.append(f"- ratio {ratio:g}: `{chosen}` ({within[ratio][chosen]}/{n_cells}){note}")

    lines += ["", "#### Rule 4: one press if it holds", "", ONE_SWITCH_RULE, ""]
    tops = {r: max(within[r][p] for p in kept) for r in design.ratios}
    holds = [p for p in kept if all(within[r][p] >= tops[r] - ONE_PRESS_CELLS for r in design.ratios)]
    for press in kept:
        gaps = ", ".join(f"{within[r][press] - tops[r]:+d} at {r:g}" for r in design.ratios)
        lines.append(f"- `{press}`: {gaps} (cells against the best at each ratio)")
    if holds:
        picked = {p: sum(picks[r] == p for r in design.ratios) for p in holds}
        finalists = [p for p in holds if picked[p] == max(picked.values())]
        totals = {p: sum(within[r][p] for r in design.ratios) for p in finalists}
        one, _ = pick(totals, finalists, ranking)
        sequence = [one] * len(design.ratios)
        why = (f"\n`{one}` is within {ONE_PRESS_CELLS} cells of the best at every ratio: the recommendation at every "
               "ratio.")
        if len(holds) > 1:
            why += (" Several candidates hold (" + ", ".join(
                f"`{p}`: rule 3's pick at {picked[p]} ratio{'s' if picked[p] != 1 else ''}, "
                f"{sum(within[r][p] for r in design.ratios)} cells in all" for p in holds) + "); the one taken is "
                "rule 3's pick at the most ratios, and among those rule 3's pick over the round's cells together "
                "(the most cells over every ratio; within one cell, a tie to the lower bytes, cost, wrappers).")
        lines.append(why)
    else:
        sequence = [picks[r] for r in design.ratios]
        lines.append(f"\nNo candidate is within {ONE_PRESS_CELLS} cells of the best at every ratio: the "
                     "recommendation is rule 3's pick per ratio, with at most one switch point.")
        if switches(sequence) > 1:
            resolved = one_switch(sequence, sorted(set(sequence), key=CANDIDATES.index), within, design.ratios,
                                  ranking)
            lines.append(f"Rule 3's picks ({', '.join(f'`{p}`' for p in sequence)}) switch more than once; "
                         f"resolved as stated above: {', '.join(f'`{p}`' for p in resolved)}.")
            sequence = resolved

    lines += ["", "#### Rule 5: T against G", ""]
    if G in sequence and T in kept:
        desired = []
        for ratio, press in zip(design.ratios, sequence):
            if press == G and within[ratio][T] >= within[ratio][G] - TIE_CELLS:
                desired.append(T)
                lines.append(f"- ratio {ratio:g}: T ties G ({within[ratio][T]} and {within[ratio][G]} cells): T "
                             "replaces G (its prefill does not hold the whole uncompressed cache).")
            else:
                desired.append(press)
                if press == G:
                    lost = scores[(scores.ratio == ratio) & (scores.press == T)]["diff"].iloc[0] - \
                        scores[(scores.ratio == ratio) & (scores.press == G)]["diff"].iloc[0]
                    lines.append(f"- ratio {ratio:g}: G scores higher ({within[ratio][G]} cells against T's "
                                 f"{within[ratio][T]}): G stays; T costs {within[ratio][G] - within[ratio][T]} cells "
                                 f"within 0.03 and {lost:+.3f} in mean accuracy over the ratio's cells.")
        if switches(desired) > 1:
            resolved = one_switch(desired, sorted(set(sequence) | {T}, key=CANDIDATES.index), within, design.ratios,
                                  ranking)
            lines.append(f"T in G's place where they tie ({', '.join(f'`{p}`' for p in desired)}) switches more "
                         "than once; resolved as rule 4 resolves it: " + ", ".join(f"`{p}`" for p in resolved) + ".")
            desired = resolved
        sequence = desired
    elif G in sequence:
        lines.append(f"- T was dropped ({dropped.get(T, 'not kept')}): G stays wherever it is recommended.")
    else:
        lines.append("- G is not recommended at any ratio: rule 5 does not apply.")

    lines += ["", f"**Recommendation: {recommendation_text(sequence, design.ratios)}.**", "",
              split_commands(sequence, design.ratios, design.models)]
    return "\n".join(lines)


def split_commands(sequence: list, ratios: tuple, models: tuple) -> str:
    """What follows the decision: the fresh split's command for the frozen press spec(s) and the reading's
    ``--recommend`` value (:func:`studies.regimes_split.parse_recommendation`), with the committed cost tables
    (``docs/results/regimes/cost-MODEL.md``)."""
    specs = ",".join(dict.fromkeys(sequence))
    recommend = sequence[0] if len(set(sequence)) == 1 else ",".join(f"{r:g}={p}" for r, p in zip(ratios, sequence))
    costs = " ".join(f"--cost {m}=docs/results/regimes/cost-{m}.md" for m in models)
    return ("Next, once a \"Frozen configuration\" naming these specs is committed: the fresh split, "
            f"`bash studies/run_regimes_split.sh {specs}`, read with `python -m studies.regimes_split "
            f"outputs/regimes-test/*/* --dev outputs/regimes-dev/*/* --recommend {recommend} {costs} "
            "--output docs/results/regimes/test-tables.md`.")


def mechanisms_markdown(means: pd.DataFrame, design: Design = DEV) -> str:
    """Rule 6: what each mechanism scored, whatever the rule picks."""
    best = best_baselines(means)
    groups = [("scores", REFERENCE, "KeyDiff's scores, the same count per layer (frozen)"),
              ("scores", "kvzap", "kvpress's KVzapPress: learned scores, the same count per head"),
              ("allocation", D, "D: learned scores, the budget spread over layers"),
              ("allocation", G, "G: learned scores, over layers and KV heads (exact global choice)"),
              ("allocation", T, "T: G's budget decided layer by layer by a calibrated threshold"),
              ("allocation", G_FLOOR, "G with per-head floors (a quarter of the even budget)"),
              ("allocation", SHARE_HEADS, "KeyDiff, each KV head its own tokens, the same count per head"),
              ("kvpress's learned scores", "dms_kvzap", "kvpress's DMSPress(KVzapPress), calibrated threshold"),
              ("kvpress's learned scores", "adakv", "kvpress's AdaKVPress(KeyDiffPress): per-head budgets")]
    presses = tuple(p for _, p, _ in groups)
    scores = rule3_scores(means, best, presses, design)
    lines = ["| mechanism | press | what it is | " + " | ".join(f"ratio {r:g}" for r in design.ratios) + " |",
             "|---|---|---|" + "---|" * len(design.ratios)]
    for group, press, what in groups:
        cells = []
        for ratio in design.ratios:
            row = scores[(scores.ratio == ratio) & (scores.press == press)].iloc[0]
            cells.append("-" if not row.cells else f"{row.within}/{row.cells} ({row['diff']:+.3f})")
        lines.append(f"| {group} | `{press}` | {what} | " + " | ".join(cells) + " |")
    lines += ["", "k/N: the ratio's dev cells (both models) within 0.03 of the best baseline; in brackets the mean "
              "difference to it. A baseline's own cells count against the best of all 14, itself included."]
    return "\n".join(lines)
