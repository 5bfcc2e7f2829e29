"""bench_kernels on CPU: every size gets its copy row and one row per op and backend, and the bytes an op must move
follow from its layout."""

from __future__ import annotations

import json

from benchmark_scripts import load_benchmark


def test_every_size_gets_a_copy_row_and_one_row_per_op(tmp_path):
    out = tmp_path / "rows.json"
    report = load_benchmark("bench_kernels").main([
        "--device", "cpu", "--sizes", "64,128", "--heads", "2", "--head-dim", "8", "--stride", "8", "--warmup", "0",
        "--repeats", "1", "--backends", "torch", "--ops", "select,pool-mean", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["n"], r["op"]) for r in rows] == [(64, "copy k+v"), (64, "select"), (64, "pool-mean"),
                                                 (128, "copy k+v"), (128, "select"), (128, "pool-mean")]
    assert all(r["seconds"] > 0 and r["bytes_per_s"] > 0 for r in rows)
    assert "| 128 | pool-mean | torch |" in report and "CPU run" in report


def test_traffic_counts_what_an_op_reads_and_writes():
    bench = load_benchmark("bench_kernels")
    from kvpress_phase.core.phase import WindowLayout

    layout = WindowLayout.build(64, window=8, stride=8, k=2, offsets=0, n_sink=0, n_local=0, batch=1, heads=1)
    row_bytes = 2 * 8 * 4
    written = layout.compressed_length * (row_bytes + 8)
    # select reads only the kept rows of the windows (and whatever lies outside them) and every score
    kept_rows = (64 - layout.n_windows * 8) + layout.n_windows * 2
    assert bench.traffic(layout, "select", "mean", row_bytes, 3) == 3 * (kept_rows * row_bytes + 4 * 64 + written)
    # mean pooling reads every row and no score; score weighting reads the scores too
    assert bench.traffic(layout, "pool", "mean", row_bytes, 1) == 64 * row_bytes + written
    assert bench.traffic(layout, "pool", "score", row_bytes, 1) == 64 * row_bytes + 4 * 64 + written
