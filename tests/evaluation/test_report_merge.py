"""``kvpress-phase report`` merging runs: every answer of every model and seed kept and summarised apart, the same
answer in two runs counted once (and said), different answers to one example refused, the runs read never written,
and incomplete runs counted against their plan."""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest

from kvpress_phase import cli
from kvpress_phase.evaluation.config import EvalConfig, planned_answers, variants
from kvpress_phase.evaluation.store import RESULTS_DIR

TINY = ["--tasks", "niah_single", "--presses", "no_press,phase_aware", "--strides", "4", "--phases", "0,1",
        "--context-lengths", "64", "--samples", "1", "--no-diagnostics", "--device", "cpu", "--no-progress",
        "--bootstrap", "100"]
ANSWERS = 4  # 1 sample x 2 phases x (no_press + phase_aware at one ratio)


def _eval(out, *extra) -> None:
    assert cli.main(["eval", *TINY, "--output-dir", str(out), *extra]) == 0


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs of the built-in model that differ only in their seed (never written by the tests: copy them)."""
    root = tmp_path_factory.mktemp("runs")
    _eval(root / "A")
    _eval(root / "B", "--seed", "1")
    return root / "A", root / "B"


def _report(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main(["report", *map(str, argv), "--bootstrap", "100"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _first_column(report: str) -> str:
    """The first column of report.md's summary table."""
    header = next(line for line in report.splitlines() if line.startswith("|") and "| press " in line)
    return header.split("|")[1].strip()


def _shard(run):
    return run / RESULTS_DIR / "results-rank0.jsonl"


def test_runs_of_two_seeds_keep_every_answer_and_are_summarised_per_seed(runs, tmp_path, capsys):
    a, b = runs
    code, out, err = _report(capsys, a, b, "--output-dir", tmp_path / "M")
    assert code == 0 and "warning" not in err
    results = pd.read_csv(tmp_path / "M" / "results.csv")
    assert len(results) == 2 * ANSWERS and sorted(set(results["seed"])) == [0, 1]
    summary = json.loads((tmp_path / "M" / "summary.json").read_text())
    assert sorted((r["seed"], r["press"]) for r in summary) == [(0, "no_press"), (0, "phase_aware"),
                                                               (1, "no_press"), (1, "phase_aware")]
    assert all(r["n_samples"] == 1 for r in summary)  # per seed: sample 0 of one seed is not sample 0 of the other
    report = (tmp_path / "M" / "report.md").read_text()
    assert _first_column(report) == "seed"
    assert "## seed 0, niah_single" in report and "## seed 1, niah_single" in report
    assert "seed" in out.splitlines()[0]  # the console table too


def test_runs_of_two_models_are_summarised_per_model(runs, model_dir, tmp_path, capsys):
    other = tmp_path / "other-model"
    _eval(other, "--model", model_dir)
    code, out, err = _report(capsys, runs[0], other, "--output-dir", tmp_path / "M")
    assert code == 0
    results = pd.read_csv(tmp_path / "M" / "results.csv")
    assert len(results) == 2 * ANSWERS and set(results["model"]) == {"builtin", model_dir}
    summary = json.loads((tmp_path / "M" / "summary.json").read_text())
    assert len(summary) == 4 and {r["model"] for r in summary} == {"builtin", model_dir}
    assert all(r["n_samples"] == 1 and "seed" not in r for r in summary)  # one seed: not split by seed
    report = (tmp_path / "M" / "report.md").read_text()
    assert _first_column(report) == "model" and f"## model {model_dir}, niah_single" in report
    assert "model" in out.splitlines()[0]


def test_the_same_answers_twice_are_counted_once_and_said(runs, tmp_path, capsys):
    a = runs[0]
    copy = tmp_path / "copy"
    shutil.copytree(a, copy)
    # a run saved before the default model's name was recorded is the same model's
    saved = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**saved, "config": {**saved["config"], "model": None}}))
    code, _, err = _report(capsys, a, copy, a, "--output-dir", tmp_path / "M")
    assert code == 0
    assert f"{ANSWERS} answers of {str(copy)!r} are also in {str(a)!r}, identical" in err
    assert f"{str(a)!r} is given more than once: its {ANSWERS} answers are counted once" in err
    assert len(pd.read_csv(tmp_path / "M" / "results.csv")) == ANSWERS


