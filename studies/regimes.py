"""The ratio-regimes dev round's tables and its pre-registered decision (docs/preregistration-ratio-regimes.md).

    python -m studies.regimes outputs/regimes-dev/smollm2/* outputs/regimes-dev/qwen2.5-coder-0.5b/* \\
        --cost smollm2=FILE --cost qwen2.5-coder-0.5b=FILE [--entries FILE] \\
        --output docs/results/regimes/dev-tables.md

Reads the dev round's ``kvpress-phase eval`` directories (one model, setting, stride and context length each; a
folder that does not exist or holds no answers yet is listed as not started) and writes Markdown:

1. the round's state: every planned run (model x setting x stride x length, 16 in all) with the answers it holds
   against those it plans, and the dev cells each model has answers in;
2. every dev cell (model, setting, task, context length, ratio; the two strides pooled): ``no_press``,
   ``chunked_stride`` and each press of ours, its difference to the best kvpress baseline of the cell (the best mean
   among every registered kvpress baseline, :func:`~.common.kvpress_baselines`, ``dms_kvzap`` included), and every
   baseline's mean;
3. each press of ours paired by text with the best baseline of each cell, per model and ratio and per ratio;
4. what the round can detect (the pre-registration's figures, with the number of texts actually present), the
   entries kept, and, exploratory and read by no rule, the ``niah_multivalue`` cells under RULER's partial credit
   (:func:`credit_markdown`);
5. the decision rule, rules 1-6 in their order (:mod:`studies.regimes_rules`, which states them as coded), only when
   every planned run holds every answer it plans (otherwise ``decision pending: N of M runs finished``); the
   mechanisms' scores (rule 6) come with it.

A cell's mean is over its texts (a text: one sample of one stride's run; 8 per stride, 16 per cell), each text its
mean over its phases: the unit the pre-registration's paired figures count.

``--cost MODEL=FILE`` (once per model): the Markdown output of ``benchmarks/bench_compress_cost.py`` for that model
(1,024 tokens, ratio 0.75): the compress step ("in prefills") and the bytes stored through kvpress's pipeline, the
"ragged MiB" column for the presses of ours (what the per-head designs store) and "cache MiB" for kvpress's presses
(as they ship, masked). ``--entries FILE`` (``[MODEL=]FILE``, repeatable): the Markdown output of
``benchmarks/bench_threshold_budget.py``, quoted beside the entries the dev answers kept (rule 2 reads the answers).

This module holds the tables and the command line; what the round reads (the plan, the runs and what is finished,
the means, the costs) is :mod:`studies.regimes_runs`, and the decision rule :mod:`studies.regimes_rules`.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Optional

import numpy as np
import pandas as pd
from scipy import stats

from studies.common import emit, fmt_number
from studies.regimes_rules import decide, mechanisms_markdown, with_best
from studies.regimes_runs import (BASELINES, CELL, DEV, G, MATCHED, OURS, SETTING_NAMES, TEXT, Design, Round, T,
                                  best_baselines, cell_means, entry_shares, phase_tests, pooled_phase_tests,
                                  read_costs, read_round, text_means)


# ----------------------------------------------------------------------------------------------------- the tables
def status_markdown(round_: Round, design: Design = DEV) -> str:
    lines = [f"{round_.finished} of {len(round_.runs)} planned runs finished.", "",
             "| model | setting | stride | tokens | run | answers / planned |", "|---|---|---|---|---|---|"]
    for r in round_.runs.itertuples():
        state = "" if r.finished else (" (not started)" if r.run is None else " (under way)")
        lines.append(f"| {r.model} | {SETTING_NAMES.get(r.setting, r.setting)} | {r.stride} | {r.context_length} | "
                     f"{'-' if r.run is None else '`' + r.run + '`'} | {r.answers:,} / {r.planned:,}{state} |")
    if round_.not_started:
        lines += ["", "Folders given without answers yet: " + ", ".join(f"`{p}`" for p in round_.not_started) + "."]
    records = round_.records
    lines += ["", "| model | dev cells with answers | dev cells complete (every press, every text) |",
              "|---|---|---|"]
    per_model = len(design.settings) * len(design.tasks) * len(design.lengths) * len(design.ratios)
    for model in design.models:
        part = records[(records.model == model) & (records.compression_ratio > 0)] if len(records) else records
        if not len(part):
            lines.append(f"| {model} | 0 of {per_model} | 0 of {per_model} |")
            continue
        texts = part[CELL + ["press", "stride", "sample_id"]].drop_duplicates().groupby(CELL + ["press"]).size()
        phases = part.groupby(CELL + ["press"]).size()
        compressing = [p for p in design.presses if p != "no_press"]
        complete = 0
        for cell, block in phases.groupby(level=CELL):
            by_press = block.droplevel(CELL)
            _, setting, _, length, _ = cell
            full = design.texts_per_cell(model, setting, length)
            want = design.phases_per_cell(model, setting, length)
            if all(by_press.get(p, 0) >= want and texts.get(cell + (p,), 0) >= full for p in compressing):
                complete += 1
        present = part[CELL].drop_duplicates().shape[0]
        lines.append(f"| {model} | {present} of {per_model} | {complete} of {per_model} |")
    return "\n".join(lines)


def cells_markdown(means: pd.DataFrame, best: pd.DataFrame, design: Design = DEV, every_baseline: bool = True) -> str:
    """Per model: ours against the best baseline of each cell, then (``every_baseline``) every baseline's mean."""
    joined = with_best(means, best)
    nopress = means[means.press == "no_press"].set_index(["model", "setting", "task", "context_length"])["mean"]
    ours = [p for p in (MATCHED,) + OURS]
    lines = []
    for model in design.models:
        part = joined[joined.model == model]
        if part.empty:
            continue
        table = part.set_index(CELL + ["press"])
        lines += [f"#### {model}: the presses of ours and the best baseline", "",
                  "| setting | task | tokens | ratio | texts | no_press | " + " | ".join(f"`{p}`" for p in ours)
                  + " | best baseline |", "|---|---|---|---|---|---|" + "---|" * (len(ours) + 1)]
        for cell, block in part.groupby(CELL, sort=True):
            _, setting, task, length, ratio = cell
            marks = []
            for press in ours:
                if (*cell, press) not in table.index:
                    marks.append("")
                    continue
                r = table.loc[(*cell, press)]
                marks.append(f"{r['mean']:.2f} ({r['diff']:+.2f}){'' if r['near'] else ' x'}")
            b = best.loc[cell]
            texts = int(block["texts"].max())
            full = nopress.get((model, setting, task, length))
            lines.append(f"| {SETTING_NAMES.get(setting, setting)} | {task} | {length} | {ratio:g} | {texts} | "
                         f"{fmt_number(full, 2)} | " + " | ".join(marks) + f" | `{b['best']}` {b['best_mean']:.2f} |")
        lines += ["", "Each press: its mean (its difference to the best baseline); x: more than 0.03 below it.", ""]
        if not every_baseline:
            continue
        answered = [p for p in BASELINES if p in set(part.press)]
        lines += [f"#### {model}: every kvpress baseline", "",
                  "| setting | task | tokens | ratio | " + " | ".join(f"`{p}`" for p in answered) + " |",
                  "|---|---|---|---|" + "---|" * len(answered)]
        for cell, _ in part.groupby(CELL, sort=True):
            _, setting, task, length, ratio = cell
            values = [fmt_number(table["mean"].get((*cell, p)), 2) for p in answered]
            lines.append(f"| {SETTING_NAMES.get(setting, setting)} | {task} | {length} | {ratio:g} | "
                         + " | ".join(values) + " |")
        lines.append("")
    return "\n".join(lines)


