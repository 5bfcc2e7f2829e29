"""The ratio-regimes fresh test split (docs/preregistration-ratio-regimes.md): the target per model, read beside
its yardstick (deviation 3), and the ``share_heads`` rule.

    python -m studies.regimes_split outputs/regimes-test/smollm2/* outputs/regimes-test/qwen2.5-coder-0.5b/* \\
        --dev outputs/regimes-dev/*/* --recommend 0.25=SPEC,0.5=SPEC,0.75=SPEC \\
        --cost smollm2=FILE --cost qwen2.5-coder-0.5b=FILE --output docs/results/regimes/test-tables.md

``--recommend`` is the frozen configuration's press per ratio (one spec for every ratio when it is one press).
A *cell* of the split is (model, setting, task, context length, stride, ratio); a text is one sample of one
stride, its value its mean over the phases, and a cell's mean is over its texts. It first lists the split's 8
planned runs (model x setting x length) with the answers each holds, then per model writes:

1. the target, cell by cell: the recommendation's mean, its phase test (the evaluation's permutation test, p >= 0.05
   and after Holm's correction over the model's cells), the best of every registered kvpress baseline in the cell
   and whether the recommendation is within 0.03 of it; then the share of cells (target: 80%), the bytes and the
   compress cost (``--cost``: <= 1.05x ``chunked_stride``'s bytes, <= 0.1 prefills), met or missed;
2. the yardstick of deviation 3: (a) the share within 0.03 of the baseline that was best in the dev round's matching
   cell (model, setting, task, length, ratio), (b) per ratio the paired difference by text to that baseline with its
   95% t interval, (c) the share a press that ties the split's best baseline would reach in these cells
   (:func:`studies.regimes_null.counted_share` at each cell's size and best accuracy, the baselines within 0.03 of
   the best counted as tied);
3. the ``share_heads`` rule: ``head_budget:floor=1.0`` minus ``phase_aware`` pooled by text
   (:func:`studies.common.paired_pooled`), lower bound above 0, and no phase effect after Holm's correction, on both
   models;
4. every press of ours the split answered, reported whatever the recommendation (the dev round's rule 6 applied to
   the split; it decides nothing): per model and ratio, its cells within 0.03 of the best baseline, its mean
   difference to that baseline over the cells, and its difference to the recommendation pooled by text.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

import numpy as np
import pandas as pd
from scipy import stats

from kvpress_phase.evaluation.config import SETTINGS
from kvpress_phase.evaluation.metrics import complete_rows, holm, permutation_p_value, phase_matrix
from kvpress_phase.evaluation.presses import parse_press_spec

from studies.common import emit, fmt_p, load, load_runs, paired_pooled
from studies.regimes_null import counted_share
from studies.regimes_runs import (BASELINES, DEV, MATCHED, OURS, REFERENCE, SETTING_NAMES, SHARE_HEADS,
                                  best_baselines, cell_means, read_costs, text_means)
from studies.regimes_rules import ALPHA, BYTES_CAP, COST_CAP, NEAR, TOLERANCE

SPLIT_CELL = ["model", "setting", "task", "context_length", "stride", "compression_ratio"]
DEV_CELL = ["model", "setting", "task", "context_length", "compression_ratio"]
TARGET_SHARE = 0.8


def parse_recommendation(spec: str, ratios: tuple = DEV.ratios) -> dict:
    """``0.25=SPEC,0.5=SPEC,...`` (or one SPEC for every ratio) as {ratio: press label}. ValueError naming what is
    wrong: a ratio the split does not run, a ratio missing, a press that is not one of ours."""
    spec = spec.strip()
    if not spec:
        raise ValueError("--recommend is empty: give RATIO=SPEC for every ratio, or one SPEC")
    if "=" not in spec.split(",")[0].split(":")[0]:
        label = parse_press_spec(spec).label
        out = {r: label for r in ratios}
    else:
        out = {}
        for item in (x.strip() for x in spec.split(",") if x.strip()):
            ratio, sep, press = item.partition("=")
            try:
                r = float(ratio)
            except ValueError:
                raise ValueError(f"--recommend {item!r}: {ratio!r} is not a ratio") from None
            if r not in ratios:
                raise ValueError(f"--recommend {item!r}: the split runs ratios {', '.join(f'{x:g}' for x in ratios)}")
            out[r] = parse_press_spec(press).label
        missing = [r for r in ratios if r not in out]
        if missing:
            raise ValueError(f"--recommend names no press for ratio {', '.join(f'{r:g}' for r in missing)}")
    for label in set(out.values()):
        if label in BASELINES or label == "no_press":
            raise ValueError(f"--recommend {label!r} is not a press of ours")
    return out


def phase_p(records: pd.DataFrame, press: str) -> pd.Series:
    """The permutation phase test of ``press`` in every split cell it answered."""
    out = {}
    part = records[(records.press == press) & (records.compression_ratio > 0)]
    for key, block in part.groupby(SPLIT_CELL):
        matrix, present = phase_matrix(block, int(key[4]))
        out[key] = permutation_p_value(complete_rows(matrix, present))
    return pd.Series(out, dtype=float)


def cell_table(records: pd.DataFrame, dev_best: pd.DataFrame, recommend: dict, cells: int = 2000,
               seed: int = 0) -> pd.DataFrame:
    """One row per split cell: the recommendation's mean and phase p, the split's best baseline, the dev-chosen
    baseline's mean in the split, and what a tied press would reach there."""
    texts = text_means(records)
    means = texts.groupby(level=SPLIT_CELL).mean()
    sizes = texts.groupby(level=SPLIT_CELL).size()
    ps = pd.concat([phase_p(records[records.compression_ratio == r], p) for r, p in recommend.items()])
    rng = np.random.default_rng(seed)
    rows = []
    for key, row in means.iterrows():
        press = recommend.get(float(key[5]))
        if press is None or pd.isna(row.get(press, np.nan)):
            continue
        base = row[[b for b in BASELINES if b in row.index]].dropna()
        if base.empty:
            continue
        best = base.idxmax()  # ties: the registry's order (idxmax keeps the first)
        dev_key = tuple(key[i] for i in (0, 1, 2, 3, 5))
        chosen = dev_best["best"].get(dev_key) if len(dev_best) else None
        chosen_mean = row.get(chosen, np.nan) if chosen is not None else np.nan
        tied = int((base >= base[best] - NEAR - TOLERANCE).sum())
        accuracy = float(base[best])
        if accuracy >= 1 - 1e-9:
            reach = 1.0
        else:
            reach = counted_share(rng, min(max(accuracy, 0.02), 0.98), ((int(key[4]), int(sizes[key])),), None,
                                  ties=tied, below=0.0, cells=cells)
        rows.append({**dict(zip(SPLIT_CELL, key)), "press": press, "mean": row[press], "p": ps.get(key, np.nan),
                     "best": best, "best_mean": base[best], "near": row[press] >= base[best] - NEAR - TOLERANCE,
                     "dev_best": chosen, "dev_best_mean": chosen_mean,
                     "near_dev": bool(row[press] >= chosen_mean - NEAR - TOLERANCE) if chosen is not None else None,
                     "texts": int(sizes[key]), "tied_reach": reach})
    table = pd.DataFrame(rows)
    if len(table):
        table["p_holm"] = np.nan
        for model, part in table.groupby("model"):
            valid = part["p"].notna()
            table.loc[part.index[valid], "p_holm"] = holm(part.loc[valid, "p"].to_numpy())
    return table