def test_different_answers_to_one_example_are_refused_naming_both_runs(runs, tmp_path, capsys):
    a = runs[0]
    copy = tmp_path / "copy"
    shutil.copytree(a, copy)
    lines = _shard(copy).read_text().splitlines()
    record = json.loads(lines[1])
    lines[1] = json.dumps({**record, "prediction": " something else", "score": 1.0 - record["score"]})
    _shard(copy).write_text("\n".join(lines) + "\n")
    code, _, err = _report(capsys, a, copy, "--output-dir", tmp_path / "M")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"runs {str(a)!r} and {str(copy)!r} hold different answers to 1 of the same examples" in err
    assert record["key"] in err and not (tmp_path / "M").exists()


def test_runs_of_one_model_at_two_dtypes_are_refused(runs, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(runs[1], copy)
    saved = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**saved, "config": {**saved["config"], "dtype": "bfloat16"}}))
    code, _, err = _report(capsys, runs[0], copy, "--output-dir", tmp_path / "M")
    assert code == 2 and "with different dtype (float32 and bfloat16)" in err and str(copy) in err


@pytest.mark.parametrize("how", ["same", "trailing slash", "symlink"])
def test_output_dir_that_is_an_input_is_refused_and_left_untouched(runs, tmp_path, capsys, how):
    a = tmp_path / "A"
    shutil.copytree(runs[0], a)
    before = {p.name: p.read_bytes() for p in a.iterdir() if p.is_file()}
    out = {"same": str(a), "trailing slash": f"{a}/", "symlink": str(tmp_path / "link")}[how]
    if how == "symlink":
        (tmp_path / "link").symlink_to(a)
    code, _, err = _report(capsys, a, runs[1], "--output-dir", out)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "never writes the runs it reads" in err and str(a) in err
    assert {p.name: p.read_bytes() for p in a.iterdir() if p.is_file()} == before


def test_output_dir_that_is_another_run_is_refused_and_left_untouched(runs, tmp_path, capsys):
    other = tmp_path / "other"
    shutil.copytree(runs[1], other)
    before = {p.name: p.read_bytes() for p in other.iterdir() if p.is_file()}
    code, _, err = _report(capsys, runs[0], "--output-dir", other)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "holds the results of" in err
    assert {p.name: p.read_bytes() for p in other.iterdir() if p.is_file()} == before


def test_a_partial_run_says_how_many_of_its_planned_answers_it_holds(runs, tmp_path, capsys):
    partial = tmp_path / "partial"
    shutil.copytree(runs[1], partial)
    _shard(partial).write_text("".join(_shard(partial).read_text().splitlines(keepends=True)[:3]))
    code, out, _ = _report(capsys, runs[0], partial, "--output-dir", tmp_path / "M")
    assert code == 0
    assert f"{partial}: holds 3 of {ANSWERS} planned answers" in out
    report = (tmp_path / "M" / "report.md").read_text()
    assert f"`{partial}` holds 3 of {ANSWERS} planned answers" in report
    assert f"`{runs[0]}` holds" not in report and f"{runs[0]}: holds" not in out  # complete: nothing to say


@pytest.mark.parametrize("settings", [
    dict(presses=["no_press", "phase_aware", "chunked_stride:mode=pool", "knorm"], compression_ratios=[0.25, 0.5],
         strides=[4, 8], windows=[8, 16], context_lengths=[128, 256], tasks=["niah_single", "vt"], samples=3),
    dict(presses=["no_press", "snapkv"], strides=[8], phases=[0, 3, 5], samples=2),
])
def test_planned_answers_counts_the_runner_plan(settings):
    config = EvalConfig(**settings)
    phases = {s: len(config.phases) if config.phases else s for s in config.strides}
    expected = sum(config.samples * phases[s] * len(variants(config, s)) for s in config.strides)
    assert planned_answers(config) == expected * len(config.tasks) * len(config.context_lengths)
