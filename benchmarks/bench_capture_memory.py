"""Memory of the replay runner's capture, measured on a model with Llama-3.1-8B's attention shapes.

A Llama built from a config with Llama-3.1-8B's attention (hidden 4096, 32 query heads, 8 KV heads, head dim 128)
and ``--layers`` layers, a small MLP (``--intermediate``, default 512: the MLP does not change what the capture holds)
and random weights, prefilled through ``ReplayEngine.prefill`` at each of ``--lengths`` tokens (a real prefill: the
captured tensors are the model's own). For each length it reports

- the bytes the capture holds (``Prefill.captured_bytes()``: every recorded tensor and the cache, each storage once)
  with every input recorded (what a press that reads hidden states needs) and with the keys and values only (what
  ChunkedStridePress, PhaseAwarePress, KnormPress, StreamingLLMPress and ChunkPress need), next to the formula
  of the README;
- the growth of the process's peak resident memory (VmHWM, reset before each step) during the prefill, during the
  decoding of the uncompressed variant and during that of a ChunkedStridePress variant (ratio 0.5).

The difference between the prefill's peak growth and the captured bytes is the prefill's transient activation
memory (``A(n)`` in the README). ``--fit-intermediate I2`` repeats the first length with an MLP of width ``I2`` to
separate the MLP's share of it. The report ends with the extrapolation of the formulas to Llama-3.1-8B (32 layers,
MLP 14336, bfloat16) on an 80 GB GPU.

    python benchmarks/bench_capture_memory.py --lengths 4096,8192 --layers 2 --fit-intermediate 4096
    python benchmarks/bench_capture_memory.py --lengths 16384 --layers 2
    python benchmarks/bench_capture_memory.py --lengths 32768 --layers 2 --skip-lean
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import sys
import time

import torch

from common import proc_status, reset_peak

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 4096, 32, 8, 128
GiB = 2**30


def _return_freed_memory() -> None:
    """Make glibc serve every allocation of 128 KiB or more with its own mapping, returned to the system when freed
    (by default the threshold grows after frees and freed tensors stay resident, hiding later allocations)."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD
    except OSError:  # not glibc: the peaks may then undercount steps after the first
        pass


def capture_formula(n: int, layers: int, elt: int, hidden: bool) -> int:
    """Bytes the capture holds for ``n`` tokens (batch 1): keys and values of every layer, hidden states of every
    layer when recorded, RoPE cos and sin (shared by the layers) and the int64 positions (shared)."""
    per_layer = 2 * KV_HEADS * HEAD_DIM + (HIDDEN if hidden else 0)
    return n * (layers * per_layer * elt + 2 * HEAD_DIM * elt + 8)


def build(layers: int, intermediate: int, dtype: torch.dtype, vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         head_dim=HEAD_DIM, intermediate_size=intermediate, num_hidden_layers=layers,
                         vocab_size=vocab, max_position_embeddings=131072, rope_theta=500000.0,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype).eval()


@torch.inference_mode()
def _pipeline_answer(engine, state, press, question_ids: torch.Tensor, max_new_tokens: int) -> str:
    """The kvpress pipeline's own greedy answer (``generate_answer``) over ``press``'s replayed cache."""
    cache = engine.compressed_cache(state, press)
    return engine.pipe.generate_answer(question_ids=question_ids.to(engine.model.device), cache=cache,
                                       context_length=state.context_length, max_new_tokens=max_new_tokens)


def measure(engine, n: int, layers: int, elt: int, lean: bool, decode: bool) -> dict:
    from kvpress_phase import ChunkedStridePress

    vocab = engine.model.config.vocab_size
    ids = torch.randint(4, vocab, (1, n), generator=torch.Generator().manual_seed(n))
    question = torch.randint(4, vocab, (1, 16), generator=torch.Generator().manual_seed(1))
    out = {"tokens": n, "layers": layers}

    base = reset_peak()
    t0 = time.perf_counter()
    state = engine.prefill(ids)  # every input recorded
    out["prefill_s"] = time.perf_counter() - t0
    out["prefill_peak_growth"] = proc_status("VmHWM") - base
    out["captured"] = state.captured_bytes()
    out["captured_formula"] = capture_formula(n, layers, elt, hidden=True)
    if decode:
        base = reset_peak()
        _pipeline_answer(engine, state, None, question, 4)
        out["decode_uncompressed_peak_growth"] = proc_status("VmHWM") - base
        base = reset_peak()
        _pipeline_answer(engine, state, ChunkedStridePress(0.5, stride=8), question, 4)
        out["decode_compressed_peak_growth"] = proc_status("VmHWM") - base
    del state
    if lean:
        base = reset_peak()
        state = engine.prefill(ids, reads=frozenset())  # keys and values only (what ChunkedStridePress reads)
        out["lean_prefill_peak_growth"] = proc_status("VmHWM") - base
        out["captured_lean"] = state.captured_bytes()
        out["captured_lean_formula"] = capture_formula(n, layers, elt, hidden=False)
        del state
    gc.collect()
    return out


