"""Benchmark of the varlen decoding kernel: attention over a ragged per-head cache against a copy of the same bytes,
the PyTorch reference and SDPA over the padded dense layout.

One decoding step (one new token) of one layer with Llama-3.1-8B's attention shapes (32 query heads, 8 KV heads,
head dim 128), bfloat16 on a GPU. At every context length N each KV head keeps its own number of entries, drawn with
a fixed seed (:func:`head_lengths`: mean N * (1 - ratio), log-normal shares so that some heads keep several times
more than others, none more than N, none fewer than 1), stored head-flattened as ``kvpress_phase.ragged.RaggedLayer``
stores them (one ``(capacity, 128)`` buffer each for keys and values, ``--slack`` unused rows after every head, int32
``starts``/``lengths`` on the device). Timed, each on the same entries:

- ``varlen``: ``kvpress_phase.kernels.ragged_attention`` with the Triton backend, called as the ragged cache calls it
  (``check_index=False``);
- ``reference``: the same call with the PyTorch backend (one SDPA call per KV head, over its own rows);
- ``masked sdpa``: every KV head padded to the longest, the padding excluded by a boolean mask, keys and values
  repeated to the query heads (transformers repeats them when it passes a mask: SDPA with ``enable_gqa`` and a mask
  falls back to its math backend); the padding and the repeat are made once, outside the timing;
- ``padded sdpa``: the same padded layout without a mask, ``enable_gqa=True``: the attention a decoding step runs
  under kvpress's per-head presses, which write fake keys into the padding so that no mask is needed (writing the
  fake keys is not timed);
- ``copy``: ``torch.empty_like(x).copy_(x)`` of the kept keys and of the kept values (the bytes varlen must read).

Two times per variant: ``call`` (the median of the repeats, each call between CUDA events: what a decoding step waits
for, host work between kernels included, such as the Triton path's read of the longest length) and ``GPU`` (the
GPU's busy time per call, from ``torch.profiler`` over as many calls, mean). Bandwidth: varlen's is the bytes of
the kept keys and values (each read once) over the GPU time of its two Triton kernels; the copy's is the bytes it
reads plus the bytes it writes over its GPU time (as ``benchmarks/bench_kernels.py`` counts a copy). Target: varlen
at >= 60% of the copy's bandwidth, printed as met or missed, never asserted. Every length also checks the varlen
and the masked outputs against the reference (max abs difference over the reference's max abs value).

Only torch, triton and ``kvpress_phase.kernels`` are imported. ``--device cpu`` times nothing meaningful: it runs
the reference and SDPA paths (and the Triton kernel through the interpreter with ``TRITON_INTERPRET=1`` and
``--backends triton,torch``) to check the script and the outputs.

    python benchmarks/bench_ragged_attention.py                       # GPU: N = 32k, 64k, 128k, bfloat16
    TRITON_INTERPRET=1 python benchmarks/bench_ragged_attention.py --device cpu --sizes 256 --backends triton,torch
"""

from __future__ import annotations

