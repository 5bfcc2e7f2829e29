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
4. what the round can detect (the pre-registration's figures, with the number of texts actually present);
5. the decision rule, rules 1-6 in their order, only when every planned run holds every answer it plans (otherwise
   ``decision pending: N of M runs finished``); the mechanisms' scores (rule 6) come with it.

A cell's mean is over its texts (a text: one sample of one stride's run; 8 per stride, 16 per cell), each text its
mean over its phases: the unit the pre-registration's paired figures count.

The rules as coded (:func:`decide`):

1. Flat: Holm's adjustment (:func:`~kvpress_phase.evaluation.metrics.holm`) over each press's phase tests in every
   run's ``summary.json`` (per model, cell and stride: 144 tests), family-wise 0.05; a candidate with any adjusted
   p < 0.05 is dropped.
2. Cost and bytes, per model: a compress step above 0.1 prefills, or stored bytes above 1.05x ``chunked_stride``'s,
   drops a candidate; T is dropped as well when its mean cache length over the dev answers is above 1.05x G's
   over the same examples (:func:`entry_shares`). A drop on either model drops the candidate.
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

``--cost MODEL=FILE`` (once per model): the Markdown output of ``benchmarks/bench_compress_cost.py`` for that model
(1,024 tokens, ratio 0.75): the compress step ("in prefills") and the bytes stored through kvpress's pipeline, the
"ragged MiB" column for the presses of ours (what the per-head designs store) and "cache MiB" for kvpress's presses
(as they ship, masked). ``--entries FILE`` (``[MODEL=]FILE``, repeatable): the Markdown output of
``benchmarks/bench_threshold_budget.py``, quoted beside the entries the dev answers kept (rule 2 reads the answers).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import os
import sys
from typing import Optional

import numpy as np
import pandas as pd
from scipy import stats

from kvpress_phase.evaluation.config import SETTINGS
from kvpress_phase.evaluation.merging import RunInfo, read_runs
from kvpress_phase.evaluation.metrics import holm
from kvpress_phase.evaluation.presses import REGISTRY, parse_press_spec
from kvpress_phase.evaluation.store import RESULTS_DIR, saved_config

from studies.common import emit, fmt_number, fmt_p, kvpress_baselines, read_summaries

REFERENCE = "phase_aware"
SHARE_HEADS = "head_budget:floor=1.0"
D = "layer_budget:scorer=kvzap"
G = "global_budget:scorer=kvzap"
G_FLOOR = "global_budget:floor=0.25:scorer=kvzap"
T = "threshold_budget"
MATCHED = "chunked_stride"
OURS = (REFERENCE, SHARE_HEADS, D, G, G_FLOOR, T)
"""The presses of ours, by their labels of today, in the pre-registration's order."""
CANDIDATES = (G, G_FLOOR, T, REFERENCE, D)
"""Rule 3's candidates, as the pre-registration lists them (this order breaks the last ties).
``head_budget:floor=1.0`` is reported, not a candidate: the ``share_heads`` rule is decided on the fresh split."""
BASELINES = tuple(kvpress_baselines())
"""Every registered kvpress baseline (14): the best baseline of a cell is the best of them (ties: the first here)."""
SHORT = {REFERENCE: "phase_aware", SHARE_HEADS: "heads (floor=1.0)", D: "D", G: "G", G_FLOOR: "G floors", T: "T"}

CELL = ["model", "setting", "task", "context_length", "compression_ratio"]
TEXT = CELL + ["stride", "sample_id"]
NEAR, TOLERANCE = 0.03, 1e-9
ALPHA = 0.05
COST_CAP, BYTES_CAP, ENTRIES_CAP = 0.1, 1.05, 1.05
TIE_CELLS, ONE_PRESS_CELLS = 1, 2
SETTING_NAMES = {SETTINGS[False]: "query-agnostic", SETTINGS[True]: "query-aware"}

PRESSES = ("no_press", MATCHED, REFERENCE, SHARE_HEADS, D, G, G_FLOOR, T, "snapkv", "knorm", "streaming_llm",
           "chunkkv", "chunk", "expected_attention", "tova", "keydiff", "pyramidkv", "kvzip", "kvzip_plus", "adakv",
           "kvzap", "dms_kvzap")
