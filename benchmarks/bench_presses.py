"""CPU speed and memory of the presses' compress step on one layer, next to kvpress ChunkPress and a plain copy.

Keys and values of shape (1, heads, N, head_dim) in float32. For every N, in one run:

- ``copy``: ``keys.clone(); values.clone()``, the memory-bound limit;
- ``chunked_select``, ``chunked_pool`` (and the other pool variants): ``ChunkedStridePress.compress``;
- ``phase_aware``: ``PhaseAwarePress.compress`` with its defaults (row budget, KeyDiff scores, leftovers dropped);
  ``phase_aware_window`` the earlier default (per-window grids aligned by key norm, staggered per head);
  ``phase_aware_row_*`` the content-adaptive budget with Knorm or SnapKV scores;
- ``snapkv_scores``: ``SnapKVScorer().score`` alone, the share of ``phase_aware``'s time that is scoring;
- ``kvpress_snapkv``: ``SnapKVPress(r).compress``; ``kvpress_chunk``: ``ChunkPress(KnormPress(r),
  chunk_length=stride).compress``.

The layer is a real Llama attention layer (``heads`` KV heads, 4 query heads each, random weights), because
SnapKV-style scorers project the last hidden states to queries; its time counts for those cases.

Time is the median of ``--repeats`` runs after one warm-up. Peak extra memory is measured in a fresh process per
case: the growth of the peak resident set (VmHWM, reset just before the call) during one compress, outputs
included, relative to the layer's KV size (keys + values).

    python benchmarks/bench_presses.py --sizes 4096,16384,65536 --output BENCHMARKS-presses.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import time

import torch


QUERY_GROUPS = 4
"""Query heads per KV head of the attention layer the scorers that read hidden states run on (Llama-3 style)."""


def make_module(head_dim: int, heads: int = 8):
    """A Llama attention layer (``heads`` KV heads, ``QUERY_GROUPS`` query heads each, random weights) with the
    rotary embedding kvpress attaches to it: what SnapKV-style scorers need (projections, config, RoPE)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=heads * QUERY_GROUPS * head_dim, num_attention_heads=heads * QUERY_GROUPS,
                         num_key_value_heads=heads, head_dim=head_dim, max_position_embeddings=1 << 20)
    torch.manual_seed(0)
    module = LlamaAttention(config, layer_idx=0).eval().requires_grad_(False)
    module.rotary_emb = LlamaRotaryEmbedding(config)
    return module


def position_embeddings(module, n: int):
    ids = torch.arange(n)[None]
    return module.rotary_emb(torch.empty(1, n, 1), ids)


class ScoresOnly:
    """A scorer's ``score`` behind the ``compress`` signature the cases are timed through."""

    def __init__(self, scorer):
        self.scorer = scorer

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        return self.scorer.score(module, hidden_states, keys, values, attentions, kwargs)


def make_case(name: str, ratio: float, stride: int):
    from kvpress import ChunkPress, KnormPress, SnapKVPress

    from kvpress_phase import ChunkedStridePress, PhaseAwarePress, StaggeredWindowPress
    from kvpress_phase.presses.scorers import SnapKVScorer

    cases = {
        "chunked_select": lambda: ChunkedStridePress(ratio, stride=stride, window=stride, mode="select"),
        "chunked_pool": lambda: ChunkedStridePress(ratio, stride=stride, window=stride, mode="pool"),
        "chunked_pool_none": lambda: ChunkedStridePress(ratio, stride=stride, window=stride, mode="pool", rope="none"),
        "chunked_pool_score_centroid": lambda: ChunkedStridePress(
            ratio, stride=stride, window=stride, mode="pool", weighting="score", rope="centroid"
        ),
        "phase_aware": lambda: PhaseAwarePress(ratio, stride=stride),
        "snapkv_scores": lambda: ScoresOnly(SnapKVScorer()),
        "staggered_window": lambda: StaggeredWindowPress(ratio, stride=stride, scorer=KnormPress()),
        "phase_aware_row_knorm": lambda: PhaseAwarePress(ratio, stride=stride, scorer=KnormPress()),
        "phase_aware_row_snapkv": lambda: PhaseAwarePress(ratio, stride=stride, scorer=SnapKVPress()),
        "kvpress_snapkv": lambda: SnapKVPress(ratio),
        "kvpress_chunk": lambda: ChunkPress(KnormPress(ratio), chunk_length=stride),
    }
    if name == "copy":
        return None
    return cases[name]()


CASES = (
    "copy",
    "chunked_select",
    "chunked_pool",
    "chunked_pool_none",
    "chunked_pool_score_centroid",
    "phase_aware",
    "snapkv_scores",
    "phase_aware_window",
    "phase_aware_row_knorm",
    "phase_aware_row_snapkv",
    "kvpress_snapkv",
    "kvpress_chunk",
)