def paired_dev_best(records: pd.DataFrame, table: pd.DataFrame) -> pd.DataFrame:
    """(b): per model and ratio, the recommendation minus the dev-chosen baseline, one value per text."""
    texts = text_means(records)
    rows = []
    for (model, ratio), part in table.dropna(subset=["dev_best"]).groupby(["model", "compression_ratio"]):
        diffs = []
        for r in part.itertuples():
            key = (r.model, r.setting, r.task, r.context_length, r.stride, r.compression_ratio)
            block = texts.xs(key, level=SPLIT_CELL)
            if r.press in block and r.dev_best in block:
                diffs.append((block[r.press] - block[r.dev_best]).dropna())
        d = pd.concat(diffs) if diffs else pd.Series(dtype=float)
        n = len(d)
        half = stats.t.ppf(0.975, n - 1) * d.std(ddof=1) / np.sqrt(n) if n > 1 else float("nan")
        rows.append({"model": model, "ratio": ratio, "n": n, "diff": d.mean(), "low": d.mean() - half,
                     "high": d.mean() + half})
    return pd.DataFrame(rows)


def target_markdown(table: pd.DataFrame, costs: dict, recommend: dict) -> str:
    lines = []
    for model, part in table.groupby("model", sort=False):
        lines += [f"### {model}", "",
                  "| setting | task | tokens | S | ratio | press | mean | phase p (Holm) | best baseline | within 0.03 "
                  "| dev-chosen baseline | within 0.03 of it | a tied press reaches |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in part.itertuples():
            dev = "-" if r.dev_best is None else f"`{r.dev_best}` {r.dev_best_mean:.2f}"
            near_dev = "-" if r.near_dev is None else ("yes" if r.near_dev else "**no**")
            setting = SETTING_NAMES.get(r.setting, r.setting)
            lines.append(f"| {setting} | {r.task} | {r.context_length} | {r.stride} | {r.compression_ratio:g} | "
                         f"`{r.press}` | {r.mean:.2f} | {fmt_p(r.p)} ({fmt_p(r.p_holm)}) | `{r.best}` "
                         f"{r.best_mean:.2f} | {'yes' if r.near else '**no**'} | {dev} | {near_dev} | "
                         f"{r.tied_reach:.2f} |")
        share = part["near"].mean()
        flat = bool((part["p"].fillna(1) >= 0.05).all())
        flat_holm = bool((part["p_holm"].fillna(1) >= ALPHA).all())
        lines += ["", f"- **Within 0.03 of the best baseline: {int(part['near'].sum())} of {len(part)} cells "
                      f"({share:.0%}; target {TARGET_SHARE:.0%}): {'met' if share >= TARGET_SHARE else 'missed'}.**",
                  f"- Flat: every cell p >= 0.05: {'met' if flat else 'missed'}; after Holm's correction over "
                  f"{int(part['p'].notna().sum())} cells: {'met' if flat_holm else 'missed'}."]
        table_cost = costs.get(model)
        if table_cost is None:
            lines.append("- Bytes and cost: not measured (give --cost).")
        else:
            for press in sorted(set(recommend.values())):
                if press not in table_cost or MATCHED not in table_cost:
                    lines.append(f"- Bytes and cost of `{press}`: no row in --cost for {model}.")
                    continue
                multiple = table_cost[press]["bytes"] / table_cost[MATCHED]["bytes"]
                prefills = table_cost[press]["prefills"]
                lines.append(f"- `{press}`: {multiple:.3f}x `{MATCHED}`'s bytes (target <= {BYTES_CAP}x: "
                             f"{'met' if multiple <= BYTES_CAP + TOLERANCE else 'missed'}), {prefills:.3f} prefills "
                             f"(target <= {COST_CAP}: {'met' if prefills <= COST_CAP else 'missed'}).")
        known = part.dropna(subset=["near_dev"])
        lines += [f"- (a) Within 0.03 of the dev-chosen baseline: {int(known['near_dev'].sum())} of {len(known)} "
                  "cells." if len(known) else "- (a) No dev-chosen baseline (give --dev).",
                  f"- (c) A press that ties the best baseline would be within 0.03 in {part['tied_reach'].mean():.0%} "
                  "of these cells on average (simulated at each cell's size and best accuracy).", ""]
    return "\n".join(lines)


def paired_markdown(table: pd.DataFrame) -> str:
    if table.empty:
        return "No dev-chosen baseline to pair with (give --dev)."
    lines = ["| model | ratio | texts | recommendation - dev-chosen baseline [95% CI] | no worse by 0.03 |",
             "|---|---|---|---|---|"]
    for r in table.itertuples():
        lines.append(f"| {r.model} | {r.ratio:g} | {r.n} | {r.diff:+.3f} [{r.low:+.3f}, {r.high:+.3f}] | "
                     f"{'yes' if r.low > -NEAR else 'not shown'} |")
    return "\n".join(lines)


def share_heads_markdown(records: pd.DataFrame) -> str:
    """The pre-registered ``share_heads`` rule on both models."""
    lines = [f"| model | `{SHARE_HEADS}` - `{REFERENCE}` pooled by text [95% CI] | texts | phase tests (Holm) | "
             "holds |", "|---|---|---|---|---|"]
    verdicts = []
    for model, part in records.groupby("model", sort=False):
        if not {SHARE_HEADS, REFERENCE} <= set(part.press):
            lines.append(f"| {model} | not answered | - | - | no |")
            verdicts.append(False)
            continue
        pooled = paired_pooled(part, SHARE_HEADS, REFERENCE)
        p = phase_p(part, SHARE_HEADS).dropna()
        fires = bool(len(p) and (holm(p.to_numpy()) < ALPHA).any())
        holds = pooled["low"] > 0 and not fires
        verdicts.append(holds)
        lines.append(f"| {model} | {pooled['diff']:+.3f} [{pooled['low']:+.3f}, {pooled['high']:+.3f}] | "
                     f"{pooled['n']} | {'fires' if fires else 'flat'} over {len(p)} cells | "
                     f"{'yes' if holds else 'no'} |")
    both = len(verdicts) >= 2 and all(verdicts)
    lines += ["", f"**`share_heads=false` {'becomes' if both else 'does not become'} `PhaseAwarePress()`'s default** "
                  "(it must hold on both models)."]
    return "\n".join(lines)


def ours_table(records: pd.DataFrame, recommend: dict) -> pd.DataFrame:
    """Section 4: per model, press of ours (and ``chunked_stride``) and ratio, the cells within 0.03 of the best
    baseline, the mean difference to it over those cells, and the press minus the recommendation pooled by text
    (:func:`studies.common.paired_pooled` over that ratio's answers)."""
    means = text_means(records).groupby(level=SPLIT_CELL).mean()
    base_cols = [b for b in BASELINES if b in means.columns]
    if not base_cols:
        return pd.DataFrame()
    best = means[base_cols].max(axis=1)
    rows = []
    for press in [p for p in (MATCHED,) + OURS if p in means.columns]:
        for (model, ratio), part in means.groupby(level=["model", "compression_ratio"]):
            cells = part[press].dropna()
            if cells.empty or best.loc[cells.index].isna().all():
                continue
            gap = cells - best.loc[cells.index]
            row = {"model": model, "press": press, "ratio": ratio, "cells": len(cells),
                   "near": int((gap >= -NEAR - TOLERANCE).sum()), "gap": gap.mean(), "diff": np.nan,
                   "low": np.nan, "high": np.nan, "texts": 0, "recommended": press == recommend.get(float(ratio))}
            chosen = recommend.get(float(ratio))
            answers = records[(records.model == model) & (records.compression_ratio == ratio)]
            if chosen is not None and not row["recommended"] and chosen in set(answers.press):
                pooled = paired_pooled(answers, press, chosen)
                row.update(diff=pooled["diff"], low=pooled["low"], high=pooled["high"], texts=pooled["n"])
            rows.append(row)
    return pd.DataFrame(rows)


def ours_markdown(table: pd.DataFrame) -> str:
    if table.empty:
        return "No press of ours answered beside a kvpress baseline."
    lines = ["| model | press | ratio | within 0.03 of the best baseline | mean - best baseline | "
             "press - recommendation by text [95% CI] (texts) |", "|---|---|---|---|---|---|"]
    for r in table.itertuples():
        paired = "(the recommendation)" if r.recommended else "-" if not r.texts else \
            f"{r.diff:+.3f} [{r.low:+.3f}, {r.high:+.3f}] ({r.texts})"
        lines.append(f"| {r.model} | `{r.press}` | {r.ratio:g} | {r.near} of {r.cells} | {r.gap:+.3f} | {paired} |")
    return "\n".join(lines)


def runs_markdown(infos: list) -> str:
    """The split's planned runs (model x setting x length, :data:`studies.regimes_runs.DEV`'s models and lengths),
    each with the folder read and the answers it holds of those it plans."""
    by_slot = {}
    for info in infos:
        config = info.config or {}
        lengths = config.get("context_lengths") or [None]
        by_slot[(info.model, SETTINGS[bool(config.get("compress_question"))], lengths[0])] = info
    slots = [(m, SETTINGS[q], n) for m in DEV.models for q in (False, True) for n in DEV.lengths]
    rows, finished = [], 0
    for slot in slots + [k for k in by_slot if k not in slots]:
        info = by_slot.get(slot)
        if info is None:
            state = "not started"
        else:
            done = info.planned is not None and info.answers >= info.planned
            finished += done
            state = f"{info.answers:,} / {info.planned:,}" if info.planned else f"{info.answers:,} / ?"
            state += "" if done else " (running or stopped)"
        where = "-" if info is None else f"`{info.path}`"
        rows.append(f"| {slot[0]} | {SETTING_NAMES.get(slot[1], slot[1])} | {slot[2]} | {where} | {state} |")
    return "\n".join([f"{finished} of {len(slots)} planned runs finished.", "",
                      "| model | setting | tokens | run | answers / planned |", "|---|---|---|---|---|", *rows])


def report(split: list[str], dev: list[str], recommend: dict, cost_specs: list, cells: int = 2000) -> str:
    records, infos = load_runs(split)
    if not len(records):
        raise ValueError("the split runs hold no answers")
    missing = sorted({p for p in recommend.values()} - set(records.press))
    if missing:
        raise ValueError(f"--recommend {', '.join(missing)} has no answers in the split runs")
    dev_best = best_baselines(cell_means(load(dev))) if dev else pd.DataFrame(columns=["best", "best_mean"])
    costs = read_costs(cost_specs) if cost_specs else {}
    table = cell_table(records, dev_best, recommend, cells=cells)
    if table.empty:
        raise ValueError("no split cell has answers of the recommendation and a kvpress baseline")
    ratios = ", ".join(f"{r:g}: `{p}`" for r, p in sorted(recommend.items()))
    return "\n".join([f"Recommendation read: {ratios}. Best baseline of a cell: the best of {len(BASELINES)} "
                      "registered kvpress baselines.", "", "## The split's runs", "", runs_markdown(infos), "",
                      "## The target, per model", "",
                      target_markdown(table, costs, recommend),
                      "## (b) Paired with the dev-chosen baseline", "",
                      paired_markdown(paired_dev_best(records, table)), "", "## The share_heads rule", "",
                      share_heads_markdown(records), "", "## Every press of ours, reported (decides nothing)", "",
                      ours_markdown(ours_table(records, recommend)), ""])


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m studies.regimes_split", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="the fresh split's kvpress-phase eval output directories")
    parser.add_argument("--dev", nargs="*", default=[], help="the dev round's runs (the dev-chosen baselines)")
    parser.add_argument("--recommend", required=True, help="the frozen press per ratio: 0.25=SPEC,0.5=SPEC,0.75=SPEC "
                        "or one SPEC")
    parser.add_argument("--cost", action="append", default=[], metavar="MODEL=FILE",
                        help="benchmarks/bench_compress_cost.py's Markdown for MODEL (repeatable)")
    parser.add_argument("--cells", type=int, default=2000, help="simulated cells per split cell for (c)")
    parser.add_argument("--output", help="also write the Markdown here")
    args = parser.parse_args(argv)
    if args.cells < 100:
        parser.error(f"--cells must be >= 100, got {args.cells}")
    try:
        recommend = parse_recommendation(args.recommend)
        text = report(args.runs, args.dev, recommend, args.cost, cells=args.cells)
    except (ValueError, FileNotFoundError) as exc:
        print(f"regimes_split: error: {exc}", file=sys.stderr)
        return 2
    emit(text, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