CREDIT_TASK = "niah_multivalue"


def credit_markdown(records: pd.DataFrame, design: Design = DEV) -> str:
    """Exploratory, read by no rule: the cells of :data:`CREDIT_TASK` with each answer scored by RULER's credit (the
    share of the four values it holds, :func:`~kvpress_phase.evaluation.tasks.partial_score`) instead of all or
    nothing; where every press scores 0 (SmolLM2 at 2,048 tokens) it still orders them."""
    from kvpress_phase.evaluation.tasks import partial_score

    part = records[records.task == CREDIT_TASK] if "task" in records else records.iloc[:0]
    if part.empty or not {"prediction", "answer"} <= set(part.columns):
        return f"(no {CREDIT_TASK} answers with their predictions yet)"
    credit = [partial_score("" if p is None else str(p), list(a), t)
              for p, a, t in zip(part.prediction, part.answer, part.task)]
    means = cell_means(part.assign(score=credit))
    return cells_markdown(means, best_baselines(means), design, every_baseline=False)


def paired_with_best(records: pd.DataFrame, best: pd.DataFrame, presses: tuple = OURS) -> pd.DataFrame:
    """Each of ``presses`` minus the best baseline of each cell, one value per text (its mean over its phases),
    pooled per model and ratio (``model`` a name) and per ratio over the models (``model`` "both"): mean, 95% t
    interval, texts, and the standard deviation of a text's difference (``sd``)."""
    texts = text_means(records)
    rows = []
    for press in presses:
        if press not in texts:
            continue
        parts = []
        for cell, b in best.iterrows():
            try:
                block = texts.xs(cell, level=CELL)
            except KeyError:
                continue
            if b["best"] not in block:
                continue
            d = (block[press] - block[b["best"]]).dropna()
            parts.append(pd.DataFrame({"model": cell[0], "ratio": cell[4], "diff": d.to_numpy()}))
        if not parts:
            continue
        diffs = pd.concat(parts)
        groups = [((m, r), d) for (m, r), d in diffs.groupby(["model", "ratio"])]
        groups += [(("both", r), d) for r, d in diffs.groupby("ratio")]
        for (model, ratio), d in groups:
            n, mean, sd = len(d), d["diff"].mean(), d["diff"].std(ddof=1)
            half = stats.t.ppf(0.975, n - 1) * sd / np.sqrt(n) if n > 1 else float("nan")
            rows.append({"press": press, "model": model, "ratio": ratio, "n": n, "diff": mean, "low": mean - half,
                         "high": mean + half, "sd": sd})
    return pd.DataFrame(rows)


