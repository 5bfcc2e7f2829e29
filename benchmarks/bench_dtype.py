"""Which dtype serves this CPU: a prefill and a decoding step of the real models in float32 and bfloat16.

For every model and dtype: the median wall time of a ``--context-length``-token prefill (``model.model`` over ordinary
text, a fresh cache each time, then the logits of its last position) and of one decoding step after it (one token
through the model with that cache), over ``--repeats`` runs after one warm-up, at ``--threads`` threads. Prints a
Markdown table with the command, the machine (CPU model, whether it has AMX bf16) and the date, to paste into the docs.
Speed only: whether a dtype answers as well is the evaluation's (``kvpress-phase eval --dtype``).

    python benchmarks/bench_dtype.py --models smollm2,qwen2.5-coder-0.5b --threads 2
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time

from common import cpu_name, set_threads


def cpu_description() -> str:
    """The CPU's model name (:func:`common.cpu_name`) and whether it has AMX bf16 (its flag in ``/proc/cpuinfo``;
    'without' where that cannot be read)."""
    try:
        with open("/proc/cpuinfo") as fh:
            amx = "amx_bf16" in fh.read()
    except OSError:
        amx = False
    return f"{cpu_name()}, {'with' if amx else 'without'} amx_bf16"


def time_model(name: str, dtype, context_length: int, repeats: int) -> tuple[float, float]:
    """Median seconds of a prefill and of one decoding step of ``name`` in ``dtype``."""
    import torch
    from transformers import DynamicCache

    from kvpress_phase import load_builtin_model

    model, tokenizer = load_builtin_model(name=name, dtype=dtype)
    text = " ".join(["The committee met again on Tuesday to review the budget and the schedule of the works."] * 400)
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :context_length]
    if ids.shape[1] < context_length:
        raise ValueError(f"the benchmark text gives only {ids.shape[1]} tokens with {name}'s tokenizer")
    prefill, step = [], []
    with torch.inference_mode():
        for i in range(repeats + 1):
            cache = DynamicCache()
            start = time.perf_counter()
            hidden = model.model(input_ids=ids, past_key_values=cache, use_cache=True).last_hidden_state
            nxt = model.lm_head(hidden[:, -1:]).argmax(-1)  # logits of the last position only, as the evaluation
            middle = time.perf_counter()
            model(input_ids=nxt, past_key_values=cache, use_cache=True)
            end = time.perf_counter()
            if i:  # the first run warms up
                prefill.append(middle - start)
                step.append(end - middle)
    return statistics.median(prefill), statistics.median(step)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2,qwen2.5-coder-0.5b")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--context-length", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    import torch

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    bad = [d for d in args.dtypes.split(",") if d not in dtypes]
    if bad or args.repeats < 1 or args.context_length < 1 or args.threads < 1:
        parser.error(f"--dtypes takes {', '.join(dtypes)} (got {', '.join(bad)})" if bad else
                     "--repeats, --context-length and --threads must be positive")
    set_threads(args.threads)
    rows = []
    for name in args.models.split(","):
        base = None
        for dtype in args.dtypes.split(","):
            prefill, step = time_model(name, dtypes[dtype], args.context_length, args.repeats)
            base = base or (prefill, step)
            rows.append(f"| {name} | {dtype} | {prefill * 1000:.0f} | {base[0] / prefill:.2f}x | {step * 1000:.1f} | "
                        f"{base[1] / step:.2f}x |")
            print(rows[-1], file=sys.stderr, flush=True)
    print(f"`python benchmarks/bench_dtype.py {' '.join(argv if argv is not None else sys.argv[1:])}`, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {cpu_description()}, "
          f"{args.threads} threads, {args.context_length}-token prefill, median of {args.repeats} after a warm-up\n")
    print("| model | dtype | prefill (ms) | speed vs the first dtype | decoding step (ms) | speed vs the first dtype |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
