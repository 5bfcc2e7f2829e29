"""Results shards are never cut by a reader, a resume cuts only a torn last line (kept in ``.cut``), and a run that
fails before writing anything leaves nothing behind."""

from __future__ import annotations

import json
import os
import shutil

import pandas as pd
import pytest

from kvpress_phase import cli
from kvpress_phase.evaluation.store import RESULTS_DIR, ShardWarning, lock_path, read_results, removed_if_failed_empty

N_RECORDS = 2 * 4 * 2  # samples x phases x presses



def _eval_args(model_dir, out):
    return ["eval", "--model", model_dir, "--tasks", "niah_single", "--presses", "no_press,chunked_stride",
            "--strides", "4", "--context-lengths", "128", "--samples", "2", "--output-dir", str(out),
            "--no-progress", "--bootstrap", "100", "--no-diagnostics"]


@pytest.fixture(scope="module")
def finished_run(model_dir, tmp_path_factory):
    """A real run of the command, and the lines of its shard (one record each)."""
    out = tmp_path_factory.mktemp("runs") / "finished"
    assert cli.main(_eval_args(model_dir, out)) == 0
    with open(_shard(out), "rb") as fh:
        lines = fh.readlines()
    assert len(lines) == N_RECORDS and all(line.endswith(b"\n") for line in lines)
    return out, lines


def _shard(run):
    return os.path.join(run, RESULTS_DIR, "results-rank0.jsonl")


def _copy_with_shard(finished_run, tmp_path, content: bytes):
    """A copy of the finished run whose shard holds ``content``."""
    run = tmp_path / "copy"
    shutil.copytree(finished_run[0], run)
    with open(_shard(run), "wb") as fh:
        fh.write(content)
    return run


def _keys(lines) -> list[str]:
    return [json.loads(line)["key"] for line in lines]


def _warning_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("kvpress-phase: warning:")]


def test_report_leaves_a_corrupt_shard_as_it_is_and_uses_every_valid_record(finished_run, tmp_path, capsys):
    lines = finished_run[1]
    content = b"".join(lines[:3]) + b'{"garbage\n' + b"".join(lines[3:9]) + b"[1, 2]\n" + b"".join(lines[9:])
    run = _copy_with_shard(finished_run, tmp_path, content)
    capsys.readouterr()
    assert cli.main(["report", str(run), "--output-dir", str(tmp_path / "rep")]) == 0
    with open(_shard(run), "rb") as fh:
        assert fh.read() == content  # byte-identical: the report wrote nothing into the run
    assert not os.path.exists(_shard(run) + ".cut")
    reported = pd.read_csv(tmp_path / "rep" / "results.csv")
    assert sorted(reported["key"]) == sorted(_keys(lines))
    warned = _warning_lines(capsys.readouterr().err)
    assert len(warned) == 1  # one line for the file, naming both bad lines
    assert _shard(run) in warned[0] and "2 unreadable lines" in warned[0] and "(lines 4, 11)" in warned[0]


def test_read_results_names_the_bad_line_and_keeps_the_records_after_it(finished_run, tmp_path):
    lines = finished_run[1]
    content = b"".join(lines[:5]) + b"\x00\x00\x00\n" + b"".join(lines[5:])
    run = _copy_with_shard(finished_run, tmp_path, content)
    with pytest.warns(ShardWarning, match=r"results-rank0\.jsonl: skipped 1 unreadable line \(line 6\)"):
        results = read_results(str(run))
    assert sorted(results["key"]) == sorted(_keys(lines))
    with open(_shard(run), "rb") as fh:
        assert fh.read() == content


def test_a_shard_cut_at_some_byte_loses_only_the_torn_record_with_a_warning(finished_run, tmp_path):
    lines = finished_run[1]
    whole = b"".join(lines)
    n = len(b"".join(lines[:8])) + len(lines[8]) // 2  # the middle of the 9th record
    run = _copy_with_shard(finished_run, tmp_path, whole[:n])
    with pytest.warns(ShardWarning, match=r"skipped 1 unreadable line \(line 9: the last, with no newline"):
        results = read_results(str(run))
    assert sorted(results["key"]) == sorted(_keys(lines[:8]))
    with open(_shard(run), "rb") as fh:
        assert fh.read() == whole[:n]
    # cut just before a newline: the last line is a complete record, and reading counts it
    run_b = _copy_with_shard(finished_run, tmp_path / "b", whole[:len(b"".join(lines[:9])) - 1])
    assert sorted(read_results(str(run_b))["key"]) == sorted(_keys(lines[:9]))


