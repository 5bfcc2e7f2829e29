"""The GPU check's small mode: every step of `benchmarks/gpu_check.py` on tiny shapes on the CPU, so it cannot rot."""

from __future__ import annotations

import json

import pytest

from benchmark_scripts import load_benchmark

pytest.importorskip("triton", reason="the check runs the Triton kernels (interpreted on the CPU)")


def test_small_mode_runs_every_step(tmp_path):
    gpu_check = load_benchmark("gpu_check")
    assert gpu_check.main(["--small", "--output-dir", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["passed"] and summary["small"]
    assert list(summary["steps"]) == ["parity", "kernels", "ragged", "pipeline", "eval"]
    assert all(step["status"] == "ok" for step in summary["steps"].values())
    kernels = summary["steps"]["kernels"]["result"]["rows"]
    assert {r["op"] for r in kernels} == {"copy k+v", "select", "pool-mean", "pool-score-centroid", "pool-overlap"}
    # a ratio of two timings, recorded to three significant figures (the interpreter makes it tiny on the CPU)
    assert all(r["speedup_vs_torch"] > 0 for r in kernels if r["backend"] == "triton")
    ragged = summary["steps"]["ragged"]["result"]
    assert ragged["dtype"] == "float32" and ragged["target_of_copy"] == 0.6
    (row,) = ragged["rows"]  # N = 256: heads of very different lengths, one at the cap, padded to the longest
    assert row["n"] == 256 and row["kept_mean"] == 128 and row["kept_max"] == 256 == row["padded_length"]
    assert row["kept_min"] < row["kept_mean"] / 4 and row["target"] == "not measured (CPU)"
    assert set(row["max_rel_diff"]) == {"varlen", "masked_sdpa"}
    assert all(float(d) <= 1e-4 for d in row["max_rel_diff"].values())
    assert all(row[f"{b}_us"] > 0 for b in ("varlen", "reference", "masked_sdpa", "padded_sdpa"))
    assert row["varlen_gpu_us"] is None and row["timed_by"] == "call"
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
    assert "| parity | ok |" in markdown and "| ragged | ok |" in markdown and "| eval | ok |" in markdown
    assert "| 256 | " in markdown.split("## ragged")[1] and "not measured (CPU)" in markdown
    assert "compress ms Triton" in markdown and "First call of the step" in markdown


def test_a_failing_step_fails_the_check(tmp_path, monkeypatch):
    gpu_check = load_benchmark("gpu_check")

    def broken(ctx):
        raise AssertionError("kernel output differs")

    monkeypatch.setitem(gpu_check.STEPS, "parity", broken)
    assert gpu_check.main(["--small", "--steps", "parity", "--output-dir", str(tmp_path)]) == 1
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    parity = summary["steps"]["parity"]
    assert parity["status"] == "failed" and "kernel output differs" in parity["error"]
    assert "FAILED" in (tmp_path / "gpu_check.md").read_text()


def test_the_ragged_step_fails_when_the_kernel_is_wrong(tmp_path, monkeypatch):
    """A varlen output off by a little more than the small mode's tolerance fails the step; the reference's is
    untouched, so the masked output still matches."""
    from kvpress_phase import kernels

    gpu_check, inner = load_benchmark("gpu_check"), kernels.ragged_attention

    def off(*args, backend=None, **kwargs):
        out = inner(*args, backend=backend, **kwargs)
        return out + 1e-3 * out.abs().max() if backend == "triton" else out

    monkeypatch.setattr(kernels, "ragged_attention", off)
    assert gpu_check.main(["--small", "--steps", "ragged", "--output-dir", str(tmp_path)]) == 1
    step = json.loads((tmp_path / "gpu_check.json").read_text())["steps"]["ragged"]
    message = step["error"].splitlines()[0]
    assert step["status"] == "failed" and "differ from the reference" in message
    assert "'varlen'" in message and "masked_sdpa" not in message


def test_full_mode_needs_a_gpu(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert load_benchmark("gpu_check").main(["--output-dir", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().err
