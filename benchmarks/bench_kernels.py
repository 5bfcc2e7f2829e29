"""Benchmark of the compression kernels: Triton vs the PyTorch reference vs a plain copy of the same bytes.

For every sequence length N, keys and values of shape ``(batch, heads, N, head_dim)`` are compressed by

- ``select``: keep the k best of every window (W = S);
- ``pool mean``: uniform pooling, keys pooled as stored (``rope="none"``);
- ``pool score centroid``: softmax-of-score pooling, keys un-rotated and re-rotated at the weighted centroid;
- ``pool overlap``: W = 2S windows, uniform weights, keys re-rotated at the group start;

with the Triton kernel and with the PyTorch reference (both through the dispatch point of
``kvpress_phase.kernels``), and compared with ``torch.empty_like(x).copy_(x)`` of keys and values (the bandwidth a
memory-bound op can hope for). Effective bandwidth = (bytes an op must read + bytes it writes) / time, where an op
reads the tokens it uses (every token for pool, the raw and selected ones for select), the scores when it uses
them, and writes the compressed keys, values and int64 positions.

Only torch, triton and ``kvpress_phase.kernels`` / ``kvpress_phase.core.phase`` are imported (no kvpress, no
transformers). ``--device cpu`` times the reference path only: the Triton kernels need a CUDA device.

    python benchmarks/bench_kernels.py                               # GPU: N = 8k, 32k, 128k, bfloat16
    python benchmarks/bench_kernels.py --device cpu --sizes 4096,16384
"""

from __future__ import annotations

import argparse
import datetime
import platform
import shlex
import statistics
import sys
import time

import torch

from kvpress_phase import kernels
from kvpress_phase.core.phase import WindowLayout, kept_per_window

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    p.add_argument("--sizes", default=None, help="comma-separated sequence lengths (default 8192,32768,131072 on "
                   "GPU, 4096,16384 on CPU)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default bfloat16 on GPU, float32 on CPU")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8, help="KV heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--stride", type=int, default=8, help="S (windows of S tokens, or 2S for the overlap row)")
    p.add_argument("--ratio", type=float, default=0.5, help="compression ratio inside a window (k = S * (1 - ratio))")
    p.add_argument("--n-sink", type=int, default=4)
    p.add_argument("--n-local", type=int, default=16)
    p.add_argument("--warmup", type=int, default=None, help="untimed runs (default 5 on GPU, 1 on CPU)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs, median reported (default 50 GPU, 3 CPU)")
    p.add_argument("--ops", default="select,pool-mean,pool-score-centroid,pool-overlap")
    p.add_argument("--backends", default=None, help="default triton,torch on GPU and torch on CPU (triton on CPU "
                   "needs TRITON_INTERPRET=1 and only checks that the script runs)")
    p.add_argument("--output", default=None, help="also write the markdown report to this file")
    p.add_argument("--json", default=None, help="also write the measured rows to this JSON file")
    args = p.parse_args(argv)
    gpu = args.device.startswith("cuda")
    args.sizes = [int(s) for s in (args.sizes or ("8192,32768,131072" if gpu else "4096,16384")).split(",")]
    args.dtype = DTYPES[args.dtype or ("bfloat16" if gpu else "float32")]
    args.warmup = args.warmup if args.warmup is not None else (5 if gpu else 1)
    args.repeats = args.repeats if args.repeats is not None else (50 if gpu else 3)
    args.ops = args.ops.split(",")
    args.backends = (args.backends or ("triton,torch" if gpu else "torch")).split(",")
    if "torch" not in args.backends:
        args.backends.append("torch")  # the reference is the baseline of every speedup
    return args