"""The presses every dev run answers (the pre-registration's ``P``)."""


@dataclasses.dataclass(frozen=True)
class Design:
    """What the dev round plans: a run per model, setting, stride (with its seed) and context length, each answering
    ``samples`` per phase of every task at every ratio with every press."""

    models: tuple = ("smollm2", "qwen2.5-coder-0.5b")
    settings: tuple = (SETTINGS[False], SETTINGS[True])
    stride_seeds: tuple = ((8, 10), (12, 15))
    lengths: tuple = (1024, 2048)
    tasks: tuple = ("niah_single", "niah_multikey", "niah_multivalue")
    ratios: tuple = (0.25, 0.5, 0.75)
    samples: int = 8
    presses: tuple = PRESSES

    @property
    def strides(self) -> tuple:
        return tuple(s for s, _ in self.stride_seeds)

    def slots(self) -> list[tuple]:
        """Every planned run: (model, setting, stride, context length)."""
        return list(itertools.product(self.models, self.settings, self.strides, self.lengths))

    def cells_per_ratio(self) -> int:
        """Dev cells of one ratio, both models together (24)."""
        return len(self.models) * len(self.settings) * len(self.tasks) * len(self.lengths)

    def texts_per_cell(self) -> int:
        return self.samples * len(self.stride_seeds)

    def planned_answers(self, stride: int) -> int:
        compressing = sum(p != "no_press" for p in self.presses)
        return self.samples * len(self.tasks) * stride * (int("no_press" in self.presses)
                                                           + len(self.ratios) * compressing)


DEV = Design()


# ----------------------------------------------------------------------------------------------------- the runs
@dataclasses.dataclass
class Round:
    """The runs read: answers (with ``model``), one line per planned run, and the folders not started."""

    records: pd.DataFrame
    runs: pd.DataFrame
    """One row per planned run: model, setting, stride, length, run (None: no folder given), answers, planned,
    finished."""
    not_started: list

    @property
    def finished(self) -> int:
        return int(self.runs["finished"].sum())

    @property
    def complete(self) -> bool:
        return bool(self.runs["finished"].all())

    def finished_runs(self) -> list[str]:
        return list(self.runs[self.runs["finished"]]["run"])


def run_slot(info: RunInfo, design: Design = DEV) -> tuple:
    """The planned run ``info`` is: (model, setting, stride, context length). ValueError naming the run when its
    configuration is not one of the round's runs."""
    config = info.config
    if config is None:
        raise ValueError(f"{info.path!r} has no config.json: not a run of `kvpress-phase eval`")

    def refuse(what: str, have, want) -> ValueError:
        return ValueError(f"{info.path!r} is not a run of the pre-registered dev round: its {what}: {have!r}, the "
                          f"round's {want!r}")

    if info.model not in design.models:
        raise refuse("model", info.model, list(design.models))
    strides, lengths = list(config.get("strides") or []), list(config.get("context_lengths") or [])
    if len(strides) != 1 or len(lengths) != 1:
        raise ValueError(f"{info.path!r} plans strides {strides} and context lengths {lengths}: a dev run holds one "
                         "stride and one context length")
    seeds = dict(design.stride_seeds)
    stride, length = int(strides[0]), int(lengths[0])
    if stride not in seeds:
        raise refuse("stride", stride, list(design.strides))
    if config.get("seed") != seeds[stride]:
        raise refuse(f"seed at stride {stride}", config.get("seed"), seeds[stride])
    if length not in design.lengths:
        raise refuse("context length", length, list(design.lengths))
    checks = [("tasks", sorted(config.get("tasks") or []), sorted(design.tasks)),
              ("compression ratios", sorted(float(r) for r in config.get("compression_ratios") or []),
               sorted(design.ratios)),
              ("samples", config.get("samples"), design.samples),
              ("presses", sorted(parse_press_spec(p).label for p in config.get("presses") or []),
               sorted(design.presses)),
              ("protocol", config.get("protocol"), "offset"),
              ("matched cache", bool(config.get("matched_cache")), True)]
    for what, have, want in checks:
        if have != want:
            raise refuse(what, have, want)
    return info.model, SETTINGS[bool(config.get("compress_question"))], stride, length


