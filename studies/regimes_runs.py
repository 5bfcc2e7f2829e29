"""What the ratio-regimes dev round reads (docs/preregistration-ratio-regimes.md), for :mod:`studies.regimes` and
:mod:`studies.regimes_rules`:

* the presses by their labels (ours, rule 3's candidates, the kvpress baselines) and the plan, :class:`Design`
  (:data:`DEV`: a run per model, setting, stride with its seed and context length, 16 in all);
* the runs given and what is finished (:func:`read_round`, a :class:`Round`): a run's configuration is checked
  against the plan and a run of another configuration refused by name (:func:`run_slot`);
* the means per text and per dev cell (:func:`text_means`, :func:`cell_means`) and each cell's best kvpress baseline
  (:func:`best_baselines`);
* the rules' other inputs: the phase tests in the runs' ``summary.json`` (:func:`phase_tests`), the compress cost
  and stored bytes of ``benchmarks/bench_compress_cost.py``'s tables (:func:`read_costs`) and the entries one press
  keeps against another's over the same answers (:func:`entry_shares`).

The other regimes modules import this; it imports neither of them.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys

import numpy as np
import pandas as pd

from kvpress_phase.evaluation.config import SETTINGS
from kvpress_phase.evaluation.merging import RunInfo, read_runs
from kvpress_phase.evaluation.metrics import permutation_p_value
from kvpress_phase.evaluation.presses import parse_press_spec
from kvpress_phase.evaluation.store import RESULTS_DIR, saved_config

from studies.common import model_files, read_summaries

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
BASELINES = ("snapkv", "knorm", "streaming_llm", "chunkkv", "chunk", "expected_attention", "tova", "keydiff",
             "pyramidkv", "kvzip", "kvzip_plus", "adakv", "kvzap", "dms_kvzap")
"""The 14 kvpress baselines the round registered (every one registered then, in the registry's order): the best
baseline of a cell is the best of them (ties: the first here). Baselines registered since are not in this round."""

CELL = ["model", "setting", "task", "context_length", "compression_ratio"]
TEXT = CELL + ["stride", "sample_id"]
SETTING_NAMES = {SETTINGS[False]: "query-agnostic", SETTINGS[True]: "query-aware"}

PRESSES = ("no_press", MATCHED, REFERENCE, SHARE_HEADS, D, G, G_FLOOR, T, "snapkv", "knorm", "streaming_llm",
           "chunkkv", "chunk", "expected_attention", "tova", "keydiff", "pyramidkv", "kvzip", "kvzip_plus", "adakv",
           "kvzap", "dms_kvzap")
"""The presses every dev run answers (the pre-registration's ``P``)."""


@dataclasses.dataclass(frozen=True)
class Design:
    """What the dev round plans: a run per model, setting, stride (with its seed) and context length, each answering
    ``samples`` per phase of every task at every ratio with every press; ``samples_by_run`` gives runs planned with
    another count (``((model, setting, stride, length), samples)``: the round's first run, begun before the
    pre-registration's deviation 1 and finished as begun, answers 8)."""

    models: tuple = ("smollm2", "qwen2.5-coder-0.5b")
    settings: tuple = (SETTINGS[False], SETTINGS[True])
    stride_seeds: tuple = ((8, 10), (12, 15))
    lengths: tuple = (1024, 2048)
    tasks: tuple = ("niah_single", "niah_multikey", "niah_multivalue")
    ratios: tuple = (0.25, 0.5, 0.75)
    samples: int = 3
    presses: tuple = PRESSES
    samples_by_run: tuple = ((("smollm2", SETTINGS[False], 8, 1024), 8),)

    @property
    def strides(self) -> tuple:
        return tuple(s for s, _ in self.stride_seeds)

    def slots(self) -> list[tuple]:
        """Every planned run: (model, setting, stride, context length)."""
        return list(itertools.product(self.models, self.settings, self.strides, self.lengths))

    def samples_of(self, slot: tuple) -> int:
        """The samples per phase the planned run ``slot`` (model, setting, stride, length) answers."""
        return dict(self.samples_by_run).get(tuple(slot), self.samples)

    def cells_per_ratio(self) -> int:
        """Dev cells of one ratio, both models together (24)."""
        return len(self.models) * len(self.settings) * len(self.tasks) * len(self.lengths)

    def texts_per_cell(self, model: str, setting: str, length: int) -> int:
        """Texts of one dev cell: the samples of its runs at both strides."""
        return sum(self.samples_of((model, setting, s, length)) for s in self.strides)

    def phases_per_cell(self, model: str, setting: str, length: int) -> int:
        """Answers of one press in one dev cell: a text per sample and stride, each at every phase of its stride."""
        return sum(self.samples_of((model, setting, s, length)) * s for s in self.strides)

    def texts_planned(self, model=None) -> int:
        """Texts of one ratio's cells, of ``model`` or of every model (the same at every ratio)."""
        models = self.models if model is None else (model,)
        return sum(self.texts_per_cell(m, st, n) * len(self.tasks)
                   for m in models for st in self.settings for n in self.lengths)

    def planned_answers(self, slot: tuple) -> int:
        """Answers the planned run ``slot`` (model, setting, stride, length) holds when finished."""
        compressing = sum(p != "no_press" for p in self.presses)
        return self.samples_of(slot) * len(self.tasks) * slot[2] * (int("no_press" in self.presses)
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
    slot = (info.model, SETTINGS[bool(config.get("compress_question"))], stride, length)
    checks = [("tasks", sorted(config.get("tasks") or []), sorted(design.tasks)),
              ("compression ratios", sorted(float(r) for r in config.get("compression_ratios") or []),
               sorted(design.ratios)),
              ("samples", config.get("samples"), design.samples_of(slot)),
              ("presses", sorted(parse_press_spec(p).label for p in config.get("presses") or []),
               sorted(design.presses)),
              ("protocol", config.get("protocol"), "offset"),
              ("matched cache", bool(config.get("matched_cache")), True)]
    for what, have, want in checks:
        if have != want:
            raise refuse(what, have, want)
    return slot


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
        planned = design.planned_answers(slot)
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


def pooled_phase_tests(records: pd.DataFrame, presses: tuple = OURS) -> pd.DataFrame:
    """Rule 1's pooled phase tests (the pre-registration's deviation 2): per model, stride and press, the
    evaluation's within-text permutation test (:func:`~kvpress_phase.evaluation.metrics.permutation_p_value`) over
    every compressed text of that stride in the round (its rows: setting, task, length, ratio and sample; its
    columns: the phases), the texts that answered every phase. A phase that is weak in every cell shows here where
    3 texts a test cannot show it."""
    columns = ["model", "stride", "press", "texts", "p_value"]
    if not len(records):
        return pd.DataFrame(columns=columns)
    part = records[(records.compression_ratio > 0) & records.press.isin(presses)]
    rows = []
    for (model, stride, press), block in part.groupby(["model", "stride", "press"]):
        matrix = block.pivot_table(index=["setting", "task", "context_length", "compression_ratio", "sample_id"],
                                   columns="phase", values="score", aggfunc="mean").dropna()
        p = permutation_p_value(matrix.to_numpy(), rng=np.random.default_rng(0)) if len(matrix) else float("nan")
        rows.append({"model": model, "stride": int(stride), "press": press, "texts": len(matrix), "p_value": p})
    return pd.DataFrame(rows, columns=columns)


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
    for model, path in model_files(specs, design.models, "--cost").items():
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