def extrapolate(activation_per_token_d: float, activation_per_token_i: float) -> list[str]:
    """Llama-3.1-8B (32 layers, MLP 14336, bfloat16) on an 80 GB GPU, from the formulas of docs/evaluation.md."""
    L, I, b = 32, 14336, 2
    weights = 8.03e9 * b
    usable = 79.6 * GiB - 4 * GiB  # an H100 80GB shows 79.6 GiB; 4 GiB for the CUDA context and allocator slack
    kv = lambda n: n * L * 2 * KV_HEADS * HEAD_DIM * b  # noqa: E731
    hid = lambda n: n * L * HIDDEN * b  # noqa: E731
    act = lambda n: n * b * (activation_per_token_d * HIDDEN + activation_per_token_i * I)  # noqa: E731

    groups = HEADS // KV_HEADS  # the question's forward repeats one layer's keys and values per query head

    def peak(n, hidden, offload):
        layer = (kv(n) + (hid(n) if hidden else 0)) / L
        decode = kv(n) * (1 + (1 + groups) / L)  # the uncompressed variant: its cache, one layer's copy and repeat
        if offload:  # prefill: one layer in flight; replay: the uncompressed cache being decoded
            return weights + max(act(n) + layer, decode)
        capture = kv(n) + (hid(n) if hidden else 0)
        # decoding the uncompressed variant copies the recorded cache once (the question appends to it)
        return weights + capture + max(act(n), kv(n) * (1 + groups / L))

    def longest(hidden, offload):
        n = 1024
        while n <= 1 << 20 and peak(n, hidden, offload) <= usable:
            n += 1024
        return n - 1024

    lines = ["| context | capture (KV) | capture (KV + hidden) | peak, KV only | peak, KV + hidden | "
             "peak with --offload cpu, KV + hidden |", "|---:|---:|---:|---:|---:|---:|"]
    for n in (32768, 65536, 131072):
        lines.append(f"| {n // 1024}k | {kv(n) / GiB:.1f} GiB | {(kv(n) + hid(n)) / GiB:.1f} GiB | "
                     f"{peak(n, False, False) / GiB:.1f} GiB | {peak(n, True, False) / GiB:.1f} GiB | "
                     f"{peak(n, True, True) / GiB:.1f} GiB |")
    lines += ["", f"Longest context within {usable / GiB:.1f} GiB (an 80 GB GPU's 79.6 GiB less 4 GiB for the CUDA "
              f"context and the allocator), weights {weights / GiB:.1f} GiB: "
              f"KV only {longest(False, False) // 1024}k tokens, KV + hidden {longest(True, False) // 1024}k, "
              f"with --offload cpu {longest(True, True) // 1024}k (KV + hidden; "
              f"{longest(False, True) // 1024}k KV only)."]
    return lines


