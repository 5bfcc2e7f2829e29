"""``kvpress-phase pack``: a finished run's shards into one Parquet file with every field of every answer, checked
before anything is removed; readers read packed runs as they read shards; eval does not resume into one."""

from __future__ import annotations

import json
import os
import shutil

import pandas as pd
import pytest

from kvpress_phase import cli
from kvpress_phase.evaluation.merging import read_runs
from kvpress_phase.evaluation.store import PACKED, RESULTS_DIR, pack_run, read_results

TINY = ["--tasks", "niah_single", "--presses", "no_press,phase_aware", "--strides", "4", "--phases", "0,1",
        "--context-lengths", "64", "--samples", "2", "--no-diagnostics", "--device", "cpu", "--no-progress",
        "--bootstrap", "100"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished run of the built-in model (never written by the tests: copy it)."""
    out = tmp_path_factory.mktemp("run") / "A"
    assert cli.main(["eval", *TINY, "--output-dir", str(out)]) == 0
    return out


def _copy(run, tmp_path, name="run"):
    target = tmp_path / name
    shutil.copytree(run, target)
    return target


def _shard(run):
    return run / RESULTS_DIR / "results-rank0.jsonl"


def test_a_packed_run_round_trips_every_field_of_every_answer(finished, tmp_path, capsys):
    run = _copy(finished, tmp_path)
    records = [json.loads(line) for line in _shard(run).read_text().splitlines()]
    before = read_results(str(run))
    assert cli.main(["pack", str(run)]) == 0
    assert "8 answers packed" in capsys.readouterr().out
    assert not _shard(run).exists() and not (run / "results.csv").exists()
    back = pd.read_parquet(run / RESULTS_DIR / PACKED).to_dict("records")
    assert len(back) == len(records)
    for original, packed in zip(records, back):
        for field, value in original.items():
            assert packed[field] == value or (value is None and pd.isna(packed[field])), field
    pd.testing.assert_frame_equal(read_results(str(run)), before)


def test_report_reads_a_packed_run_as_it_read_the_shards(finished, tmp_path):
    run = _copy(finished, tmp_path)
    merged_before, _, _ = read_runs([str(run)])
    pack_run(str(run))
    merged_after, infos, _ = read_runs([str(run)])
    pd.testing.assert_frame_equal(merged_after, merged_before)
    assert not infos[0].incomplete
    assert cli.main(["report", str(run), "--output-dir", str(tmp_path / "merged"), "--bootstrap", "100"]) == 0


def test_eval_does_not_resume_into_a_packed_run(finished, tmp_path, capsys):
    run = _copy(finished, tmp_path)
    pack_run(str(run))
    capsys.readouterr()
    assert cli.main(["eval", *TINY, "--output-dir", str(run)]) == 2
    assert "holds a packed run" in capsys.readouterr().err
    assert sorted(os.listdir(run / RESULTS_DIR)) == [PACKED]


def test_an_incomplete_run_is_packed_only_on_request(finished, tmp_path, capsys):
    run = _copy(finished, tmp_path)
    lines = _shard(run).read_text().splitlines(keepends=True)
    _shard(run).write_text("".join(lines[:5]))
    capsys.readouterr()
    assert cli.main(["pack", str(run)]) == 2
    assert "holds 5 of 8 planned answers" in capsys.readouterr().err
    assert _shard(run).exists()
    assert cli.main(["pack", "--incomplete", str(run)]) == 0
    assert len(read_results(str(run))) == 5


def test_a_shard_with_an_unreadable_line_is_not_packed_and_left_as_it_is(finished, tmp_path, capsys):
    run = _copy(finished, tmp_path)
    text = _shard(run).read_text()
    _shard(run).write_text(text + "not json\n")
    capsys.readouterr()
    assert cli.main(["pack", str(run)]) == 2
    assert "unreadable" in capsys.readouterr().err
    assert _shard(run).read_text() == text + "not json\n" and not (run / RESULTS_DIR / PACKED).exists()


def test_packing_twice_or_a_folder_without_shards_is_refused(finished, tmp_path, capsys):
    run = _copy(finished, tmp_path)
    pack_run(str(run))
    with pytest.raises(ValueError, match="packed already"):
        pack_run(str(run))
    with pytest.raises(ValueError, match="no results shards"):
        pack_run(str(tmp_path))


# ------------------------------------------------------------------------------------------------ drop
@pytest.mark.parametrize("packed", [False, True], ids=["shards", "packed"])
def test_dropped_answers_are_kept_aside_and_a_resume_answers_them_again(finished, tmp_path, capsys, packed):
    run = _copy(finished, tmp_path)
    before = read_results(str(run))
    if packed:
        pack_run(str(run))
    assert cli.main(["drop", str(run), "--presses", "phase_aware"]) == 0
    assert "dropped 4 of phase_aware" in capsys.readouterr().out
    assert not (run / RESULTS_DIR / PACKED).exists()  # eval resumes only into shards
    left = read_results(str(run))
    assert set(left.press) == {"no_press"} and len(left) == 4
    aside = pd.read_parquet(run / RESULTS_DIR / "dropped" / "1.parquet")
    assert sorted(aside.key) == sorted(before[before.press == "phase_aware"].key)
    assert cli.main(["eval", *TINY, "--output-dir", str(run)]) == 0  # the run's own command resumes it
    pd.testing.assert_frame_equal(read_results(str(run)), before)


def test_drop_refuses_a_press_the_run_has_no_answer_of_and_changes_nothing(finished, tmp_path, capsys):
    run = _copy(finished, tmp_path)
    shard = _shard(run).read_bytes()
    assert cli.main(["drop", str(run), "--presses", "phase_aware,snapkv"]) == 2
    err = capsys.readouterr().err
    assert "no answers of snapkv" in err and "no_press, phase_aware" in err
    assert _shard(run).read_bytes() == shard and not (run / RESULTS_DIR / "dropped").exists()


def test_drop_refuses_a_folder_with_both_shards_and_a_packed_file(finished, tmp_path, capsys):
    run = _copy(finished, tmp_path)
    shard = _shard(run).read_bytes()
    pack_run(str(run))
    _shard(run).write_bytes(shard)
    assert cli.main(["drop", str(run), "--presses", "phase_aware"]) == 2
    assert "both shards and" in capsys.readouterr().err
    assert (run / RESULTS_DIR / PACKED).exists() and _shard(run).read_bytes() == shard
