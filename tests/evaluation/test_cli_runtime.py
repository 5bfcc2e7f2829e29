"""How the command runs, beside what it computes: its torch threads (``--threads``), a command line parsed without
importing torch or kvpress (``--help`` is fast), and a console table that fits a terminal."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from kvpress_phase import cli
from kvpress_phase.evaluation import cli as evaluation_cli
from kvpress_phase.evaluation import commands


# ------------------------------------------------------------------------------------------------ --threads
COMMANDS = [["eval"], ["audit", "knorm"], ["train", "--output-dir", "o"]]


@pytest.mark.parametrize("command", COMMANDS, ids=["eval", "audit", "train"])
def test_threads_parses_for_eval_audit_and_train(command):
    parser = cli.build_parser()
    assert parser.parse_args(command + ["--threads", "3"]).threads == 3
    assert parser.parse_args(command).threads is None  # each command's default, decided when it runs


@pytest.mark.parametrize("command", COMMANDS, ids=["eval", "audit", "train"])
@pytest.mark.parametrize("value,message", [("0", "--threads must be >= 1, got 0"),
                                           ("-2", "--threads must be >= 1, got -2"),
                                           ("two", "--threads takes an integer, got 'two'")])
def test_bad_threads_exit_2_with_one_line(command, value, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # were the flag taken, nothing would be written into the checkout
    assert cli.main(command + ["--threads", value]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"kvpress-phase: error: {message}"


def _small_eval(model_dir, out) -> list:
    return ["eval", "--model", model_dir, "--tasks", "niah_single", "--presses", "no_press,chunked_stride",
            "--strides", "4", "--context-lengths", "64", "--samples", "1", "--no-diagnostics", "--device", "cpu",
            "--output-dir", str(out), "--no-progress", "--bootstrap", "100"]


@pytest.fixture
def threads_during_eval(monkeypatch):
    """The torch threads in effect while each eval ran (the runner wrapped); torch's count is restored after."""
    from kvpress_phase.evaluation import runner

    seen = []
    run = runner.run_evaluation

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return run(*args, **kwargs)

    monkeypatch.setattr(runner, "run_evaluation", recording)
    before = torch.get_num_threads()
    yield seen
    torch.set_num_threads(before)


def test_eval_runs_with_the_threads_asked_for_and_one_on_the_cpu_by_default(model_dir, tmp_path, threads_during_eval,
                                                                             capsys):
    torch.set_num_threads(3)
    assert cli.main(_small_eval(model_dir, tmp_path / "default")) == 0
    assert cli.main(_small_eval(model_dir, tmp_path / "two") + ["--threads", "2"]) == 0
    assert threads_during_eval == [1, 2]
    assert torch.get_num_threads() == 3  # the caller's count is given back


def test_a_run_resumes_with_another_thread_count_and_records_it(model_dir, tmp_path, threads_during_eval, capsys):
    from kvpress_phase.evaluation.config import EvalConfig
    from kvpress_phase.evaluation.store import RESULTS_DIR

    assert "threads" not in {f.name for f in EvalConfig.__dataclass_fields__.values()}  # not in the fingerprint
    out = tmp_path / "run"
    assert cli.main(_small_eval(model_dir, out) + ["--threads", "1"]) == 0
    shard = out / RESULTS_DIR / "results-rank0.jsonl"
    rows, saved = shard.read_text(), (out / "config.json").read_text()
    assert '"threads": 1' in (out / "report.md").read_text()
    assert cli.main(_small_eval(model_dir, out) + ["--threads", "2"]) == 0  # resumed: nothing left to run
    assert "different configuration" not in capsys.readouterr().err
    assert shard.read_text() == rows and (out / "config.json").read_text() == saved
    assert '"threads": 2' in (out / "report.md").read_text()  # the run's report names the count it ran with
    assert threads_during_eval == [1, 2]