def run_once(press, module, keys, values, hidden, kwargs):
    if press is None:
        return keys.clone(), values.clone()
    with torch.no_grad():
        return press.compress(module, hidden, keys, values, None, kwargs)


def inputs(n: int, heads: int, head_dim: int, module, seed: int = 0):
    """Keys, values, hidden states and the forward kwargs (RoPE tables) of one layer; the hidden states are
    random (only query-aware scorers read them)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, heads, n, head_dim, generator=g)
    values = torch.randn(1, heads, n, head_dim, generator=g)
    hidden = torch.randn(1, n, module.config.hidden_size, generator=g)
    return keys, values, hidden, {"position_embeddings": position_embeddings(module, n)}


def time_case(name, n, args):
    module = make_module(args.head_dim, args.heads)
    keys, values, hidden, kwargs = inputs(n, args.heads, args.head_dim, module)
    press = make_case(name, args.ratio, args.stride)
    run_once(press, module, keys, values, hidden, kwargs)
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        run_once(press, module, keys, values, hidden, kwargs)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_child(name: str, n: int, heads: int, head_dim: int, ratio: float, stride: int) -> None:
    """Run in a fresh process: print the peak resident-set growth of one compress, in bytes.

    The kernel's peak counter (VmHWM) is reset just before the call by writing 5 to /proc/self/clear_refs, so the
    figure is the peak during the call minus the resident set just before it (outputs included).
    """
    module = make_module(head_dim, heads)
    keys, values, hidden, kwargs = inputs(n, heads, head_dim, module)
    press = make_case(name, ratio, stride)
    run_once(press, module, *inputs(256, heads, head_dim, module))  # imports and lazy initialisation are not counted
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    before = _status_kib("VmRSS")
    out = run_once(press, module, keys, values, hidden, kwargs)
    peak = _status_kib("VmHWM")
    del out
    print(json.dumps({"extra_bytes": (peak - before) * 1024}))


def peak_extra(name, n, args) -> float:
    cmd = [sys.executable, __file__, "--memory-child", name, "--sizes", str(n), "--heads", str(args.heads),
           "--head-dim", str(args.head_dim), "--ratio", str(args.ratio), "--stride", str(args.stride)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    return json.loads(out)["extra_bytes"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="4096,16384,65536", help="comma-separated sequence lengths N")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--stride", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--no-memory", action="store_true", help="skip the per-case memory processes")
    parser.add_argument("--output", help="append the Markdown report to this file")
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.memory_child:
        memory_child(args.memory_child, sizes[0], args.heads, args.head_dim, args.ratio, args.stride)
        return 0

    cases = args.cases.split(",")
    rows = {}
    for n in sizes:
        kv_bytes = 2 * args.heads * n * args.head_dim * 4
        for name in cases:
            t = time_case(name, n, args)
            mem = None if args.no_memory or name == "copy" else peak_extra(name, n, args) / kv_bytes
            rows[(name, n)] = (t, mem)
            print(f"N={n:>6} {name:<28} {t * 1e3:9.2f} ms" + (f"  peak extra {mem:.2f}x KV" if mem is not None else ""),
                  file=sys.stderr)

    lines = [
        f"### Presses on CPU, {datetime.date.today().isoformat()}",
        "",
        f"Command: `python benchmarks/bench_presses.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
        f"Machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}, Python {platform.python_version()}",
        f"Shape (1, {args.heads}, N, {args.head_dim}) float32, compression_ratio {args.ratio}, stride {args.stride}; "
        f"median of {args.repeats} runs.",
        "",
        "| case | " + " | ".join(f"N={n} ms" for n in sizes) + " | x copy @" + str(sizes[min(1, len(sizes) - 1)])
        + " | peak extra (x KV) | t(last)/t(prev) |",
        "|---" * (len(sizes) + 4) + "|",
    ]
    mid = sizes[min(1, len(sizes) - 1)]
    for name in cases:
        times = [rows[(name, n)][0] for n in sizes]
        vs_copy = rows[(name, mid)][0] / rows[("copy", mid)][0] if "copy" in cases else float("nan")
        mems = [rows[(name, n)][1] for n in sizes if rows[(name, n)][1] is not None]
        scale = times[-1] / times[-2] if len(times) > 1 else float("nan")
        lines.append(
            f"| {name} | " + " | ".join(f"{t * 1e3:.1f}" for t in times) + f" | {vs_copy:.2f} | "
            + (f"{max(mems):.2f}" if mems else "-") + f" | {scale:.2f} |"
        )
    if "kvpress_chunk" in cases:
        ref = rows[("kvpress_chunk", mid)][0]
        lines.append("")
        lines.append(f"Speed-up over kvpress ChunkPress at N={mid}: " + ", ".join(
            f"{name} {ref / rows[(name, mid)][0]:.1f}x" for name in cases if name.startswith(("chunked", "phase"))))
    report = "\n".join(lines) + "\n"
    print(report)
    if args.output:
        with open(args.output, "a") as fh:
            fh.write(report + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