def test_resume_cuts_only_a_torn_last_line_and_keeps_every_valid_record(model_dir, finished_run, tmp_path, capsys):
    lines = finished_run[1]
    kept = b"".join(lines[:3]) + b'{"garbage\n' + b"".join(lines[3:10])  # a corrupt line in the middle
    torn = lines[10][: len(lines[10]) // 2]  # a write cut short at the end
    run = _copy_with_shard(finished_run, tmp_path, kept + torn)
    capsys.readouterr()
    assert cli.main(_eval_args(model_dir, run)) == 0
    err = capsys.readouterr().err
    with open(_shard(run), "rb") as fh:
        after = fh.read()
    assert after.startswith(kept)  # the valid records and the corrupt line are where they were
    with open(_shard(run) + ".cut", "rb") as fh:
        assert fh.read() == torn + b"\n"  # what was cut is kept beside the shard
    new = after[len(kept):].splitlines(keepends=True)
    assert len(new) == N_RECORDS - 10 and all(line.endswith(b"\n") and json.loads(line) for line in new)
    valid = lines[:10] + new
    assert sorted(_keys(valid)) == sorted(_keys(lines))  # every example once: no valid record recomputed
    warned = _warning_lines(err)
    assert any("line 12 is a torn write" in w and _shard(run) in w for w in warned)
    assert any("skipped 1 unreadable line (line 4)" in w for w in warned)
    assert len(warned) == len(set(warned)) == 2


def test_resume_treats_a_valid_last_line_without_newline_as_torn(model_dir, finished_run, tmp_path, capsys):
    lines = finished_run[1]
    head = b"".join(lines[:5])
    run = _copy_with_shard(finished_run, tmp_path, head + lines[5].rstrip(b"\n"))
    with open(_shard(run) + ".cut", "wb") as fh:
        fh.write(b"cut by an earlier resume\n")
    capsys.readouterr()
    assert cli.main(_eval_args(model_dir, run)) == 0
    assert [w for w in _warning_lines(capsys.readouterr().err) if "line 6 is a torn write" in w]
    with open(_shard(run), "rb") as fh:
        after = fh.read()
    assert after.startswith(head)
    new = after[len(head):].splitlines(keepends=True)
    assert len(new) == N_RECORDS - 5 and all(json.loads(line) for line in new)  # each record on its own line
    assert sorted(_keys(lines[:5] + new)) == sorted(_keys(lines))
    with open(_shard(run) + ".cut", "rb") as fh:
        assert fh.read() == b"cut by an earlier resume\n" + lines[5]  # appended to, never overwritten


def test_a_model_that_fails_to_load_leaves_no_directory_or_lock(tmp_path, capsys):
    missing = str(tmp_path / "no-such-model")
    out = tmp_path / "new" / "run"
    assert cli.main(["eval", "--model", missing, "--output-dir", str(out), "--no-progress"]) == 2
    assert "cannot be loaded" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()  # the folders the run made are gone
    given = tmp_path / "given"
    given.mkdir()
    assert cli.main(["eval", "--model", missing, "--output-dir", str(given), "--no-progress"]) == 2
    assert given.is_dir() and os.listdir(given) == []  # a folder the user made stays, without the lock file


def test_a_failed_run_keeps_a_directory_that_holds_results(finished_run, tmp_path):
    run = tmp_path / "copy"
    shutil.copytree(finished_run[0], run)
    before = {name: (run / name).read_bytes() for name in ("config.json", f"{RESULTS_DIR}/results-rank0.jsonl")}
    assert cli.main(["eval", "--model", str(tmp_path / "no-such-model"), "--output-dir", str(run)]) == 2
    assert {name: (run / name).read_bytes() for name in before} == before
    # and the removal itself: only what the failed block created, only while no shard holds a result
    fresh = tmp_path / "fresh"
    with pytest.raises(RuntimeError):
        with removed_if_failed_empty(str(fresh)):
            os.makedirs(fresh / RESULTS_DIR)
            open(lock_path(str(fresh)), "w").close()
            (fresh / "config.json").write_text("{}")
            open(fresh / RESULTS_DIR / "results-rank0.jsonl", "w").close()
            raise RuntimeError("model failed")
    assert not fresh.exists()
    with pytest.raises(RuntimeError):
        with removed_if_failed_empty(str(fresh)):
            os.makedirs(fresh / RESULTS_DIR)
            (fresh / "config.json").write_text("{}")
            (fresh / RESULTS_DIR / "results-rank0.jsonl").write_text('{"key": "a"}\n')
            raise RuntimeError("killed after the first result")
    assert (fresh / "config.json").exists() and (fresh / RESULTS_DIR / "results-rank0.jsonl").exists()
