"""The prefill-overhead benchmark's small mode: every press through one prefill of a tiny model on the CPU, so
`benchmarks/prefill_overhead.py` cannot rot."""

from __future__ import annotations

import json

import pytest

from benchmark_scripts import load_benchmark

pytest.importorskip("triton", reason="the Triton-backend cases run the kernels (interpreted on the CPU)")


def test_small_mode_times_every_press(tmp_path):
    bench = load_benchmark("prefill_overhead")
    out = tmp_path / "prefill.json"
    assert bench.main(["--small", "--sizes", "256", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["errors"] == {} and res["device"] == "cpu" and res["ratio"] == 0.5
    names = list(bench.presses())
    assert [r["press"] for r in res["rows"]] == names
    for r in res["rows"]:
        assert r["s"] > 0 and "x_prefill" in r and "extra_peak_gib" in r
        if r["press"] == "none":
            assert r["x_prefill"] == 1.0 and r["cache_len_layer0"] == r["tokens"]
        if r["press"].startswith(("chunked_stride", "phase_aware")):  # ChunkedStridePress's exact length
            n = r["tokens"]
            assert r["cache_len_layer0"] == n - (n - 4 - 16 - 8 + 1) // 8 * 4
