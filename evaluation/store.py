"""The answer store: results shards (one JSONL file per rank under ``<output_dir>/results/``), how they are read
and resumed, the packed form of a finished run (``results/answers.parquet``, :func:`pack_run`) and answers taken out
of one (:func:`drop_answers`). The lock that keeps one writer per shard is :mod:`.locking`'s; several runs are read
as one by :mod:`.merging`.

Answers are loaded under today's press labels: :func:`read_results` reads every label through the alias table of
:mod:`.spellings` (a label written as ``phase_aware:allocate=layers`` reads ``layer_budget``), and the files are
never rewritten for it.

A run in progress appends to its JSON-lines shards (crash-safe, resumable); a finished run is packed once into one
Parquet file that holds every field of every answer (read with pandas, pyarrow or
``datasets.load_dataset("parquet", data_files=...)``), about a tenth of the shards' size. Readers read both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import warnings
from typing import Optional

import pandas as pd

from .config import SETTINGS
from .locking import OutputDirInUse, lock_path, output_lock  # noqa: F401 (imported from here too)
from .spellings import canonical_key, canonical_label, canonical_records

RESULTS_DIR = "results"
PACKED = "answers.parquet"
"""The packed answers of a finished run, in ``<output_dir>/results/`` (:func:`pack_run`)."""


def packed_path(output_dir: str) -> str:
    return os.path.join(output_dir, RESULTS_DIR, PACKED)


# ------------------------------------------------------------------------------------------------ shards
class ShardWarning(UserWarning):
    """Lines of a results shard that hold no record (skipped), or a torn last line cut off by a resume."""


def _parse_record(raw: bytes) -> Optional[dict]:
    """The record on one shard line: a JSON object with a ``key``; None for anything else."""
    try:
        record = json.loads(raw)
    except ValueError:  # JSONDecodeError, and UnicodeDecodeError for bytes that are not UTF-8
        return None
    return record if isinstance(record, dict) and isinstance(record.get("key"), str) else None


def read_shard(path: str, *, resume: bool = False) -> list[dict]:
    """The records of a JSONL shard: every line that holds a JSON object with a ``key``.

    Any other line (not JSON, not an object, no key) is skipped, and the file's skipped lines are named by path
    and line number in one :class:`ShardWarning`; every valid record before and after them is used. Blank lines are
    ignored. Only the last line can lack its newline (a write cut short by a crash, or a copy cut at some byte):

    - ``resume=False`` (reading, as ``read_results`` and ``kvpress-phase report`` do) never changes the file: such a
      last line is a record when it holds a complete JSON object with a key, and skipped (and named) otherwise.
    - ``resume=True`` (a run resuming into its own shard, under the shard's lock) treats such a line as a torn
      write whatever it holds: it is cut off the file and appended to ``<path>.cut`` (a warning says so), and its
      example is computed again. This is the only change ever made to a shard: other unreadable lines stay where
      they are, and the shard ends with a newline, so the records appended next start on a line of their own.
    """
    if not os.path.exists(path):
        return []
    records, skipped, torn, size = [], [], None, 0
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, 1):
            if resume and not raw.endswith(b"\n"):
                torn = number, raw
                break
            size += len(raw)
            record = _parse_record(raw)
            if record is not None:
                records.append(record)
            elif raw.strip():
                last = "" if raw.endswith(b"\n") else ": the last, with no newline, a write cut short or under way"
                skipped.append(f"{number}{last}")
    if torn is not None:
        number, raw = torn
        with open(path + ".cut", "ab") as cut:  # kept, never lost: appended to what earlier resumes cut
            cut.write(raw + b"\n")
        with open(path, "r+b") as fh:
            fh.truncate(size)
        warnings.warn(f"{path}: line {number} is a torn write (no newline at the end of the file); moved to "
                      f"{path}.cut, its example is run again", ShardWarning, stacklevel=2)
    if skipped:
        named = ", ".join(skipped[:20])
        named += f" and {len(skipped) - 20} more" if len(skipped) > 20 else ""
        lines = "lines" if len(skipped) > 1 else "line"
        warnings.warn(f"{path}: skipped {len(skipped)} unreadable {lines} ({lines} {named}); the file is left as it is",
                      ShardWarning, stacklevel=2)
    return records


def record_key(record: dict) -> str:
    fields = ("task", "context_length", "stride", "window", "protocol", "sample_id", "phase", "press",
              "compression_ratio")
    key = "|".join(str(record[f]) for f in fields)
    setting = record.get("setting", SETTINGS[False])
    return key if setting == SETTINGS[False] else f"{key}|{setting}"  # keys of earlier runs stay valid


def today_key(record: dict) -> str:
    """The key of a stored answer with its press under today's label (:func:`~.spellings.canonical_key`): what a
    run resuming into its shard compares with the keys it plans."""
    return canonical_key(record["key"], record["press"])


def read_results(output_dir: str) -> pd.DataFrame:
    """All shards of a run, under today's press labels, deduplicated by example key and sorted deterministically.

    Read only: the shards are never changed. A line that holds no record is skipped with a :class:`ShardWarning`
    naming the file and line (see :func:`read_shard` for the rule on a last line without a newline). A packed run's
    answers (:func:`pack_run`) are read from its Parquet file. Every ``press`` label and the ``key`` that holds it
    are read through the alias table (:func:`~.spellings.canonical_records`), so an answer reads the same whichever
    spelling of its press the run was written under.
    """
    folder = os.path.join(output_dir, RESULTS_DIR)
    records = _read_packed(packed_path(output_dir))
    if os.path.isdir(folder):
        for name in sorted(os.listdir(folder)):
            if name.endswith(".jsonl"):
                records.extend(read_shard(os.path.join(folder, name)))
    if not records:
        return pd.DataFrame()
    df = canonical_records(pd.DataFrame(records)).drop_duplicates("key", keep="first")
    if "setting" not in df:
        df["setting"] = SETTINGS[False]
    df["setting"] = df["setting"].fillna(SETTINGS[False])  # runs from before the setting existed
    order = ["task", "context_length", "stride", "window_sort", "protocol", "setting", "sample_id", "phase",
             "press", "compression_ratio"]
    df["window_sort"] = df["window"].astype(float).fillna(0.0)
    return df.sort_values(order, kind="stable").drop(columns="window_sort").reset_index(drop=True)


def _read_packed(path: str) -> list[dict]:
    """The records of a packed run (a field a record did not have reads as None, as a null it held does)."""
    if not os.path.exists(path):
        return []
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


def _shard_paths(output_dir: str) -> list[str]:
    folder = os.path.join(output_dir, RESULTS_DIR)
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".jsonl")) \
        if os.path.isdir(folder) else []


def _same(a, b) -> bool:
    """Equal values as JSON holds them (NaN equals NaN; numbers by value; lists and dicts element by element; a field
    missing from one dict equals a null in the other, which Parquet cannot tell apart)."""
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):  # a missing field is a null
        return all(_same(a.get(k), b.get(k)) for k in a.keys() | b.keys())
    numbers = (int, float)
    if isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool) and not isinstance(b, bool):
        return a == b  # a column of ints and floats is stored as floats: 1024 and 1024.0 are the same answer
    return type(a) is type(b) and a == b


def _write_parquet_checked(records: list, target: str, what: str) -> None:
    """Write ``records`` to the Parquet file ``target`` through a temporary file that is read back and compared
    record by record (:func:`_same`) before it takes ``target``'s name; ValueError naming ``what``, and nothing
    written, when Parquet cannot hold them exactly."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tmp = target + ".tmp"
    try:
        pq.write_table(pa.Table.from_pylist(records), tmp, compression="zstd")
        back = _read_packed(tmp)
    except (pa.ArrowException, TypeError, ValueError) as exc:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise ValueError(f"{what}: its records cannot be stored in Parquet as they are ({exc})") from None
    bad = next((i for i, (a, b) in enumerate(zip(records, back)) if not _same(a, b)), None)
    if len(back) != len(records) or bad is not None:
        os.remove(tmp)
        where = f"record {bad} ({records[bad]['key']})" if bad is not None else "the record count"
        raise ValueError(f"{what}: the Parquet copy differs from the records at {where}; nothing removed")
    os.replace(tmp, target)


@dataclasses.dataclass
class Packed:
    """What :func:`pack_run` did: answers packed, shard bytes before, Parquet bytes after, files removed."""

    answers: int
    shard_bytes: int
    packed_bytes: int
    removed: list


def pack_run(output_dir: str, *, incomplete: bool = False) -> Packed:
    """Pack a finished run: every record of every shard (duplicates included, in shard order) into
    ``results/answers.parquet``, read back and compared field by field with the shards, and only then the shards and
    the merged ``results.csv`` (which ``results.parquet`` duplicates) removed.

    ValueError, leaving everything as it was, for a folder without shards, a shard with an unreadable line (it
    would be lost), a run already packed, a run holding fewer answers than it planned (unless ``incomplete``: a run
    abandoned on purpose), a record that Parquet cannot hold exactly, or a folder another process is writing."""
    if os.path.exists(packed_path(output_dir)):
        raise ValueError(f"{output_dir!r} is packed already ({packed_path(output_dir)})")
    shards = _shard_paths(output_dir)
    if not shards:
        raise ValueError(f"{output_dir!r} holds no results shards (results/*.jsonl) to pack")
    with output_lock(output_dir), warnings.catch_warnings():
        warnings.simplefilter("error", ShardWarning)  # an unreadable line would be lost: refuse instead
        try:
            records = [r for path in shards for r in read_shard(path)]
        except ShardWarning as exc:
            raise ValueError(f"{exc}; pack keeps every line, so it packs only shards without unreadable lines") \
                from None
        config = saved_config(output_dir)
        planned = _planned(config) if config is not None else None
        answers = len({r["key"] for r in records})
        if planned is not None and answers < planned and not incomplete:
            raise ValueError(f"{output_dir!r} holds {answers} of {planned} planned answers: resume it with its "
                             "`kvpress-phase eval` command first, or pack it as it is with --incomplete")
        target = packed_path(output_dir)
        _write_parquet_checked(records, target, f"{output_dir!r}")
        size = sum(os.path.getsize(p) for p in shards)
        removed = list(shards)
        merged_csv = os.path.join(output_dir, "results.csv")
        if os.path.exists(merged_csv):
            removed.append(merged_csv)
        for path in removed:
            os.remove(path)
    return Packed(len(records), size, os.path.getsize(target), removed)


@dataclasses.dataclass
class Dropped:
    """What :func:`drop_answers` did: answers dropped per press label, answers kept, where the dropped ones went."""

    dropped: dict
    kept: int
    saved_to: str


DROPPED_DIR = "dropped"
"""Where :func:`drop_answers` keeps the answers it took out of a run (``results/dropped/``; readers skip it)."""


def drop_answers(output_dir: str, presses: list) -> Dropped:
    """Take every answer of the press labels ``presses`` (today's labels, as :func:`read_results` reads them; a
    former spelling is read through the alias table) out of a run, so that resuming the run with its own
    ``kvpress-phase eval`` command answers them again with today's code (a press found faulty after the run).

    Nothing is lost: the dropped records go to ``results/dropped/<n>.parquet`` (read back and compared first), and
    the kept ones stay where they were, or, for a packed run, go back to one JSON-lines shard (read back and compared
    before the Parquet file is removed), since ``eval`` resumes only into shards. ValueError, changing nothing, for a
    folder without answers, a label the run has no answer of (the run's labels are named), a folder holding both
    shards and a packed file, or a folder another process is writing."""
    wanted = list(dict.fromkeys(canonical_label(p) for p in presses))
    if not wanted:
        raise ValueError("name at least one press label to drop")
    with output_lock(output_dir), warnings.catch_warnings():
        warnings.simplefilter("error", ShardWarning)
        packed = packed_path(output_dir)
        shards = _shard_paths(output_dir)
        try:
            sources = [(path, read_shard(path)) for path in shards]
        except ShardWarning as exc:
            raise ValueError(f"{exc}; drop rewrites whole shards, so it needs shards without unreadable lines") \
                from None
        if os.path.exists(packed):
            if shards:  # eval never resumes into a packed run, so this is not a folder the tools wrote
                raise ValueError(f"{output_dir!r} holds both shards and {PACKED}; drop handles one or the other")
            sources.append((packed, _read_packed(packed)))
        today = {r["press"]: canonical_label(r["press"]) for _, records in sources for r in records}
        labels = sorted(set(today.values()))
        if not labels:
            raise ValueError(f"{output_dir!r} holds no answers (results/*.jsonl or results/{PACKED})")
        unknown = [p for p in wanted if p not in labels]
        if unknown:
            raise ValueError(f"{output_dir!r} has no answers of {', '.join(unknown)}; its presses: "
                             f"{', '.join(labels)}")
        gone = [r for _, records in sources for r in records if today[r["press"]] in wanted]
        folder = os.path.join(output_dir, RESULTS_DIR, DROPPED_DIR)
        os.makedirs(folder, exist_ok=True)
        saved = os.path.join(folder, f"{len(os.listdir(folder)) + 1}.parquet")
        _write_parquet_checked(gone, saved, f"{output_dir!r}, the answers to drop")
        kept = 0
        for path, records in sources:
            keep = [r for r in records if today[r["press"]] not in wanted]
            kept += len(keep)
            if len(keep) == len(records):
                continue
            target = path if path != packed else os.path.join(output_dir, RESULTS_DIR, "results-rank0.jsonl")
            tmp = target + ".tmp"
            with open(tmp, "w") as fh:
                fh.writelines(json.dumps(r) + "\n" for r in keep)
            back = read_shard(tmp)
            if len(back) != len(keep) or not all(_same(a, b) for a, b in zip(keep, back)):
                os.remove(tmp)
                raise ValueError(f"{output_dir!r}: {path} could not be rewritten exactly; it is left as it is")
            os.replace(tmp, target)
            if path == packed:
                os.remove(packed)
        counts = {p: sum(today[r["press"]] == p for r in gone) for p in wanted}
    return Dropped(counts, kept, saved)


def saved_config(output_dir: str) -> Optional[dict]:
    """The configuration ``eval`` saved in ``<output_dir>/config.json`` (read only); None when there is none.
    ValueError naming the file when it is not such a configuration."""
    path = os.path.join(output_dir, "config.json")
    if not os.path.exists(path):
        return None
    try:
        with open(path) as fh:
            saved = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} cannot be read as the configuration of `kvpress-phase eval`: {exc}") from None
    config = saved.get("config") if isinstance(saved, dict) else None
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds no configuration of `kvpress-phase eval` (no \"config\" object)")
    return config