def timer(fn, device: str, warmup: int, repeats: int) -> float:
    """Median wall time of ``fn()`` in seconds (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def op_specs(args):
    """name -> (window, weighting, rope, mode)"""
    S = args.stride
    return {
        "select": (S, "mean", "none", "select"),
        "pool-mean": (S, "mean", "none", "pool"),
        "pool-score-centroid": (S, "score", "centroid", "pool"),
        "pool-overlap": (2 * S, "mean", "start", "pool"),
    }


def traffic(layout: WindowLayout, mode: str, weighting: str, row_bytes: int, batch_heads: int) -> int:
    """Bytes an op must move: tokens it reads, scores it reads, compressed cache and positions it writes."""
    n, nw, k, S = layout.seq_len, layout.n_windows, layout.k, layout.stride
    read_rows = (n - nw * S) + nw * k if mode == "select" else n
    scores = 4 * n if (mode == "select" or weighting == "score") else 0
    written = layout.compressed_length * (row_bytes + 8)
    return batch_heads * (read_rows * row_bytes + scores + written)


def bench_size(n: int, args, k: int, row_bytes: int, elt: int, inv_freq: torch.Tensor) -> list[tuple]:
    """The table rows of one sequence length: the copy, then every op on every backend."""
    device, backends, specs = args.device, args.backends, op_specs(args)
    B, H, D = args.batch, args.heads, args.head_dim
    rows = []
    g = torch.Generator(device=device).manual_seed(n)
    keys = torch.randn(B, H, n, D, generator=g, device=device).to(args.dtype)
    values = torch.randn(B, H, n, D, generator=g, device=device).to(args.dtype)
    scores = torch.randn(B, H, n, generator=g, device=device)

    def copy():
        torch.empty_like(keys).copy_(keys)
        torch.empty_like(values).copy_(values)

    t_copy = timer(copy, device, args.warmup, args.repeats)
    copy_bytes = 2 * 2 * keys.numel() * elt
    copy_bw = copy_bytes / t_copy
    rows.append((n, "copy k+v", "torch", t_copy, copy_bw, None, 1.0, ""))
    for name in args.ops:
        window, weighting, rope, mode = specs[name]
        layout = WindowLayout.build(n, window=window, stride=args.stride, k=k, offsets=0, n_sink=args.n_sink,
                                    n_local=args.n_local, batch=B, heads=H, device=device)
        moved = traffic(layout, mode, weighting, row_bytes, B * H)
        times, fns = {}, {}
        for backend in backends:
            if mode == "select":
                def fn(backend=backend):
                    return kernels.select_windows(keys, values, scores, layout, backend=backend)
            else:
                def fn(backend=backend, weighting=weighting, rope=rope):
                    return kernels.pool_windows(keys, values, layout, scores=scores, weighting=weighting,
                                                rope=rope, inv_freq=inv_freq, backend=backend)
            fns[backend] = fn
            times[backend] = timer(fn, device, args.warmup, args.repeats)
        diff = ""
        if "triton" in backends:  # agreement of the two paths on this input (max |difference| of keys, values)
            got, ref = fns["triton"](), fns["torch"]()
            d = max((a.float() - b.float()).abs().max().item() for a, b in zip(got[:2], ref[:2]))
            diff = f"{d:.1e}" + ("" if torch.equal(got.positions, ref.positions) else " (positions differ!)")
            del got, ref
        for backend in backends:
            t = times[backend]
            speedup = times["torch"] / t if backend == "triton" else None
            rows.append((n, name, backend, t, moved / t, speedup, (moved / t) / copy_bw,
                         diff if backend == "triton" else ""))
    return rows


def main(argv=None) -> str:
    args = parse_args(argv)
    device = args.device
    gpu = device.startswith("cuda")
    backends = args.backends
    if "triton" in backends and not kernels.triton_available():
        sys.exit("Triton is not importable here: nothing to compare on the GPU")
    k = kept_per_window(args.stride, args.ratio)
    B, H, D = args.batch, args.heads, args.head_dim
    elt = torch.empty((), dtype=args.dtype).element_size()
    row_bytes = 2 * D * elt  # one key and one value
    inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2, dtype=torch.float32, device=device) / D)

    rows = []
    for n in args.sizes:
        rows += bench_size(n, args, k, row_bytes, elt, inv_freq)  # its tensors are freed when it returns
        if gpu:
            torch.cuda.empty_cache()

    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001 - only the version string is wanted
        triton_version = "not installed"
    dev_name = torch.cuda.get_device_name(device) if gpu else (platform.processor() or platform.machine())
    lines = [
        "# kvpress-phase kernel benchmark",
        "",
        f"- command: `{' '.join(shlex.quote(a) for a in [sys.executable.rsplit('/', 1)[-1]] + sys.argv)}`",
        f"- device: {device} ({dev_name}), torch {torch.__version__}, triton {triton_version}",
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- shape: keys/values ({B}, {H}, N, {D}) {str(args.dtype).replace('torch.', '')}, S = {args.stride}, "
        f"k = {k}, n_sink = {args.n_sink}, n_local = {args.n_local}; median of {args.repeats} runs",
        "- GB/s = (bytes the op must read + bytes it writes) / time; copy = `empty_like(x).copy_(x)` of keys and "
        "values; 'of copy' = GB/s relative to the copy's",
        "",
        "| N | op | backend | time (us) | GB/s | speedup vs torch | of copy | max abs diff vs torch |",
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for n, name, backend, t, bw, speedup, frac, diff in rows:
        sp = f"{speedup:.1f}x" if speedup is not None else ""
        lines.append(f"| {n} | {name} | {backend} | {t * 1e6:.1f} | {bw / 1e9:.1f} | {sp} | {frac:.0%} | {diff} |")
    if not gpu:
        lines += ["", "CPU run: the Triton kernels need a CUDA device; on CPU they only run interpreted "
                  "(TRITON_INTERPRET=1), which checks the script, not their speed."]
    report = "\n".join(lines)
    print(report)
    if args.output:
        with open(args.output, "w") as f:
            f.write(report + "\n")
    if args.json:
        import json

        keys = ("n", "op", "backend", "seconds", "bytes_per_s", "speedup_vs_torch", "fraction_of_copy", "max_abs_diff")
        with open(args.json, "w") as f:
            json.dump({"device": dev_name, "dtype": str(args.dtype).replace("torch.", ""),
                       "rows": [dict(zip(keys, row)) for row in rows]}, f, indent=2)
    return report


if __name__ == "__main__":
    main()