def test_audit_forwards_threads_to_the_eval_it_runs(monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(commands, "cmd_eval", lambda args: ran.append(args) or 0)
    assert cli.main(["audit", "knorm", "--threads", "3", "--output-dir", "o"]) == 0
    assert cli.main(["audit", "knorm", "--output-dir", "o"]) == 0
    assert [args.threads for args in ran] == [3, None]
    printed = capsys.readouterr().err.splitlines()
    assert "--threads 3" in printed[0] and "--threads" not in printed[1]


# ------------------------------------------------------------------------------------------------ parsing is light
@pytest.mark.parametrize("argv", [["eval", "--tasks", "niah_single"], ["audit", "knorm"], ["report", "run",
                                  "--output-dir", "o"], ["train", "--output-dir", "o"]])
def test_parsing_a_command_line_imports_neither_torch_nor_kvpress(argv):
    """The press names, the quick sweep's defaults and train's defaults are known without importing torch or kvpress
    (which take seconds), so ``--help`` and bad flags answer at once."""
    code = ("import sys; from kvpress_phase.cli import build_parser; "
            f"build_parser().parse_args({argv!r}); print('torch' in sys.modules, 'kvpress' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["False", "False"]


def test_the_quick_sweep_is_one_configuration():
    """``QUICK`` (the benchmarks' starting point) is the configuration of the parser's defaults."""
    args = cli.build_parser().parse_args(["eval"])
    quick = evaluation_cli.QUICK
    for name, value in evaluation_cli.QUICK_SETTINGS.items():
        given = getattr(args, name)
        if name == "presses":  # not given: the model decides (default_presses)
            assert given is None
            given = evaluation_cli.default_presses("builtin")
        assert getattr(quick, name) == value == given
    quick.validate()
    assert "staggered_window" not in quick.presses and "chunked_stride:mode=pool" in quick.presses


def test_a_model_that_ships_a_scorer_runs_the_recommended_press_by_default():
    """The README's recommendation joins the default job where its scorer ships, and nowhere else."""
    from kvpress_phase.builtin import scorer_models
    from kvpress_phase.evaluation.presses import RECOMMENDED_WITH_SCORER, parse_press_spec

    assert {"smollm2", "qwen2.5-coder-0.5b"} <= set(scorer_models())
    parse_press_spec(RECOMMENDED_WITH_SCORER)  # a valid spec
    quick = evaluation_cli.QUICK_SETTINGS["presses"]
    for model in scorer_models():
        assert evaluation_cli.default_presses(model) == quick + [RECOMMENDED_WITH_SCORER]
    for model in ("builtin", "chunked", "./some-folder"):
        assert evaluation_cli.default_presses(model) == quick


# ------------------------------------------------------------------------------------------------ console table
def _record(press, **values):
    base = dict(task="niah_multikey", context_length=512, press=press, compression_ratio=0.25, stride=8,
                protocol="prefix", setting="query_agnostic", mean=0.5, per_phase=[0.5] * 8,
                per_phase_ci=[[0.1, 0.9]] * 8, worst_phase=2, worst=0.25, best_phase=0, best=0.75, gap=0.5,
                gap_xfit=-0.001, gap_xfit_ci_low=-0.39, gap_xfit_ci_high=0.39, boundary=None, p_value=0.0123,
                cochran_p=None, detectable_gap=None, n_samples=6, n_paired=6, phases=list(range(8)),
                attention_per_phase=[None] * 8, cache_length=400.5, achieved_ratio=0.22, window_ratio=0.25,
                per_depth=[[None, 0]] * 5)
    return {**base, **values}


def test_console_table_fits_a_terminal_and_shows_missing_values_as_a_dash():
    from kvpress_phase.evaluation.report import console_table

    records = [_record("chunk:scorer=expected_attention"), _record("no_press", compression_ratio=0.0),
               _record("chunked_stride:mode=pool", setting="question_compressed", mean=None, worst=float("nan"),
                       p_value=None, gap_xfit=None, gap_xfit_ci_low=None, gap_xfit_ci_high=None)]
    table = console_table(records)
    lines = table.splitlines()
    assert max(len(line) for line in lines) <= 120, table
    assert "None" not in table and "nan" not in table.lower() and "-0.00" not in table
    assert lines[0].split() == ["task", "length", "press", "ratio", "stride", "setting", "mean", "worst", "p", "gap",
                                "[95%", "CI]", "n"]
    first = lines[1].split()
    assert first[:6] == ["niah_multikey", "512", "chunk:scorer=expected_attention", "0.25", "8", "query-agnostic"]
    assert first[6:] == ["0.50", "0.25", "0.012", "0.00", "[-0.39,", "0.39]", "6"]
    assert lines[2].split()[3] == "0"
    missing = lines[3].split()
    assert missing[5] == "query-aware" and missing[6:] == ["-", "-", "-", "-", "6"]


def test_console_table_adds_model_seed_and_protocol_only_when_they_tell_records_apart():
    from kvpress_phase.evaluation.report import console_table

    plain = console_table([_record("knorm")]).splitlines()[0].split()
    assert plain[0] == "task" and "model" not in plain and "seed" not in plain and "protocol" not in plain
    one_model = console_table([_record("knorm", model="builtin"), _record("tova", model="builtin")])
    assert one_model.splitlines()[0].split()[0] == "task"  # a column that never varies is left out
    merged = console_table([_record("knorm", model="smollm2", seed=0),
                            _record("knorm", model="builtin", seed=1, protocol="offset")])
    header = merged.splitlines()[0].split()
    assert header[:4] == ["model", "seed", "protocol", "task"]
    assert merged.splitlines()[2].split()[:3] == ["builtin", "1", "offset"]
    assert console_table([]) == "(no results)"


def test_eval_prints_the_console_table_and_report_writes_the_full_one(model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(_small_eval(model_dir, out)) == 0
    printed = capsys.readouterr().out
    assert printed.splitlines()[0].split()[:3] == ["task", "length", "press"]
    assert max(len(line) for line in printed.splitlines()) <= 120 and "None" not in printed
    report = (out / "report.md").read_text()
    assert "detectable gap" in report and "per phase" in report  # the full table stays in report.md
    assert json.loads((out / "summary.json").read_text())[0]["per_phase"]