def paired_markdown(table: pd.DataFrame) -> str:
    if table.empty:
        return "No text has answers of both a press of ours and its cell's best baseline yet."
    lines = ["| press | model | ratio | texts | mean difference to the best baseline [95% CI] |",
             "|---|---|---|---|---|"]
    order = {p: i for i, p in enumerate(OURS)}
    models = {m: i for i, m in enumerate(dict.fromkeys(m for m in table.model if m != "both"))}
    models["both"] = len(models)
    table = table.assign(_p=table.press.map(order), _m=table.model.map(models)).sort_values(["_p", "_m", "ratio"])
    for r in table.itertuples():
        lines.append(f"| `{r.press}` | {r.model} | {r.ratio:g} | {r.n} | {r.diff:+.3f} [{r.low:+.3f}, "
                     f"{r.high:+.3f}] |")
    lines += ["", "Texts of one sample are not independent across settings and lengths: read the intervals pooled "
              "over cells as a bound."]
    return "\n".join(lines)


SPREAD = 0.41
"""The standard deviation of a text's difference to its cell's best baseline, pooled per model and ratio, in the
earlier real-model runs (R7's and R8's, ``python -m studies.regimes_sizing``): the largest of its means over the
presses of ours per run and ratio (ratio 0.75 on SmolLM2). The pre-registration's deviation 1 sizes the round with
it."""


def detectable(n: int, sd: float = 0.5) -> float:
    """The difference a mean over ``n`` paired texts detects with 80% power at two-sided 0.05 when a text's
    difference has standard deviation ``sd``; the default 0.5 bounds it for any difference in [-1, 1]."""
    return (stats.norm.ppf(0.975) + stats.norm.ppf(0.8)) * sd / math.sqrt(n) if n else float("nan")