def _planned(config: dict) -> Optional[int]:
    from .config import from_saved, planned_answers

    try:
        return planned_answers(from_saved(config))
    except (TypeError, ValueError, KeyError):  # a press or task that no longer exists: the plan is unknown
        return None


# ------------------------------------------------------------------------------------------------ a failed run
@contextlib.contextmanager
def removed_if_failed_empty(output_dir: str, rank: int = 0):
    """Undo what a failed run created in ``output_dir`` when it wrote no result (e.g. a model that fails to load).

    Entered before anything is created. When the block raises and no file in ``results/`` holds data, the shard's
    lock file, ``config.json`` (rank 0), an empty shard, ``results/``, ``output_dir`` and the parent folders made for
    it are removed, each only if it was not there when the block was entered and a folder only when empty. The
    removal holds the shard's lock; when another run holds it, nothing is removed.
    """
    results = os.path.join(output_dir, RESULTS_DIR)
    ours = [os.path.join(results, f"results-rank{rank}.jsonl"), lock_path(output_dir, rank)]
    ours += [os.path.join(output_dir, "config.json")] if rank == 0 else []
    ours += [results, output_dir]  # folders last, after the files in them, and the parents made for output_dir
    parent = os.path.dirname(os.path.abspath(output_dir))
    while not os.path.lexists(parent):
        ours.append(parent)
        parent = os.path.dirname(parent)
    created = [path for path in ours if not os.path.lexists(path)]
    try:
        yield
    except BaseException:
        wrote = os.path.isdir(results) and any(os.path.getsize(os.path.join(results, name))
                                               for name in os.listdir(results))
        if created and not wrote:
            with contextlib.suppress(OutputDirInUse, OSError), output_lock(output_dir, rank):
                for path in created:
                    with contextlib.suppress(OSError):  # a folder that is not empty stays
                        os.rmdir(path) if os.path.isdir(path) else os.remove(path)
        raise