def read_round(paths: list[str], design: Design = DEV) -> Round:
    """The dev round's answers and the state of every planned run. A path that does not exist, or a folder with no
    answers yet, is a run not started; two folders for one planned run, or a run of another configuration, are
    ValueErrors naming them."""
    given, not_started = [], []
    for path in paths:
        if not os.path.isdir(os.path.join(path, RESULTS_DIR)):
            not_started.append(path)
        elif os.path.realpath(path) not in {os.path.realpath(p) for p in given}:
            given.append(path)
    if given:
        records, infos, notes = read_runs(given)
        for note in notes:
            print(f"warning: {note}", file=sys.stderr)
    else:
        records, infos = pd.DataFrame(), []
    by_slot = {}
    for info in infos:
        slot = run_slot(info, design)
        if slot in by_slot:
            raise ValueError(f"{by_slot[slot].path!r} and {info.path!r} are both the run {slot_name(slot)}: give "
                             "one folder per planned run")
        by_slot[slot] = info
    rows = []
    for slot in design.slots():
        info = by_slot.get(slot)
        planned = design.planned_answers(slot[2])
        answers = 0 if info is None else info.answers
        if info is not None and info.planned is not None and info.planned != planned:
            raise ValueError(f"{info.path!r} plans {info.planned} answers, the pre-registered run {planned}")
        rows.append({"model": slot[0], "setting": slot[1], "stride": slot[2], "context_length": slot[3],
                     "run": None if info is None else info.path, "answers": answers, "planned": planned,
                     "finished": info is not None and answers >= planned})
    return Round(records, pd.DataFrame(rows), not_started)


