"""Several runs read as one: the answers of ``kvpress-phase eval`` run folders merged by model, seed and example
(:func:`read_runs`, what ``kvpress-phase report`` and the study scripts read), each run through
:func:`.store.read_results`."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

import pandas as pd

from .store import RESULTS_DIR, _planned, read_results, saved_config

UNKNOWN_MODEL = "unknown"
"""The model of a run folder without ``config.json`` (results written by other means): its answers merge only with
those of other such folders."""

ANSWER_FIELDS = ("answer", "prediction", "score")
"""The fields two copies of one answer must agree on to be the same answer (:func:`read_runs`)."""

CONSISTENT_FIELDS = ("dtype", "matched_cache")
"""Configuration fields that change the answers without changing their keys: the runs of one model merged by
:func:`read_runs` must agree on them."""


@dataclasses.dataclass
class RunInfo:
    """One run folder read by :func:`read_runs`: its model and seed (from ``config.json``), the answers it holds and
    the answers its configuration plans (None without a readable configuration)."""

    path: str
    model: str
    seed: Optional[int]
    answers: int
    planned: Optional[int]
    config: Optional[dict] = None

    @property
    def incomplete(self) -> bool:
        return self.planned is not None and self.answers < self.planned


def _seed_label(seed) -> str:
    return "-" if seed is None or pd.isna(seed) else str(int(seed))


def merge_key(record) -> str:
    """The key of one answer across runs: :func:`record_key`'s key (the run's own resume key, unchanged) after the
    run's model and seed, so that runs of other models or seeds never collapse into one answer."""
    return f"{record['model']}|{_seed_label(record.get('seed'))}|{record['key']}"


def _signatures(df: pd.DataFrame) -> pd.Series:
    """One string per row that is equal for two rows exactly when they agree on :data:`ANSWER_FIELDS`."""
    out = pd.Series("", index=df.index)
    for field in ANSWER_FIELDS:
        if field in df:
            out += "\x1f" + df[field].map(lambda x: json.dumps(None if not isinstance(x, (list, tuple)) and pd.isna(x)
                                                                else x, default=str))
    return out


def read_runs(runs: list[str]) -> tuple[pd.DataFrame, list[RunInfo], list[str]]:
    """The answers of several run folders merged, with ``model``, ``seed`` and ``run`` columns; the runs read; and
    one line per pair of runs that hold the same answers (collapsed into one).

    Read only. Answers are merged by :func:`merge_key` (model, seed and the example's key), so every answer of every
    model and seed is kept. An answer held by two runs is kept once when both copies agree (same answer, prediction
    and score), and a line says how many; copies that disagree, a folder without ``results/``, or two runs of one
    model that differ in a field of :data:`CONSISTENT_FIELDS` raise ValueError naming both runs. The model comes from
    the run's ``config.json`` (the default built-in model for runs saved before it was recorded, :data:`UNKNOWN_MODEL`
    without one), the seed from each record (or the configuration).
    """
    from kvpress_phase.builtin import DEFAULT_MODEL

    frames, infos = [], []
    for run in runs:
        if not os.path.isdir(os.path.join(run, RESULTS_DIR)):
            raise ValueError(f"{run!r} holds no results of `kvpress-phase eval` (no results/ folder)")
        config = saved_config(run)
        model = UNKNOWN_MODEL if config is None else str(config.get("model") or DEFAULT_MODEL)
        seed = config.get("seed") if config is not None else None
        df = read_results(run)
        if len(df):
            df["seed"] = df["seed"].where(df["seed"].notna(), seed) if "seed" in df else seed
            df["model"] = df["model"].fillna(model) if "model" in df else model
            df["run"] = run
            frames.append(df)
            if seed is None and df["seed"].nunique() == 1:
                seed = int(df["seed"].dropna().iloc[0])
        infos.append(RunInfo(run, model, seed, len(df), _planned(config) if config is not None else None, config))
    _check_consistent(infos)
    if not frames:
        return pd.DataFrame(), infos, []
    merged = pd.concat(frames, ignore_index=True)
    keys = merged["model"].astype(str) + "|" + merged["seed"].map(_seed_label) + "|" + merged["key"]
    later = keys.duplicated(keep="first")
    notes = []
    if later.any():
        copies = merged[later]
        kept = merged[~later & keys.isin(keys[later])].set_axis(keys[~later & keys.isin(keys[later])])
        kept = kept.loc[keys[later]]  # the copy kept of every later one, in the same order
        kept_runs, runs_of = kept["run"].to_numpy(), copies["run"].to_numpy()
        differs = _signatures(kept).to_numpy() != _signatures(copies).to_numpy()
        if differs.any():
            i = int(differs.argmax())
            n = int((differs & (kept_runs == kept_runs[i]) & (runs_of == runs_of[i])).sum())
            row = copies.iloc[i]
            raise ValueError(
                f"runs {kept_runs[i]!r} and {runs_of[i]!r} hold different answers to {n} of the same examples "
                f"(model {row['model']}, seed {_seed_label(row['seed'])}, e.g. {row['key']}): merge runs that answer "
                "different examples, or report them apart")
        pairs = pd.Series(1, index=pd.MultiIndex.from_arrays([kept_runs, runs_of])).groupby(level=[0, 1],
                                                                                           sort=False).sum()
        notes = [f"{b!r} is given more than once: its {n} answers are counted once"
                 if os.path.realpath(a) == os.path.realpath(b) else
                 f"{n} answers of {b!r} are also in {a!r}, identical (same model, seed and example): each is counted "
                 "once" for (a, b), n in pairs.items()]
        merged = merged[~later].copy()
    try:
        merged["seed"] = merged["seed"].astype("Int64")
    except (TypeError, ValueError):
        pass
    return merged.reset_index(drop=True), infos, notes


def _check_consistent(infos: list[RunInfo]) -> None:
    """ValueError naming two runs of one model whose configurations differ in a field of :data:`CONSISTENT_FIELDS`."""
    from .config import EvalConfig

    first: dict[tuple, tuple] = {}
    for info in infos:
        if info.config is None:
            continue
        for field in CONSISTENT_FIELDS:
            value = info.config.get(field, getattr(EvalConfig, field))
            seen = first.setdefault((info.model, field), (info.path, value))
            if seen[1] != value:
                raise ValueError(f"runs {seen[0]!r} and {info.path!r} ran model {info.model} with different {field} "
                                 f"({seen[1]} and {value}): their answers cannot be merged; report them apart")
