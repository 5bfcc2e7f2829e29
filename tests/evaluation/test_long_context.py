"""The long-context study's runner and tables (studies/long_context.py): the command matches the pre-registration,
the progress line, commits of the run folder alone, the tables' statistics under a flat truth, and the on-paper
memory against a measured figure."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from kvpress_phase.evaluation.config import planned_answers
from studies import long_context as lc
from studies import resumable


def test_the_command_is_the_preregistered_one():
    text = open(lc.PREREGISTRATION).read()
    config = resumable.eval_config(lc.eval_command(4096))
    config.validate()
    assert config.model == "qwen2.5-coder-0.5b" and config.dtype == "float32"
    assert config.seed == 91 and config.samples == 8 and config.strides == [4, 8] and config.windows == [8]
    assert config.compression_ratios == [0.5, 0.75] and config.protocol == "offset" and config.matched_cache
    assert "seed **91**" in text and "**8 samples per phase**" in text
    for press in lc.PRESSES:
        assert f"`{press}`" in text, press
    assert planned_answers(config) == lc.planned(4096) == 3264  # the pre-registration's count per length


def test_the_progress_line_counts_answers_and_the_time_left():
    estimate = lc.SECONDS_PER_TEXT[4096] * lc.TEXTS
    p = resumable.Progress("n4096", held=1000, planned=3264, packed=False, rate=None, estimate=estimate)
    assert p.left == 2264 and p.seconds_left == pytest.approx(estimate * 2264 / 3264)
    assert "n4096: 1,000 of 3,264 answers held, 2,264 left" in p.line() and "sizing's estimate" in p.line()
    measured = resumable.Progress("n4096", held=1000, planned=3264, packed=False, rate=2.0)
    assert measured.seconds_left == 1132 and "at its last rate" in measured.line()
    assert "unknown" in resumable.Progress("r", 0, 10, False, None).line()
    assert "finished, packed" in resumable.Progress("r", 3264, 3264, True, None).line()


def test_the_rate_is_read_from_the_latest_stretch_of_work():
    log = [{"time": 0, "event": "start", "held": 0}, {"time": 100, "event": "commit", "held": 500},
           {"time": 200, "event": "stop", "held": 800},
           {"time": 10_000, "event": "start", "held": 800}, {"time": 10_400, "event": "commit", "held": 1000}]
    assert resumable.latest_rate(log) == pytest.approx(0.5)  # the machine of the latest start, not the earlier one
    assert resumable.latest_rate(log[:4]) is None  # a fresh start, nothing gained yet


def _git(cwd, *args):
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def _repo(tmp_path, monkeypatch):
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "config", "user.email", "t@example.com")
    _git(tmp_path, "config", "user.name", "t")
    monkeypatch.chdir(tmp_path)


def test_a_commit_takes_the_run_folder_alone(tmp_path, monkeypatch):
    _repo(tmp_path, monkeypatch)
    (tmp_path / "other.txt").write_text("staged elsewhere\n")
    _git(tmp_path, "add", "other.txt")
    folder = lc.run_dir(4096)
    (tmp_path / folder / "results").mkdir(parents=True)
    (tmp_path / folder / "results" / "results-rank0.jsonl").write_text(json.dumps({"key": "a"}) + "\n")
    assert resumable.commit(folder, "R11 so far")
    assert _git(tmp_path, "show", "--name-only", "--format=", "HEAD").split() == \
        [f"{folder}/results/results-rank0.jsonl"]
    assert "other.txt" in _git(tmp_path, "diff", "--cached", "--name-only")  # still staged, not committed
    assert resumable.commit(folder, "nothing new")  # nothing to commit is no failure
    assert len(_git(tmp_path, "log", "--format=%H").split()) == 1


def test_a_stopped_run_is_committed_and_resumed_without_losing_or_repeating_an_answer(tmp_path, monkeypatch):
    """A stand-in for eval that appends one answer a second under its key, skipping the keys already held (as eval
    resumes); stopped after a few answers, its folder is committed; run again, it finishes with every key once."""
    _repo(tmp_path, monkeypatch)
    folder = "outputs/run"
    fake = tmp_path / "fake_eval.py"
    fake.write_text(
        "import json, os, sys, time\n"
        "folder, n = sys.argv[1], int(sys.argv[2])\n"
        "path = os.path.join(folder, 'results', 'results-rank0.jsonl')\n"
        "os.makedirs(os.path.dirname(path), exist_ok=True)\n"
        "have = {json.loads(l)['key'] for l in open(path)} if os.path.exists(path) else set()\n"
        "for i in range(n):\n"
        "    if str(i) in have: continue\n"
        "    time.sleep(0.3)\n"
        "    with open(path, 'a') as fh: fh.write(json.dumps({'key': str(i), 'press': 'no_press'}) + '\\n')\n")
    monkeypatch.setattr(resumable, "held", lambda f: sum(1 for _ in open(os.path.join(f, "results",
                        "results-rank0.jsonl"))) if os.path.exists(os.path.join(f, "results")) else 0)
    monkeypatch.setattr("kvpress_phase.evaluation.store.pack_run", lambda f: None)
    command = [sys.executable, str(fake), folder, "12"]
    import threading

    timer = threading.Timer(1.5, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    assert not resumable.run_committed(command, folder, 12, title="test", commit_every=0.5)
    timer.cancel()
    first = resumable.held(folder)
    assert 0 < first < 12
    assert f"{folder}/results/results-rank0.jsonl" in _git(tmp_path, "ls-files")  # committed as it stopped
    assert resumable.run_committed(command, folder, 12, title="test", commit_every=60)
    keys = [json.loads(line)["key"] for line in open(os.path.join(folder, "results", "results-rank0.jsonl"))]
    assert sorted(keys, key=int) == [str(i) for i in range(12)]  # each answer once
    events = [e["event"] for e in resumable.read_log(folder)]
    assert events[0] == "start" and "stop" in events and events[-1] == "end"
    assert _git(tmp_path, "status", "--porcelain", "--", folder) == ""  # everything committed


def test_a_run_into_a_folder_git_ignores_refuses_to_start(tmp_path, monkeypatch, capsys):
    """Its commits would all fail; it stops with exit code 2 and a line naming the fix, before the evaluation runs."""
    _repo(tmp_path, monkeypatch)
    (tmp_path / ".gitignore").write_text("/outputs/*\n")
    marker = tmp_path / "ran"
    command = [sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"]
    with pytest.raises(SystemExit) as stop:
        resumable.run_committed(command, "outputs/run", 3, title="t")
    assert stop.value.code == 2 and not marker.exists()
    assert "!/outputs/run/" in capsys.readouterr().err
    (tmp_path / ".gitignore").write_text("/outputs/*\n!/outputs/run/\n")
    resumable.check_trackable("outputs/run")  # with the exception it may start


def test_every_study_run_folder_is_committed_by_this_repository(monkeypatch):
    """The repository's .gitignore lets each resumable study's run folders be committed as they go."""
    from studies import low_ratio_dev, low_ratio_split

    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    folders = [lc.run_dir(n) for n in lc.LENGTHS] + [low_ratio_split.run_dir(n) for n in low_ratio_split.RUNS] + \
        [low_ratio_dev.run_dir(n) for n in low_ratio_dev.RUNS]
    for folder in folders:
        resumable.check_trackable(folder)


def test_an_evaluation_that_ignores_the_interrupt_is_killed_and_the_run_stops(tmp_path, monkeypatch):
    _repo(tmp_path, monkeypatch)
    stubborn = tmp_path / "stubborn.py"
    stubborn.write_text("import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(120)\n")
    monkeypatch.setattr(resumable, "held", lambda f: 0)
    import threading
    import time

    timer = threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGTERM))
    timer.start()
    began = time.monotonic()
    assert not resumable.run_committed([sys.executable, str(stubborn)], "outputs/run", 5, title="t", grace=1.0)
    assert time.monotonic() - began < 30
    assert [e["event"] for e in resumable.read_log("outputs/run")] == ["start", "stop"]


def _answers(rng, texts: int, stride: int, truth: np.ndarray, length: int, press: str) -> list:
    rows = []
    for t in range(texts):
        level = rng.random()  # a per-text difficulty shared by the text's phases
        for phase in range(stride):
            rows.append({"context_length": length, "press": press, "grid": f"W={stride}, S={stride}",
                         "compression_ratio": 0.5, "task": "niah_single", "sample_id": t, "phase": phase,
                         "score": float(level < truth[phase])})
    return rows


def test_the_phase_and_growth_tests_hold_their_level_under_a_flat_truth():
    rng = np.random.default_rng(0)
    fired_l1 = fired_l2 = 0
    replicates = 100
    for _ in range(replicates):
        rows = []
        for length in (4096, 8192):  # the same flat truth at both lengths, per-phase noise on top of the text's
            truth = np.full(8, 0.6)
            for r in _answers(rng, 16, 8, truth, length, "chunked_stride"):
                r["score"] = float(rng.random() < (0.9 if r["score"] else 0.3))
                rows.append(r)
        table = lc.phase_table(pd.DataFrame(rows).assign(stride=8, window=8.0), ("chunked_stride",))
        fired_l1 += bool((table.p_holm < 0.05).any())
        fired_l2 += bool((lc.growth_table(table).p_holm < 0.05).any())
    assert fired_l1 / replicates <= 0.10 and fired_l2 / replicates <= 0.10


def test_a_weak_phase_is_found():
    rng = np.random.default_rng(1)
    truth = np.full(8, 0.95)
    truth[3] = 0.05
    table = lc.phase_table(pd.DataFrame(_answers(rng, 16, 8, truth, 4096, "chunked_stride")).assign(stride=8),
                           ("chunked_stride",))
    assert table.p_holm.iloc[0] < 0.05 and lc.l1_verdicts(table) == {4096: "present"}


def test_the_cache_on_paper_is_the_measured_cache():
    # docs/results/long-context/sizing.md: 95.44 MiB for Qwen's 4,072-token prefill in float32
    assert lc.on_paper(lc.QWEN, 4072, 4)["cache GiB"] * 1024 == pytest.approx(95.44, abs=0.01)


def _study(rng, lengths) -> pd.DataFrame:
    """Answers of the study's shape at ``lengths``: a windowed press, the recommended press and the baselines, both
    tasks, stride 8."""
    rows = []
    for length in lengths:
        for press in ("chunked_stride", lc.RECOMMENDED) + lc.BASELINES:
            for task in ("niah_single", "niah_multikey"):
                for r in _answers(rng, 4, 8, np.full(8, 0.7), length, press):
                    rows.append({**r, "task": task, "stride": 8,
                                 "grid": "" if press in lc.BASELINES else r["grid"]})
    return pd.DataFrame(rows)


def test_growth_is_marked_interim_while_a_longer_length_is_not_complete():
    df = _study(np.random.default_rng(2), (4096, 8192))
    interim = lc.tables_markdown(df, held={4096: (10, 10), 8192: (10, 10), 16384: (0, 10)})
    assert "- Interim: " in interim and "16,384 tokens is not complete; this compares 4,096 with 8,192" in interim
    partial = lc.tables_markdown(df, held={4096: (10, 10), 8192: (4, 10)})
    assert "8,192 tokens is not complete" in partial
    assert "- L1 at 8,192 tokens: **" in partial and "(interim: 4 of 10 answers)." in partial
    assert "(interim:" not in interim
    final = lc.tables_markdown(df, held={4096: (10, 10), 8192: (10, 10)})
    assert "- L2: **" in final and "- Interim: " not in final
