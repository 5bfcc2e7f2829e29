"""Prefill time and peak memory of a real model at long contexts, one fresh process per (length, dtype), as the
evaluation prefills (the base model over the context into a ``DynamicCache``, no logits).

    python benchmarks/bench_long_prefill.py --model qwen2.5-coder-0.5b --lengths 4096,8192,16384 \
        --dtypes float32 [--threads 2] [--json FILE]

Each child loads the model, prefills a 256-token warm-up, then a context of the length (a RULER haystack of the
suite's own text, ``niah_single``), and reports the wall time of that prefill, the process's peak resident memory
(``ru_maxrss``: a high-water mark, so one process per measurement) and the cache's bytes. ``--json`` appends one
line per measurement and skips measurements already in the file (resumable).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time


def child(model_name: str, length: int, dtype: str, threads: int) -> dict:
    import resource

    import torch
    from transformers import DynamicCache

    from kvpress_phase import cache_bytes
    from kvpress_phase.evaluation.commands import load_model
    from kvpress_phase.evaluation.tasks import generate

    torch.set_num_threads(threads)
    model, tokenizer = load_model(model_name, "cpu", dtype)
    example = generate("niah_single", tokenizer, n_samples=1, context_length=length, stride=8, phases=[0])[0]
    ids = tokenizer(example["context"], return_tensors="pt", add_special_tokens=False).input_ids
    with torch.inference_mode():
        model.model(input_ids=ids[:, :256], past_key_values=DynamicCache())
        cache = DynamicCache()
        start = time.perf_counter()
        model.model(input_ids=ids, past_key_values=cache)
        seconds = time.perf_counter() - start
    return {"model": model_name, "length": int(ids.shape[1]), "requested": length, "dtype": dtype,
            "threads": threads, "prefill_s": round(seconds, 2),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "cache_mib": round(cache_bytes(cache) / 2**20, 2)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--lengths", default="4096,8192,16384")
    parser.add_argument("--dtypes", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", nargs=2, metavar=("LENGTH", "DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.model, int(args.child[0]), args.child[1], args.threads)))
        return 0
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        parser.error(f"--lengths: comma-separated integers, got {args.lengths!r}")
    done = set()
    if args.json and os.path.exists(args.json):
        with open(args.json) as fh:
            done = {(r["requested"], r["dtype"]) for r in map(json.loads, fh) if "requested" in r}
    for dtype in args.dtypes.split(","):
        for length in lengths:
            if (length, dtype) in done:
                continue
            out = subprocess.run([sys.executable, __file__, "--model", args.model, "--threads", str(args.threads),
                                  "--child", str(length), dtype], capture_output=True, text=True)
            if out.returncode:
                print(f"{length} {dtype}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
                continue
            row = json.loads(out.stdout.strip().splitlines()[-1])
            row.update(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), machine=platform.machine(),
                       cpus=os.cpu_count())
            print(json.dumps(row), flush=True)
            if args.json:
                with open(args.json, "a") as fh:
                    fh.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