def report(rows: list[dict], argv, layers: int, dtype: str, base_intermediate: int) -> tuple[str, bool]:
    elt = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    mib = lambda x: f"{x / 2**20:.0f}" if x is not None else "-"  # noqa: E731
    lines = [
        f"### Capture memory, {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        "",
        f"Command: `python benchmarks/bench_capture_memory.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
        f"Machine: {platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}; "
        f"model: Llama-3.1-8B attention shapes, {layers} layers, {dtype}, sdpa, random weights",
        "",
        "| tokens | MLP | prefill s | captured MiB (all inputs) | formula MiB | captured MiB (K/V only) | "
        "formula MiB | prefill peak growth MiB | activations A(n) MiB | "
        "decode peak growth MiB, uncompressed / ratio 0.5 |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(rows, key=lambda r: (r["intermediate"], r["tokens"])):
        lines.append(
            f"| {r['tokens']} | {r['intermediate']} | {r['prefill_s']:.0f} | {mib(r['captured'])} | "
            f"{mib(r['captured_formula'])} | {mib(r.get('captured_lean'))} | {mib(r.get('captured_lean_formula'))} | "
            f"{mib(r['prefill_peak_growth'])} | {mib(r['activation'])} | "
            f"{mib(r.get('decode_uncompressed_peak_growth'))} / {mib(r.get('decode_compressed_peak_growth'))} |")
    exact = all(r["captured"] == r["captured_formula"]
                and r.get("captured_lean") == r.get("captured_lean_formula", r.get("captured_lean")) for r in rows)
    lines += ["", f"Captured bytes equal to the formula at every length: {'yes' if exact else 'NO'}."]
    base = sorted((r for r in rows if r["intermediate"] == base_intermediate), key=lambda r: r["tokens"])
    fit = [r for r in rows if r["intermediate"] != base_intermediate]
    if len(base) >= 2 and fit:
        # A(n) = c + n * elt * (alpha * hidden + beta * intermediate): the slope over the lengths, and the MLP share
        # from the same length with another MLP width (the constant cancels)
        ns = torch.tensor([float(r["tokens"]) for r in base])
        acts = torch.tensor([float(r["activation"]) for r in base])
        slope = float(((ns - ns.mean()) * (acts - acts.mean())).sum() / ((ns - ns.mean()) ** 2).sum()) / elt
        same_n = next(r for r in base if r["tokens"] == fit[0]["tokens"])
        beta = (fit[0]["activation"] - same_n["activation"]) / fit[0]["tokens"] / elt / (
            fit[0]["intermediate"] - base_intermediate)
        alpha = (slope - beta * base_intermediate) / HIDDEN
        lines += ["", f"Prefill activations: A(n) grows by {slope:.0f} elements per token with MLP "
                  f"{base_intermediate} (least squares over {len(base)} lengths), of which {beta:.2f} * MLP width "
                  f"(MLP {fit[0]['intermediate']} against {base_intermediate} at {fit[0]['tokens']} tokens): "
                  f"A(n) ~ n * bytes per element * ({alpha:.2f} * hidden + {beta:.2f} * MLP width).",
                  "", "Extrapolated to Llama-3.1-8B (32 layers, MLP 14336, bfloat16, batch 1) with "
                  "docs/evaluation.md's formulas (an extrapolation, not a GPU measurement):", ""]
        lines += extrapolate(alpha, beta)
    return "\n".join(lines) + "\n", exact


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="4096,8192", help="comma-separated context lengths")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=512, help="MLP width (the capture does not depend on it)")
    p.add_argument("--fit-intermediate", type=int, default=None,
                   help="also run the first length with this MLP width, to separate the MLP's activation share")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="float32 by default: bfloat16 matmuls are emulated and slow on CPUs without AVX-512")
    p.add_argument("--skip-lean", action="store_true", help="skip the keys-and-values-only prefill")
    p.add_argument("--skip-decode", action="store_true", help="skip the decoding steps")
    p.add_argument("--combine", help="comma-separated JSON files of earlier runs: report on them, measure nothing")
    p.add_argument("--output", help="append the Markdown report to this file")
    p.add_argument("--json", help="write the measurements to this file")
    args = p.parse_args(argv)

    if args.combine:
        rows = []
        for path in args.combine.split(","):
            with open(path) as fh:
                rows += json.load(fh)
        text, exact = report(rows, argv, rows[0]["layers"], rows[0].get("dtype", args.dtype), args.intermediate)
        print(text)
        if args.output:
            with open(args.output, "a") as fh:
                fh.write(text + "\n")
        return 0 if exact else 1

    from kvpress_phase.evaluation.replay import ReplayEngine
    from kvpress_phase.evaluation.tokenizer import build_tokenizer

    _return_freed_memory()
    dtype = getattr(torch, args.dtype)
    elt = torch.empty((), dtype=dtype).element_size()
    tok = build_tokenizer()
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = []
    runs = [(args.intermediate, n) for n in lengths]
    if args.fit_intermediate:
        runs.append((args.fit_intermediate, lengths[0]))
    engines = {}
    for intermediate, n in runs:
        if intermediate not in engines:
            engines.clear()
            gc.collect()
            engines[intermediate] = ReplayEngine(build(args.layers, intermediate, dtype, len(tok)), tok)
        r = measure(engines[intermediate], n, args.layers, elt, lean=not args.skip_lean, decode=not args.skip_decode)
        r.update(intermediate=intermediate, dtype=args.dtype, activation=r["prefill_peak_growth"] - r["captured"])
        rows.append(r)
        print(json.dumps(r), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)
    text, exact = report(rows, argv, args.layers, args.dtype, args.intermediate)
    print(text)
    if args.output:
        with open(args.output, "a") as fh:
            fh.write(text + "\n")
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