def detect_markdown(records: pd.DataFrame, design: Design = DEV) -> str:
    """The pre-registration's figures (as deviation 1 sizes the round) with the texts actually present (a text counts
    where it has answers)."""
    compressed = records[records.compression_ratio > 0] if len(records) else records
    texts = compressed[TEXT].drop_duplicates() if len(compressed) else pd.DataFrame(columns=TEXT)
    per_cell = texts.groupby(CELL).size()
    per_model_ratio = texts.groupby(["model", "compression_ratio"]).size()
    per_ratio = texts.groupby("compression_ratio").size()

    def figures(n) -> str:
        return f"{fmt_number(detectable(n), 2)} / {fmt_number(detectable(n, SPREAD), 2)}"

    def span(values) -> tuple:
        low, high = int(min(values)), int(max(values))
        return (f"{low}" if low == high else f"{low}-{high}",
                figures(low) if low == high else f"{figures(high)} to {figures(low)}")

    cells = [design.texts_per_cell(m, st, n)
             for m in design.models for st in design.settings for n in design.lengths]
    planned, planned_figures = span(cells)
    lines = ["| unit | texts planned | detectable (planned) | texts present | detectable (present) |",
             "|---|---|---|---|---|"]
    if len(per_cell):
        present, present_figures = span(per_cell)
        lines.append(f"| a cell ({len(per_cell)} cells with answers) | {planned} | {planned_figures} | {present} | "
                     f"{present_figures} |")
    else:
        lines.append(f"| a cell | {planned} | {planned_figures} | 0 | - |")
    for model in design.models:
        want = design.texts_planned(model)
        for ratio in design.ratios:
            n = int(per_model_ratio.get((model, ratio), 0))
            lines.append(f"| {model}, ratio {ratio:g} | {want} | {figures(want)} | {n} | {figures(n) if n else '-'} |")
    want = design.texts_planned()
    for ratio in design.ratios:
        n = int(per_ratio.get(ratio, 0))
        lines.append(f"| ratio {ratio:g}, both models | {want} | {figures(want)} | {n} | {figures(n) if n else '-'} |")
    lines += ["", "Detectable: the difference to a cell's best baseline found with 80% power at two-sided 0.05, "
              "(z(0.975) + z(0.8)) x sd / sqrt(texts), first with sd = 0.5 (a bound for any difference in [-1, 1]), "
              f"then with sd = {SPREAD} (the spread of a text's difference in the earlier real-model runs, "
              "`python -m studies.regimes_sizing`). Texts of one sample are not independent across settings and "
              "lengths: the pooled figures are bounds. The \"within 0.03\" count of rule 3 is noisy at a few texts "
              "a cell: it ranks the candidates, and the fresh split reports the target."]
    return "\n".join(lines)