import argparse
import datetime
import math
import platform
import shlex
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from kvpress_phase import kernels

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TARGET = 0.60
"""varlen's bandwidth (kept keys and values read once) as a fraction of a device-to-device copy's."""
TRITON_KERNELS = ("_split_kernel", "_combine_kernel")
"""Names of the varlen path's Triton kernels in the profiler's trace (kernels/triton_varlen_decode.py)."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    p.add_argument("--sizes", default=None, help="comma-separated context lengths N (default 32768,65536,131072 "
                   "on GPU, 1024,4096 on CPU)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default bfloat16 on GPU, float32 on CPU")
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--ratio", type=float, default=0.5, help="compression ratio: heads keep N * (1 - ratio) on average")
    p.add_argument("--spread", type=float, default=1.0, help="standard deviation of the heads' log shares")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slack", type=int, default=64, help="unused rows after every head (a RaggedLayer's growth)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls (default 5 on GPU, 1 on CPU)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls, and profiled calls (default 30 on GPU, "
                   "3 on CPU)")
    p.add_argument("--backends", default=None, help="default triton,torch on GPU and torch on CPU (triton on CPU "
                   "needs TRITON_INTERPRET=1 and only checks the outputs)")
    p.add_argument("--output", default=None, help="also write the markdown report to this file")
    p.add_argument("--json", default=None, help="also write the measured rows to this JSON file")
    args = p.parse_args(argv)
    gpu = args.device.startswith("cuda")
    if gpu and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: no CUDA device is available (--device cpu runs the CPU check)")
    try:
        args.sizes = [int(s) for s in (args.sizes or ("32768,65536,131072" if gpu else "1024,4096")).split(",")]
    except ValueError:
        raise ValueError(f"--sizes must be comma-separated integers, got {args.sizes!r}") from None
    if any(n < 1 for n in args.sizes):
        raise ValueError(f"--sizes must be positive, got {args.sizes}")
    if args.q_heads < 1 or args.kv_heads < 1 or args.q_heads % args.kv_heads:
        raise ValueError(f"--q-heads ({args.q_heads}) must be a positive multiple of --kv-heads ({args.kv_heads})")
    if args.head_dim < 1 or args.slack < 0:
        raise ValueError(f"--head-dim must be >= 1 and --slack >= 0, got {args.head_dim} and {args.slack}")
    args.dtype = DTYPES[args.dtype or ("bfloat16" if gpu else "float32")]
    args.warmup = args.warmup if args.warmup is not None else (5 if gpu else 1)
    args.repeats = args.repeats if args.repeats is not None else (30 if gpu else 3)
    if args.warmup < 0 or args.repeats < 1:
        raise ValueError(f"--warmup must be >= 0 and --repeats >= 1, got {args.warmup} and {args.repeats}")
    args.backends = (args.backends or ("triton,torch" if gpu else "torch")).split(",")
    if set(args.backends) - {"triton", "torch"}:
        raise ValueError(f"--backends takes triton and torch, got {args.backends}")
    return args


def head_lengths(n: int, heads: int, ratio: float, seed: int = 0, spread: float = 1.0) -> list[int]:
    """Entries each of ``heads`` KV heads keeps out of ``n``: ``round(heads * n * (1 - ratio))`` in all (at least
    one per head), shared in proportion to ``exp(spread * z)`` with ``z`` standard normal draws of ``seed``, a head's
    share capped at ``n`` and what the cap removes given to the other heads in proportion to their shares."""
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"ratio must be in [0, 1), got {ratio}")
    if n < 1 or heads < 1:
        raise ValueError(f"n and heads must be >= 1, got {n} and {heads}")
    if spread < 0:
        raise ValueError(f"spread must be >= 0, got {spread}")
    total = max(heads, min(heads * n, round(heads * n * (1.0 - ratio))))
    g = torch.Generator().manual_seed(seed)
    weights = torch.exp(spread * torch.randn(heads, generator=g, dtype=torch.float64)).tolist()
    share = [0.0] * heads
    free, remaining = set(range(heads)), float(total)
    while free:  # water-filling: heads over the cap take n, the rest share what is left
        mass = sum(weights[h] for h in free)
        over = {h for h in free if remaining * weights[h] / mass > n}
        if not over:
            for h in free:
                share[h] = remaining * weights[h] / mass
            break
        for h in over:
            share[h] = float(n)
        remaining -= n * len(over)
        free -= over
    lengths = [min(n, max(1, math.floor(s))) for s in share]
    while sum(lengths) < total:  # rounding: the largest fractional parts first
        h = max((h for h in range(heads) if lengths[h] < n), key=lambda h: share[h] - lengths[h])
        lengths[h] += 1
    while sum(lengths) > total:  # heads raised to one entry: take it back from the longest
        lengths[max(range(heads), key=lambda h: lengths[h])] -= 1
    return lengths


def build_case(lengths: list[int], q_heads: int, head_dim: int, slack: int, dtype, device: str, seed: int):
    """Head-flattened buffers (``slack`` unused rows after every head), int32 ``starts``/``lengths`` and one new
    token's query ``(q_heads, 1, head_dim)``."""
    starts, row = [], 0
    for length in lengths:
        starts.append(row)
        row += length + slack
    g = torch.Generator(device=device).manual_seed(seed)
    keys = torch.randn(row, head_dim, generator=g, device=device).to(dtype)
    values = torch.randn(row, head_dim, generator=g, device=device).to(dtype)
    query = torch.randn(q_heads, 1, head_dim, generator=g, device=device).to(dtype)
    index = dict(dtype=torch.int32, device=device)
    return query, keys, values, torch.tensor(starts, **index), torch.tensor(lengths, **index)


