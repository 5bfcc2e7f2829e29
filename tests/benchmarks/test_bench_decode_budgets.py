"""The decoding-step and layer-by-layer budget benchmarks: bad input exits with code 2 before any model loads, and
the decoding benchmark's variants store what they say (run on the built-in model, KeyDiff scores)."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_decode_step  # noqa: E402
import bench_threshold_budget  # noqa: E402


@pytest.mark.parametrize("argv, message", [
    (["--ratios", "0.5,1.5"], "--ratios must be in (0, 1)"),
    (["--context-lengths", "a,b"], "comma-separated list of numbers"),
    (["--variants", "dense,sparse"], "unknown sparse"),
    (["--steps", "0"], "--steps must be >= 1"),
])
def test_decode_step_refuses_bad_input(argv, message, capsys):
    assert bench_decode_step.main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--seeds", "x"], "comma-separated list of numbers"),
    (["--samples", "0"], "--samples must be >= 1"),
])
def test_threshold_budget_refuses_bad_input(argv, message, capsys):
    assert bench_threshold_budget.main(argv) == 2
    assert message in capsys.readouterr().err


def test_decode_step_variants_on_the_builtin_model(tmp_path, capsys):
    out = tmp_path / "decode.md"
    assert bench_decode_step.main(["--model", "builtin", "--context-lengths", "256", "--ratios", "0.75", "--steps",
                                   "2", "--warmup", "0", "--scorer", "keydiff", "--output", str(out)]) == 0
    rows = {line.split("|")[3].strip(): line.split("|") for line in out.read_text().splitlines()
            if line.startswith("| ") and line.split("|")[3].strip() in bench_decode_step.VARIANTS}
    assert set(rows) == set(bench_decode_step.VARIANTS)
    mib = {variant: float(row[7]) for variant, row in rows.items()}
    assert mib["ragged"] <= mib["dense"] * 1.05 < mib["masked"] < mib["none"]  # ragged stores what it keeps