def entries_markdown(records: pd.DataFrame) -> str:
    lines = ["| press | against | model | ratio | answers | mean entries kept | against's | multiple |",
             "|---|---|---|---|---|---|---|---|"]
    for press, against in ((T, G), ("dms_kvzap", MATCHED), (G, MATCHED)):
        for r in entry_shares(records, press, against).itertuples():
            ratio = r.ratio if r.ratio == "all" else f"{r.ratio:g}"
            lines.append(f"| `{press}` | `{against}` | {r.model} | {ratio} | {r.answers} | {r.press:.1f} | "
                         f"{r.against:.1f} | {r.multiple:.3f}x |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------- main
def report(paths: list[str], cost_specs: Optional[list] = None, entries: Optional[list] = None,
           design: Design = DEV) -> str:
    """The whole Markdown of :func:`main`."""
    round_ = read_round(paths, design)
    costs = read_costs(cost_specs or [], design)
    quoted = []
    for spec in entries or []:
        model, sep, path = spec.partition("=")
        if not sep:
            model, path = "", spec
        elif model not in design.models:
            raise ValueError(f"--entries {spec!r}: {model!r} is not a model of the round ({', '.join(design.models)})")
        try:
            with open(path, encoding="utf-8") as fh:
                quoted.append((model, path, fh.read().strip()))
        except OSError as exc:
            raise ValueError(f"--entries {path!r} cannot be read: {exc}") from None
    records = round_.records
    parts = ["### The round", "", status_markdown(round_, design), ""]
    if not len(records):
        parts += [f"**decision pending: {round_.finished} of {len(round_.runs)} runs finished** (no answers yet)."]
        return "\n".join(parts)
    means = cell_means(records)
    best = best_baselines(means)
    parts += ["### Accuracy per dev cell (the two strides pooled)", "",
              f"Best baseline of a cell: the best mean among every registered kvpress baseline ({len(BASELINES)}: "
              f"{', '.join(BASELINES)}); a cell's mean is over its texts (each text's mean over its phases).", "",
              cells_markdown(means, best, design),
              "### Paired by text with the best baseline of each cell", "",
              paired_markdown(paired_with_best(records, best)), "",
              "### What the dev round can detect", "", detect_markdown(records, design), "",
              "### Entries kept over the dev answers", "", entries_markdown(records), "",
              f"### Exploratory: RULER's credit on {CREDIT_TASK} (read by no rule)", "",
              "Each answer scored by the share of the values it holds (RULER's `string_match_all`) instead of all or "
              "nothing; the best baseline is the best by this credit. Not pre-registered: the decision below reads "
              "the 0/1 scores only.", "",
              credit_markdown(records, design), ""]
    for model, path, text in quoted:
        parts += [f"`{path}`{' (' + model + ')' if model else ''}, benchmarks/bench_threshold_budget.py:", "",
                  "\n".join("> " + line if line else ">" for line in text.splitlines()), ""]
    parts += ["### The pre-registered decision", ""]
    if not round_.complete:
        parts.append(f"**decision pending: {round_.finished} of {len(round_.runs)} runs finished.**")
        return "\n".join(parts)
    missing = [m for m in design.models if m not in costs]
    if missing:
        parts.append(f"**decision pending: cost and bytes not measured for {', '.join(missing)}** (give "
                     + " ".join(f"--cost {m}=FILE" for m in missing) + ", the output of "
                     "benchmarks/bench_compress_cost.py).")
        return "\n".join(parts)
    unsummarised = [run for run in round_.finished_runs() if not os.path.exists(os.path.join(run, "summary.json"))]
    if unsummarised:
        parts.append(f"**decision pending: {len(unsummarised)} finished runs have no summary.json** (rule 1 reads "
                     "their phase tests from it): " + ", ".join(f"`{run}`" for run in unsummarised) + ".")
        return "\n".join(parts)
    tests = phase_tests(round_.finished_runs())
    parts += [decide(means, tests, pooled_phase_tests(records), costs, entry_shares(records, T, G), design), "",
              "### Rule 6: what each mechanism scored", "", mechanisms_markdown(means, design), ""]
    return "\n".join(parts)


def main(argv: Optional[list] = None, design: Design = DEV) -> int:
    parser = argparse.ArgumentParser(prog="python -m studies.regimes", description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="the dev round's kvpress-phase eval output directories")
    parser.add_argument("--cost", action="append", default=[], metavar="MODEL=FILE",
                        help="benchmarks/bench_compress_cost.py's Markdown output for one model (once per model)")
    parser.add_argument("--entries", action="append", default=[], metavar="[MODEL=]FILE",
                        help="benchmarks/bench_threshold_budget.py's Markdown output, quoted beside the entries the "
                        "dev answers kept")
    parser.add_argument("--output", help="write the Markdown here as well as to stdout")
    args = parser.parse_args(argv)
    try:
        text = report(args.runs, args.cost, args.entries, design)
    except (OSError, ValueError) as exc:
        print(f"regimes: error: {exc}", file=sys.stderr)
        return 2
    emit(text, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
