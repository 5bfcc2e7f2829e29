"""The answer store: results shards (one JSONL file per rank under ``<output_dir>/results/``), how they are read
and resumed, and the operating-system lock that keeps one writer per shard (see :mod:`.runner`'s docstring).
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from typing import Optional

import pandas as pd

from .config import SETTINGS

RESULTS_DIR = "results"


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


def _read_shard(path: str, *, resume: bool = False) -> list[dict]:
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


def read_results(output_dir: str) -> pd.DataFrame:
    """All shards of a run, deduplicated by example key and sorted deterministically.

    Read only: the shards are never changed. A line that holds no record is skipped with a :class:`ShardWarning`
    naming the file and line (see :func:`_read_shard` for the rule on a last line without a newline).
    """
    folder = os.path.join(output_dir, RESULTS_DIR)
    records = []
    if os.path.isdir(folder):
        for name in sorted(os.listdir(folder)):
            if name.endswith(".jsonl"):
                records.extend(_read_shard(os.path.join(folder, name)))
    if not records:
        return pd.DataFrame()
    df = pd.DataFrame(records).drop_duplicates("key", keep="first")
    if "setting" not in df:
        df["setting"] = SETTINGS[False]
    df["setting"] = df["setting"].fillna(SETTINGS[False])  # runs from before the setting existed
    order = ["task", "context_length", "stride", "window_sort", "protocol", "setting", "sample_id", "phase",
             "press", "compression_ratio"]
    df["window_sort"] = df["window"].astype(float).fillna(0.0)
    return df.sort_values(order, kind="stable").drop(columns="window_sort").reset_index(drop=True)


# ------------------------------------------------------------------------------------------------ one writer
class OutputDirInUse(ValueError):
    """Another process is writing to the same output directory (and shard)."""


_HELD_LOCKS: dict = {}  # lock path -> [FileLock, depth]: the lock is re-entrant within a process


def lock_path(output_dir: str, rank: int = 0) -> str:
    return os.path.join(os.path.abspath(output_dir), f".kvpress-phase-rank{rank}.lock")


@contextlib.contextmanager
def output_lock(output_dir: str, rank: int = 0):
    """Hold the lock of ``output_dir``'s shard ``rank``, or raise :class:`OutputDirInUse` at once.

    An operating-system file lock (``flock`` through ``filelock``): it is released when the holder exits, even when
    it is killed, so a stale lock file never blocks a resume. Re-entrant within one process.
    """
    from filelock import FileLock, Timeout

    path = lock_path(output_dir, rank)
    held = _HELD_LOCKS.get(path)
    if held is None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        lock = FileLock(path, timeout=0)
        try:
            lock.acquire()
        except Timeout:
            raise OutputDirInUse(
                f"output directory {output_dir!r} is in use by another run (lock {path}); wait for it to finish "
                "or use another --output-dir"
            ) from None
        held = _HELD_LOCKS[path] = [lock, 0]
    held[1] += 1
    try:
        yield
    finally:
        held[1] -= 1
        if held[1] == 0:
            del _HELD_LOCKS[path]
            held[0].release()


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
