"""What each press adds to one prefill on Llama-3.1-8B's layer shapes, next to kvpress's own presses (GPU).

One prefill of a 2-layer Llama built from a config (Llama-3.1-8B's attention and MLP shapes, bfloat16, sdpa, random
weights) over the first ``niah_single`` context of N tokens, with each press applied as kvpress applies it during a
prefill: ``with press(model): model.model(input_ids=ids, past_key_values=DynamicCache())``. Every press compresses
at ratio 0.5 (ours with stride 8; kvpress's chunked presses with chunks of 20 tokens). For every N and press:

- ``s``: seconds of the prefill, the median of 3 timed runs (2 above 32k) after one untimed run of the same call
  (compiles and first uses), CUDA synchronised before and after;
- ``peak_gib``: ``torch.cuda.max_memory_allocated()`` over the run (reset before it), the largest of the runs;
- ``cache_len_layer0``: the first layer's cache length after the prefill;
- ``x_prefill`` and ``extra_peak_gib``: time and peak against the run without a press at the same N.

The JSON is rewritten after every measurement; a case that fails is recorded under ``errors`` and the others go
on; a case not started before ``--deadline`` seconds (counted from the start, imports included) is recorded as
skipped. The learned scorer (``scorer="kvzap"``) is not timed: no scorer exists for a random model.

    python benchmarks/prefill_overhead.py --deadline 140 --out gpu_extra.json   # one CUDA GPU (130 s on an H200)
    python benchmarks/prefill_overhead.py --small --out prefill_small.json       # tiny float32 model on the CPU

``--small`` runs the same cases on a tiny float32 model on the CPU (256 and 512 tokens unless ``--sizes`` says
otherwise), one timed run each, the Triton backend through Triton's interpreter: it checks that the script runs
(``tests/benchmarks/test_prefill_overhead.py``), not speed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time

SMALL_SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128)
LLAMA_8B_SHAPE = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      intermediate_size=14336)
RATIO = 0.5


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="tiny shapes on the CPU (a dry run)")
    p.add_argument("--out", default="gpu_extra.json", help="the JSON to write (rewritten after every case)")
    p.add_argument("--deadline", type=float, default=240, help="start no case after this many seconds")
    p.add_argument("--sizes", default=None, help="comma-separated context lengths (default 8192,32768,131072; "
                   "--small: 256,512)")
    return p.parse_args(argv)


def presses():
    """name -> a function that builds the press (None: the prefill without a press)."""
    import kvpress as kp

    from kvpress_phase import ChunkedStridePress, GlobalBudgetPress, HeadBudgetPress, LayerBudgetPress, PhaseAwarePress

    R = RATIO
    return {
        "none": lambda: None,
        "chunked_stride(triton)": lambda: ChunkedStridePress(R, stride=8, backend="triton"),
        "chunked_stride(torch)": lambda: ChunkedStridePress(R, stride=8, backend="torch"),
        "chunked_stride:pool(triton)": lambda: ChunkedStridePress(R, stride=8, mode="pool", backend="triton"),
        "chunked_stride:pool(torch)": lambda: ChunkedStridePress(R, stride=8, mode="pool", backend="torch"),
        "phase_aware(triton)": lambda: PhaseAwarePress(R, stride=8, backend="triton"),
        "phase_aware(torch)": lambda: PhaseAwarePress(R, stride=8, backend="torch"),
        "LayerBudget(phase_aware)": lambda: LayerBudgetPress(PhaseAwarePress(R, stride=8)),
        "GlobalBudget(phase_aware)": lambda: GlobalBudgetPress(PhaseAwarePress(R, stride=8)),
        "HeadBudget(phase_aware)": lambda: HeadBudgetPress(PhaseAwarePress(R, stride=8)),
        "kvpress KeyDiff": lambda: kp.KeyDiffPress(R),
        "kvpress Knorm": lambda: kp.KnormPress(R),
        "kvpress SnapKV": lambda: kp.SnapKVPress(R),
        "kvpress StreamingLLM": lambda: kp.StreamingLLMPress(R),
        "kvpress ExpectedAttention": lambda: kp.ExpectedAttentionPress(R),
        "kvpress ChunkPress(KeyDiff,20)": lambda: kp.ChunkPress(kp.KeyDiffPress(R), 20),
        "kvpress ChunkKV(SnapKV,20)": lambda: kp.ChunkKVPress(kp.SnapKVPress(R), 20),
        "kvpress AdaKV(KeyDiff)": lambda: kp.AdaKVPress(kp.KeyDiffPress(R)),
        "kvpress KVzip": lambda: kp.KVzipPress(R),
        "kvpress KVzip+": lambda: kp.KVzipPress(R, kvzip_plus_normalization=True),
    }


def main(argv=None) -> int:
    args = _parse(argv)
    t_start = time.perf_counter()
    if args.small:  # before anything imports triton: the Triton backend then runs on CPU tensors, interpreted
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import kvpress  # noqa: F401 - registers the "kv-press-text-generation" pipeline
    import torch
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, pipeline

    from kvpress_phase.evaluation.tasks import generate
    from kvpress_phase.evaluation.tokenizer import build_tokenizer

    dev = "cpu" if args.small else "cuda"
    if dev == "cuda" and not torch.cuda.is_available():
        print("prefill_overhead: error: no CUDA device is available; --small runs the CPU version", file=sys.stderr)
        return 2
    tok = build_tokenizer()
    if args.small:
        shape, sizes, dtype = SMALL_SHAPE, args.sizes or "256,512", torch.float32
    else:
        shape, sizes, dtype = LLAMA_8B_SHAPE, args.sizes or "8192,32768,131072", torch.bfloat16
    sizes = [int(s) for s in sizes.split(",")]
    cfg = LlamaConfig(num_hidden_layers=2, vocab_size=len(tok), max_position_embeddings=262144, rope_theta=500000.0,
                      attn_implementation="sdpa", **shape)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device=dev, dtype=dtype).eval()
    tokdir = tempfile.TemporaryDirectory()
    tok.save_pretrained(tokdir.name)
    model.config._name_or_path = tokdir.name  # KVzip loads the tokenizer by the model's name
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tok, device=model.device)
    cases = presses()
    res = {"device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu", "torch": torch.__version__,
           "dtype": str(dtype), "layers": 2, "shape": shape, "ratio": RATIO, "rows": [], "errors": {},
           "command": " ".join(["python", "benchmarks/prefill_overhead.py"] + list(argv if argv is not None
                                                                                  else sys.argv[1:])),
           "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
           "python": platform.python_version()}

    def save():
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    def run(make, ctx, q):
        press = make()
        ids = pipe.preprocess(ctx, [q], "", 1 << 30)["context_ids"].to(model.device)
        if dev == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sync()
        t0 = time.perf_counter()
        cache = DynamicCache()
        with torch.no_grad(), (press(model) if press is not None else contextlib.nullcontext()):
            model.model(input_ids=ids, past_key_values=cache)
        sync()
        kept = cache.get_seq_length(0)
        peak = torch.cuda.max_memory_allocated() if dev == "cuda" else 0
        return time.perf_counter() - t0, peak, kept, ids.shape[1]

    for n in sizes:
        row = generate("niah_single", tok, n_samples=1, context_length=n, stride=8, phases=[3], seed=0)[0]
        base = None
        for name, make in cases.items():
            if time.perf_counter() - t_start > args.deadline:
                res["errors"][f"{n}:{name}"] = "skipped: deadline"
                continue
            try:
                run(make, row["context"], row["question"])  # warm-up: compiles and first uses
                ts, peaks = [], []
                for _ in range(1 if args.small else (3 if n <= 32768 else 2)):
                    t, pk, kept, ntok = run(make, row["context"], row["question"])
                    ts.append(t)
                    peaks.append(pk)
                t = statistics.median(ts)
                if name == "none":
                    base = (t, max(peaks))
                r = {"tokens": ntok, "press": name, "s": round(t, 4), "peak_gib": round(max(peaks) / 2**30, 3),
                     "cache_len_layer0": kept}
                if base:
                    r["x_prefill"] = round(t / base[0], 3)
                    r["extra_peak_gib"] = round((max(peaks) - base[1]) / 2**30, 3)
                res["rows"].append(r)
                print(json.dumps(r), flush=True)
            except Exception as e:  # noqa: BLE001 - record the case's failure and go on
                res["errors"][f"{n}:{name}"] = f"{type(e).__name__}: {str(e)[:300]}"
                print("ERR", n, name, type(e).__name__, str(e)[:200], flush=True)
                if dev == "cuda":
                    torch.cuda.empty_cache()
            save()
    res["seconds"] = round(time.perf_counter() - t_start, 1)
    save()
    tokdir.cleanup()
    print("prefill_overhead done in", res["seconds"], "s;", len(res["errors"]), "errors or skipped cases", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