def slot_name(slot: tuple) -> str:
    model, setting, stride, length = slot
    return f"{model} {SETTING_NAMES.get(setting, setting)} stride {stride} {length} tokens"


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
        full = design.texts_per_cell()
        texts = part[CELL + ["press", "stride", "sample_id"]].drop_duplicates().groupby(CELL + ["press"]).size()
        phases = part.groupby(CELL + ["press"]).size()
        want = design.samples * sum(design.strides)
        compressing = [p for p in design.presses if p != "no_press"]
        complete = 0
        for cell, block in phases.groupby(level=CELL):
            by_press = block.droplevel(CELL)
            if all(by_press.get(p, 0) >= want and texts.get(cell + (p,), 0) >= full for p in compressing):
                complete += 1
        present = part[CELL].drop_duplicates().shape[0]
        lines.append(f"| {model} | {present} of {per_model} | {complete} of {per_model} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------- the means
def text_means(records: pd.DataFrame) -> pd.DataFrame:
    """A text's value per press: its mean over the phases (a text is one sample of one stride's run), one column per
    press; compressed cells only."""
    compressed = records[records.compression_ratio > 0]
    return compressed.groupby(TEXT + ["press"])["score"].mean().unstack("press")


def cell_means(records: pd.DataFrame) -> pd.DataFrame:
    """Mean per dev cell and press over the cell's texts (each its mean over its phases), with the count of texts;
    ``no_press`` at ratio 0 per model, setting, task and length."""
    per_text = records.groupby(TEXT + ["press"])["score"].mean()
    means = per_text.groupby(level=CELL + ["press"]).agg(["mean", "size"]).reset_index()
    return means.rename(columns={"size": "texts"})


def best_baselines(means: pd.DataFrame, baselines: tuple = BASELINES) -> pd.DataFrame:
    """The best kvpress baseline of every compressed cell among ``baselines`` (ties: the first of them), indexed by
    the cell: ``best`` and ``best_mean``."""
    base = means[means.press.isin(baselines) & (means.compression_ratio > 0)].copy()
    if base.empty:
        return pd.DataFrame(columns=["best", "best_mean"])
    base["order"] = base.press.map(list(baselines).index)
    base = base.sort_values(CELL + ["mean", "order"], ascending=[True] * len(CELL) + [False, True])
    first = base.groupby(CELL).first()
    return first[["press", "mean"]].rename(columns={"press": "best", "mean": "best_mean"})


def with_best(means: pd.DataFrame, best: pd.DataFrame) -> pd.DataFrame:
    """``means`` of the compressed cells with the cell's best baseline, the difference to it and whether the press
    is within 0.03 of it (``near``)."""
    out = means[means.compression_ratio > 0].join(best, on=CELL, how="inner")
    out["diff"] = out["mean"] - out["best_mean"]
    out["near"] = out["mean"] >= out["best_mean"] - NEAR - TOLERANCE
    return out


def cells_markdown(means: pd.DataFrame, best: pd.DataFrame, design: Design = DEV) -> str:
    """Per model: ours against the best baseline of each cell, then every baseline's mean."""
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


def paired_with_best(records: pd.DataFrame, best: pd.DataFrame, presses: tuple = OURS) -> pd.DataFrame:
    """Each of ``presses`` minus the best baseline of each cell, one value per text (its mean over its phases),
    pooled per model and ratio (``model`` a name) and per ratio over the models (``model`` "both"): mean, 95% t
    interval, texts."""
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
            n, mean = len(d), d["diff"].mean()
            half = stats.t.ppf(0.975, n - 1) * d["diff"].std(ddof=1) / np.sqrt(n) if n > 1 else float("nan")
            rows.append({"press": press, "model": model, "ratio": ratio, "n": n, "diff": mean, "low": mean - half,
                         "high": mean + half})
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


def detectable(n: int) -> float:
    """The difference a mean over ``n`` paired texts detects with 80% power at two-sided 0.05, its standard error
    bounded by 0.5/sqrt(n) (a difference in [-1, 1])."""
    return (stats.norm.ppf(0.975) + stats.norm.ppf(0.8)) * 0.5 / math.sqrt(n) if n else float("nan")


def detect_markdown(records: pd.DataFrame, design: Design = DEV) -> str:
    """The pre-registration's figures with the texts actually present (a text counts where it has answers)."""
    compressed = records[records.compression_ratio > 0] if len(records) else records
    texts = compressed[TEXT].drop_duplicates() if len(compressed) else pd.DataFrame(columns=TEXT)
    per_cell = texts.groupby(CELL).size()
    per_model_ratio = texts.groupby(["model", "compression_ratio"]).size()
    per_ratio = texts.groupby("compression_ratio").size()
    planned_cell = design.texts_per_cell()
    planned_model_ratio = planned_cell * len(design.settings) * len(design.tasks) * len(design.lengths)
    planned_ratio = planned_model_ratio * len(design.models)
    lines = ["| unit | texts planned | detectable (planned) | texts present | detectable (present) |",
             "|---|---|---|---|---|"]
    if len(per_cell):
        low, high = int(per_cell.min()), int(per_cell.max())
        present = f"{low}" if low == high else f"{low}-{high}"
        figure = fmt_number(detectable(low), 2) if low == high else \
            f"{fmt_number(detectable(high), 2)}-{fmt_number(detectable(low), 2)}"
        lines.append(f"| a cell ({len(per_cell)} cells with answers) | {planned_cell} | "
                     f"{detectable(planned_cell):.2f} | {present} | {figure} |")
    else:
        lines.append(f"| a cell | {planned_cell} | {detectable(planned_cell):.2f} | 0 | - |")
    for model in design.models:
        for ratio in design.ratios:
            n = int(per_model_ratio.get((model, ratio), 0))
            lines.append(f"| {model}, ratio {ratio:g} | {planned_model_ratio} | "
                         f"{detectable(planned_model_ratio):.2f} | {n} | {fmt_number(detectable(n), 2)} |")
    for ratio in design.ratios:
        n = int(per_ratio.get(ratio, 0))
        lines.append(f"| ratio {ratio:g}, both models | {planned_ratio} | {detectable(planned_ratio):.2f} | {n} | "
                     f"{fmt_number(detectable(n), 2)} |")
    lines += ["", "Detectable: the difference to a cell's best baseline found with 80% power at two-sided 0.05, "
              "(z(0.975) + z(0.8)) x 0.5 / sqrt(texts) (the standard error of a mean difference in [-1, 1] is at "
              "most 0.5/sqrt(n)). Texts of one sample are not independent across settings and lengths: the pooled "
              "figures are bounds. The \"within 0.03\" count of rule 3 is noisy at 16 texts a cell: it ranks the "
              "candidates, and the fresh split reports the target."]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------- rule inputs
def phase_tests(runs: list[str]) -> pd.DataFrame:
    """The phase test of every (model, setting, task, length, ratio, stride, press) from the runs' ``summary.json``
    (the model from each run's configuration)."""
    frames = []
    for run in runs:
        frame = read_summaries([run])
        config = saved_config(run) or {}
        frame["model"] = str(config.get("model"))
        frames.append(frame)
    if not frames:
        return pd.DataFrame(columns=CELL + ["stride", "press", "p_value"])
    return pd.concat(frames, ignore_index=True)[CELL + ["stride", "press", "p_value"]]


def read_cost_table(path: str) -> dict:
    """``{press label: {"prefills", "cache_mib", "ragged_mib"}}`` from the Markdown table(s) that
    ``benchmarks/bench_compress_cost.py --output`` appends (a later table wins; ``ragged_mib`` None in a table
    without the "ragged MiB" column). ValueError naming the file when it holds no such table."""
    try:
        handle = open(path, encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"--cost {path!r} cannot be read: {exc}") from None
    table, columns = {}, None
    with handle:
        for line in handle:
            cols = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
            if "in prefills" in cols:
                if "cache MiB" not in cols:
                    raise ValueError(f"--cost {path!r}: a table has no \"cache MiB\" column (not an output of "
                                     "benchmarks/bench_compress_cost.py)")
                columns = {"prefills": cols.index("in prefills"), "cache_mib": cols.index("cache MiB"),
                           "ragged_mib": cols.index("ragged MiB") if "ragged MiB" in cols else None}
                continue
            if columns is None or len(cols) <= columns["prefills"]:
                continue
            try:
                label = parse_press_spec(cols[0]).label
                row = {k: (float(cols[i]) if i is not None else None) for k, i in columns.items()}
            except (ValueError, IndexError):  # the separator row, or a press this version no longer has
                continue
            table[label] = row
    if not table:
        raise ValueError(f"--cost {path!r} holds no table of benchmarks/bench_compress_cost.py (no row under a "
                         "header with \"in prefills\")")
    return table


def stored_bytes(label: str, row: dict, path: str = "--cost") -> float:
    """The MiB a press stores through kvpress's pipeline: the ragged figure for a press of ours, the cache as
    kvpress's presses ship (masked) for theirs. ValueError for a press of ours measured without the ragged column."""
    if label in BASELINES:
        return row["cache_mib"]
    if row.get("ragged_mib") is None:
        raise ValueError(f"{path}: `{label}` is measured without the \"ragged MiB\" column: measure it again with "
                         "today's benchmarks/bench_compress_cost.py")
    return row["ragged_mib"]


def read_costs(specs: list[str], design: Design = DEV) -> dict:
    """``{model: {press label: {"prefills", "bytes"}}}`` from ``--cost MODEL=FILE`` values."""
    costs = {}
    for spec in specs or []:
        model, sep, path = spec.partition("=")
        if not sep or not model or not path:
            raise ValueError(f"--cost {spec!r}: give MODEL=FILE (a model of the round: {', '.join(design.models)})")
        if model not in design.models:
            raise ValueError(f"--cost {spec!r}: {model!r} is not a model of the round ({', '.join(design.models)})")
        if model in costs:
            raise ValueError(f"--cost is given twice for {model}")
        table = read_cost_table(path)
        costs[model] = {label: {"prefills": row["prefills"], "bytes": stored_bytes(label, row, f"--cost {path!r}")}
                        for label, row in table.items() if label in CANDIDATES + (MATCHED, SHARE_HEADS) or
                        label in BASELINES}
    return costs


def entry_shares(records: pd.DataFrame, press: str, against: str) -> pd.DataFrame:
    """``press``'s mean cache length over its compressed dev answers as a multiple of ``against``'s over the same
    examples (setting, task, length, ratio, stride, sample, phase), per model and ratio and per model (ratio
    "all")."""
    keys = ["model", "setting", "task", "context_length", "compression_ratio", "stride", "sample_id", "phase"]
    compressed = records[(records.compression_ratio > 0) & records.press.isin([press, against])]
    if compressed.empty or "cache_length" not in compressed:
        return pd.DataFrame(columns=["model", "ratio", "answers", "press", "against", "multiple"])
    both = compressed.pivot_table(index=keys, columns="press", values="cache_length", aggfunc="mean").dropna()
    if press not in both or against not in both:
        return pd.DataFrame(columns=["model", "ratio", "answers", "press", "against", "multiple"])
    both = both.reset_index()
    rows = []
    for (model, ratio), part in itertools.chain(both.groupby(["model", "compression_ratio"]),
                                                ((( m, "all"), p) for m, p in both.groupby("model"))):
        rows.append({"model": model, "ratio": ratio, "answers": len(part), "press": part[press].mean(),
                     "against": part[against].mean(), "multiple": part[press].mean() / part[against].mean()})
    return pd.DataFrame(rows)


def entries_markdown(records: pd.DataFrame) -> str:
    lines = ["| press | against | model | ratio | answers | mean entries kept | against's | multiple |",
             "|---|---|---|---|---|---|---|---|"]
    for press, against in ((T, G), ("dms_kvzap", MATCHED), (G, MATCHED)):
        for r in entry_shares(records, press, against).itertuples():
            ratio = r.ratio if r.ratio == "all" else f"{r.ratio:g}"
            lines.append(f"| `{press}` | `{against}` | {r.model} | {ratio} | {r.answers} | {r.press:.1f} | "
                         f"{r.against:.1f} | {r.multiple:.3f}x |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------- the rules
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


def decide(means: pd.DataFrame, tests: pd.DataFrame, costs: dict, shares: pd.DataFrame,
           design: Design = DEV) -> str:
    """The pre-registered decision (rules 1-5), as Markdown, on the complete round: ``means`` from
    :func:`cell_means`, ``tests`` from :func:`phase_tests`, ``costs`` from :func:`read_costs` (every model),
    ``shares`` from :func:`entry_shares` (T against G). ValueError when a model's cost of a candidate or of
    ``chunked_stride`` is not measured."""
    best = best_baselines(means)
    per_model = len(design.settings) * len(design.tasks) * len(design.lengths) * len(design.ratios)
    lines = ["#### Rule 1: flat", "",
             f"Holm's correction over each press's phase tests in the dev round (per model, cell and stride; "
             f"{len(design.models)} x {per_model} x {len(design.stride_seeds)} tests planned), family-wise {ALPHA}.",
             "",
             "| press | tests | smallest p | smallest Holm-adjusted p | rule 1 |", "|---|---|---|---|---|"]
    dropped = {}
    for press in OURS:
        h = holm_tests(tests, press)
        role = "" if press in CANDIDATES else " (reported; not a rule-3 candidate)"
        verdict = "**fires: dropped**" if h["fires"] else "flat"
        if h["fires"] and press in CANDIDATES:
            dropped[press] = (f"rule 1: its phase test fires after Holm's correction (smallest adjusted p "
                              f"{fmt_p(h['adjusted'])} over {h['n']} tests)")
        lines.append(f"| `{press}`{role} | {h['n']} | {fmt_p(h['raw'])} | {fmt_p(h['adjusted'])} | "
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

    lines += ["", f"**Recommendation: {recommendation_text(sequence, design.ratios)}.**"]
    return "\n".join(lines)


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
              "### Entries kept over the dev answers", "", entries_markdown(records), ""]
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
    parts += [decide(means, tests, costs, entry_shares(records, T, G), design), "",
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