def padded(keys, values, starts: list[int], lengths: list[int], multiple: int = 64):
    """Every KV head's entries in a dense ``(1, kv_heads, L, dim)`` pair, L the longest head rounded up to
    ``multiple``, zeros after each head's end; and the ``(kv_heads, L)`` boolean mask of the real entries."""
    longest = max(multiple, -(-max(lengths) // multiple) * multiple)
    k = keys.new_zeros(1, len(lengths), longest, keys.shape[1])
    v = values.new_zeros(1, len(lengths), longest, values.shape[1])
    for h, (s, n) in enumerate(zip(starts, lengths)):
        k[0, h, :n], v[0, h, :n] = keys[s:s + n], values[s:s + n]
    mask = torch.arange(longest, device=keys.device)[None, :] < torch.tensor(lengths, device=keys.device)[:, None]
    return k, v, mask


def call_time(fn, device: str, warmup: int, repeats: int) -> float:
    """Median seconds of one ``fn()`` (CUDA events around each call on a GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    gpu = device.startswith("cuda")
    if gpu:
        torch.cuda.synchronize(device)
    for _ in range(repeats):
        if gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gpu_time(fn, repeats: int, names: tuple[str, ...] = ()):
    """``(busy, named)``: seconds per call the GPU spent in every kernel and copy of ``fn()``, and in the kernels
    whose name contains one of ``names``, from ``torch.profiler`` over ``repeats`` calls. ``(None, None)`` when the
    profiler recorded no GPU activity."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    busy = named = 0.0
    for event in prof.events():
        if event.device_type != DeviceType.CUDA or getattr(event, "is_user_annotation", False):
            continue  # host events, and annotation ranges that span kernels already counted
        us = event.time_range.elapsed_us()
        busy += us
        if any(name in event.name for name in names):
            named += us
    if busy <= 0:
        return None, None
    return busy / repeats / 1e6, (named / repeats / 1e6 if named > 0 else None)


def _rel_diff(got: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return (got.float().reshape(ref.shape) - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)


def measure(n: int, args) -> dict:
    """Every variant at context length ``n``: one row of the report."""
    device, gpu = args.device, args.device.startswith("cuda")
    lengths = head_lengths(n, args.kv_heads, args.ratio, args.seed, args.spread)
    query, keys, values, starts, lens = build_case(lengths, args.q_heads, args.head_dim, args.slack, args.dtype,
                                                   device, args.seed + n)
    start_list = starts.tolist()
    group = args.q_heads // args.kv_heads
    kept = sum(lengths)
    elt = torch.empty((), dtype=args.dtype).element_size()
    kept_bytes = kept * 2 * args.head_dim * elt  # the kept keys and values, each read once
    pad_k, pad_v, mask = padded(keys, values, start_list, lengths)
    rep_k, rep_v = pad_k.repeat_interleave(group, dim=1), pad_v.repeat_interleave(group, dim=1)
    rep_mask = mask.repeat_interleave(group, dim=0)[None, :, None, :].contiguous()
    q4 = query[None]  # (1, q_heads, 1, head_dim)
    src_k, src_v = keys[:kept], values[:kept]

    def copy():
        torch.empty_like(src_k).copy_(src_k)
        torch.empty_like(src_v).copy_(src_v)

    fns = {"copy": copy,
           "reference": lambda: kernels.ragged_attention(query, keys, values, starts, lens, backend="torch",
                                                         check_index=False),
           "masked_sdpa": lambda: F.scaled_dot_product_attention(q4, rep_k, rep_v, attn_mask=rep_mask),
           "padded_sdpa": lambda: F.scaled_dot_product_attention(q4, pad_k, pad_v, enable_gqa=True)}
    if "triton" in args.backends:
        fns["varlen"] = lambda: kernels.ragged_attention(query, keys, values, starts, lens, backend="triton",
                                                         check_index=False)
    ref = fns["reference"]()
    checks = {"masked_sdpa": _rel_diff(fns["masked_sdpa"]()[0], ref)}
    if "varlen" in fns:
        checks["varlen"] = _rel_diff(fns["varlen"](), ref)
    row = {"n": n, "lengths": lengths, "kept_entries": kept, "padded_length": pad_k.shape[2],
           "kept_bytes": kept_bytes, "max_rel_diff": checks}
    for name, fn in fns.items():
        entry = {"call_s": call_time(fn, device, args.warmup, args.repeats), "gpu_s": None}
        if gpu:
            entry["gpu_s"], named = gpu_time(fn, args.repeats, TRITON_KERNELS if name == "varlen" else ())
            if name == "varlen":
                entry["kernels_s"] = named
        row[name] = entry
    copy_t = row["copy"]["gpu_s"] or row["copy"]["call_s"]
    row["copy"]["bytes_per_s"] = 2 * kept_bytes / copy_t  # read + written
    row["timed_by"] = "gpu" if row["copy"]["gpu_s"] else "call"
    if "varlen" in row:
        v = row["varlen"]
        t = v.get("kernels_s") or v["gpu_s"] or v["call_s"]
        v["bytes_per_s"] = kept_bytes / t
        v["fraction_of_copy"] = v["bytes_per_s"] / row["copy"]["bytes_per_s"]
        for base in ("reference", "masked_sdpa", "padded_sdpa"):
            row[f"speedup_vs_{base}"] = {"call": row[base]["call_s"] / v["call_s"],
                                         "gpu": (row[base]["gpu_s"] / v["gpu_s"]) if v["gpu_s"] else None}
        row["target"] = ("met" if v["fraction_of_copy"] >= TARGET else "missed") if gpu else "not measured (CPU)"
    else:
        row["target"] = "not measured (no Triton backend)"
    return row


def _us(entry, key="call_s"):
    return "" if entry is None or entry.get(key) is None else f"{entry[key] * 1e6:.1f}"


def report(rows, args, command: str) -> str:
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001 - only the version string is wanted
        triton_version = "not installed"
    gpu = args.device.startswith("cuda")
    dev_name = torch.cuda.get_device_name(args.device) if gpu else (platform.processor() or platform.machine())
    lines = [
        "# kvpress-phase varlen decoding benchmark",
        "",
        f"- command: `{command}`",
        f"- device: {args.device} ({dev_name}), torch {torch.__version__}, triton {triton_version}",
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- shape: one new token, {args.q_heads} query heads, {args.kv_heads} KV heads, head dim {args.head_dim}, "
        f"{str(args.dtype).replace('torch.', '')}; per-head lengths of mean N * (1 - {args.ratio}) (seed "
        f"{args.seed}, spread {args.spread}); {args.warmup} warm-up calls, median of {args.repeats} timed calls"
        + (f", GPU time the mean of {args.repeats} profiled calls" if gpu else ""),
        "- times in us, `call / GPU` (call: CUDA events around one call; GPU: the GPU's busy time per call); "
        "varlen GB/s = kept K and V bytes (read once) / its Triton kernels' GPU time; copy GB/s = bytes read + "
        f"written / its GPU time; target: varlen >= {TARGET:.0%} of the copy's GB/s",
        "",
        "| N | kept per head (min / mean / max) | padded to | copy GB/s | varlen | varlen GB/s | of copy | target | "
        "reference | masked sdpa | padded sdpa | varlen speed-up vs masked / padded (call) | max rel diff varlen "
        "/ masked |",
        "|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cell = {k: " / ".join(t for t in (_us(r.get(k)), _us(r.get(k), "gpu_s")) if t)
                for k in ("varlen", "reference", "masked_sdpa", "padded_sdpa")}
        v = r.get("varlen")
        bw = f"{v['bytes_per_s'] / 1e9:.0f}" if v else ""
        frac = f"{v['fraction_of_copy']:.0%}" if v else ""
        sp = (f"{r['speedup_vs_masked_sdpa']['call']:.2f}x / {r['speedup_vs_padded_sdpa']['call']:.2f}x"
              if v else "")
        diffs = r["max_rel_diff"]
        diff = f"{diffs['varlen']:.1e} / " if "varlen" in diffs else "/ "
        lengths = r["lengths"]
        lines.append(
            f"| {r['n']} | {min(lengths)} / {r['kept_entries'] / len(lengths):.0f} / {max(lengths)} | "
            f"{r['padded_length']} | {r['copy']['bytes_per_s'] / 1e9:.0f} | {cell['varlen']} | {bw} | {frac} | "
            f"{r['target']} | {cell['reference']} | {cell['masked_sdpa']} | {cell['padded_sdpa']} | {sp} | "
            f"{diff}{diffs['masked_sdpa']:.1e} |")
    if not gpu:
        lines += ["", "CPU run: the Triton kernel needs a CUDA device; on CPU it only runs interpreted "
                  "(TRITON_INTERPRET=1), which checks the outputs, not the speed."]
    elif any(r["timed_by"] == "call" for r in rows):
        lines += ["", "The profiler recorded no GPU activity: bandwidths are from the call times."]
    return "\n".join(lines)


def main(argv=None) -> str:
    args = parse_args(argv)
    if "triton" in args.backends and not kernels.triton_available():
        raise ValueError("--backends triton: Triton (or the package's kernels) cannot be imported here")
    rows = []
    for n in args.sizes:
        rows.append(measure(n, args))  # its tensors are freed when it returns
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    command = " ".join(shlex.quote(a) for a in ["python", "benchmarks/bench_ragged_attention.py"]
                       + (list(argv) if argv is not None else sys.argv[1:]))
    text = report(rows, args, command)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    if args.json:
        import json

        gpu = args.device.startswith("cuda")
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(args.device) if gpu else "cpu",
                       "dtype": str(args.dtype).replace("torch.", ""), "target_of_copy": TARGET,
                       "shape": {"q_heads": args.q_heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim},
                       "ratio": args.ratio, "repeats": args.repeats, "rows": rows}, f, indent=2)
    return text


if __name__ == "__main__":
    main()
