"""The GPU check's small mode: every step of `benchmarks/gpu_check.py` on tiny shapes on the CPU, so it cannot rot."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

pytest.importorskip("triton", reason="the check runs the Triton kernels (interpreted on the CPU)")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "benchmarks", "gpu_check.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_small_mode_runs_every_step(tmp_path):
    gpu_check = _load()
    assert gpu_check.main(["--small", "--output-dir", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["passed"] and summary["small"]
    assert list(summary["steps"]) == ["parity", "kernels", "pipeline", "eval"]
    assert all(step["status"] == "ok" for step in summary["steps"].values())
    kernels = summary["steps"]["kernels"]["result"]["rows"]
    assert {r["op"] for r in kernels} == {"copy k+v", "select", "pool-mean", "pool-score-centroid", "pool-overlap"}
    # a ratio of two timings, recorded to three significant figures (the interpreter makes it tiny on the CPU)
    assert all(r["speedup_vs_torch"] > 0 for r in kernels if r["backend"] == "triton")
    runs = summary["steps"]["pipeline"]["result"]["runs"]
    assert {r["press"] for r in runs} == {"ChunkedStridePress", "PhaseAwarePress"}
    pipeline = summary["steps"]["pipeline"]["result"]
    assert set(pipeline["first_call"]) == {"sdpa"} and pipeline["first_call"]["sdpa"]["gc_collect_s"] >= 0
    for r in runs:  # every case: a cold call, then the repeats (median), each with its compress step timed
        for b in ("triton", "torch"):
            assert len(r[f"calls_{b}"]) == 1 + r["repeats"] and r["repeats"] >= 2
            assert r[f"seconds_{b}"] > 0 and r[f"cold_seconds_{b}"] == r[f"calls_{b}"][0]["s"]
            assert 0 < r[f"compress_seconds_{b}"] < r[f"seconds_{b}"] and r[f"cold_compress_seconds_{b}"] > 0
            assert all(c["gc_s"] >= 0 for c in r[f"calls_{b}"])
    assert [r["cold_first"] for r in runs] == ["triton", "torch"]  # the backend that goes first alternates
    assert summary["steps"]["eval"]["result"]["answers"] == 4 * 3  # phases x presses
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert "| parity | ok |" in markdown and "| eval | ok |" in markdown
    assert "compress ms Triton" in markdown and "First call of the step" in markdown


def test_a_failing_step_fails_the_check(tmp_path, monkeypatch):
    gpu_check = _load()

    def broken(ctx):
        raise AssertionError("kernel output differs")

    monkeypatch.setitem(gpu_check.STEPS, "parity", broken)
    assert gpu_check.main(["--small", "--steps", "parity", "--output-dir", str(tmp_path)]) == 1
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    parity = summary["steps"]["parity"]
    assert parity["status"] == "failed" and "kernel output differs" in parity["error"]
    assert "FAILED" in (tmp_path / "gpu_check.md").read_text()


def test_full_mode_needs_a_gpu(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert _load().main(["--output-dir", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().err
