"""Memory of each press as users run it: kvpress's pipeline, one fresh process per press and ratio.

For every press spec and ratio a new Python process loads the model, builds one ``niah_single`` context of
``--tokens`` tokens, and answers its question through ``pipeline("kv-press-text-generation")`` with the press and a
``DynamicCache`` of its own, the answer forced to ``--answer-tokens`` tokens (the end-of-sequence token is not
honoured). It reports:

- **peak**: the growth of the process's peak resident memory (VmHWM, reset just before the pipeline call) over
  the loaded model: the prefill's activations, the cache, and whatever the press holds (a high-water mark, hence one
  process per press);
- **bytes after the prefill**: :func:`kvpress_phase.cache_bytes` of the cache when the pipeline starts answering
  (every tensor the cache holds, each storage once);
- **bytes at the answer's end**, before the pipeline removes the answer, and **after** it (what the cache holds
  when the pipeline returns);
- **entries**: live cache entries over every layer and KV head (a masked slot of kvpress's per-head presses counts:
  it is stored), against the press's budget (``ChunkedStridePress``'s cache length for ours);
- **prefill s**: from the pipeline call to its first answer step (tokenising, the prefill and the compression).

With ``--repeats N`` every press and ratio runs in N fresh processes and the table gives the median peak and prefill
time (a peak varies by tens of MiB between identical processes: the allocator's pages).

    python benchmarks/bench_press_memory.py --model smollm2 --tokens 4096 --ratios 0.5,0.75 \\
        --output docs/benchmarks.md

Press specs are the evaluation's (``kvpress-phase list``), except ``kvzip_plus``, which runs as kvpress's own
``KVzipPress(kvzip_plus_normalization=True)`` (the evaluation replays it from masks).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import append_result, bad_input, parse_list, parse_names, proc_status, reset_peak, run_line  # noqa: E402

PRESSES = ("no_press,chunked_stride,phase_aware,layer_budget:scorer=kvzap,global_budget:scorer=kvzap,"
           "threshold_budget,knorm,snapkv,adakv,kvzip_plus,dms_kvzap")
MIB = 2 ** 20


def build(spec: str, ratio: float, stride: int, n_tokens: int):
    """The press a user would build for ``spec`` at ``ratio`` (None for ``no_press``)."""
    if spec == "no_press":
        return None
    if spec == "kvzip_plus":
        from kvpress import KVzipPress

        return KVzipPress(compression_ratio=ratio, kvzip_plus_normalization=True)
    from kvpress_phase.evaluation.press_registry import build_press
    from kvpress_phase.evaluation.presses import parse_press_spec

    return build_press(parse_press_spec(spec), ratio, stride, None, 0)


def entries_of(cache) -> int:
    from kvpress_phase.ragged import RaggedLayer

    total = 0
    for layer in cache.layers:
        if isinstance(layer, RaggedLayer):
            total += layer.entries
        elif getattr(layer, "keys", None) is not None and layer.keys.numel():
            total += layer.keys.shape[0] * layer.keys.shape[1] * layer.keys.shape[2]
    return total


def one(args) -> dict:
    """Run one press at one ratio in this process; returns the figures."""
    import kvpress  # noqa: F401  (registers the "kv-press-text-generation" pipeline)
    import torch
    from transformers import DynamicCache, pipeline

    from kvpress_phase import cache_bytes, load_builtin_model
    from kvpress_phase.core.phase import compressed_length
    from kvpress_phase.evaluation.tasks import generate

    torch.set_num_threads(args.threads) if args.threads else None
    model, tokenizer = load_builtin_model(name=args.model)
    example = generate("niah_single", tokenizer, n_samples=1, context_length=args.tokens, stride=args.stride,
                       phases=[3], seed=args.seed)[0]
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    model.generation_config.eos_token_id = [-1]  # every answer is --answer-tokens long
    press = build(args.press, args.ratio, args.stride, args.tokens)
    cache = DynamicCache()
    seen: dict = {}
    generate_answer = pipe.generate_answer

    def measured(question_ids, cache, context_length, max_new_tokens):
        seen["prefill_s"] = time.perf_counter() - seen["start"]
        seen["bytes_prefill"] = cache_bytes(cache)
        seen["entries"] = entries_of(cache)
        seen["context_length"] = context_length
        answer = generate_answer(question_ids, cache, context_length, max_new_tokens)
        seen["bytes_answer_end"] = cache_bytes(cache)
        return answer

    pipe.generate_answer = measured
    with torch.inference_mode():  # every weight resident before the peak is reset (safetensors maps them lazily)
        model(input_ids=torch.tensor([[tokenizer.bos_token_id or 0] * 8]))
    base = reset_peak()
    seen["start"] = time.perf_counter()
    with torch.inference_mode():
        pipe(example["context"], question=example["question"], answer_prefix=example["answer_prefix"], press=press,
             max_new_tokens=args.answer_tokens, cache=cache)
    peak = proc_status("VmHWM") - base
    config = model.config
    n = seen["context_length"]
    layers, heads = config.num_hidden_layers, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    inner = getattr(press, "press", press)
    budget = None
    if hasattr(inner, "n_sink") and hasattr(inner, "stride"):
        budget = layers * heads * compressed_length(n, inner.stride, args.ratio, inner.n_sink, inner.n_local)
    return dict(press=args.press, ratio=args.ratio, tokens=n, peak=peak, bytes_prefill=seen["bytes_prefill"],
                bytes_answer_end=seen["bytes_answer_end"], bytes_after=cache_bytes(cache), entries=seen["entries"],
                budget=budget, uncompressed_entries=layers * heads * n,
                uncompressed_bytes=layers * heads * n * head_dim * 2 * model.dtype.itemsize,
                prefill_s=seen["prefill_s"], attention=config._attn_implementation)


def _median_rows(rows: list[dict]) -> list[dict]:
    """One row per press and ratio, in first-seen order: the median peak and prefill time over its repeats (the bytes
    and entries are the same in every repeat)."""
    import statistics

    groups: dict = {}
    for r in rows:
        groups.setdefault((r["press"], r["ratio"]), []).append(r)
    out = []
    for group in groups.values():
        row = dict(group[0])
        row["peak"] = statistics.median(r["peak"] for r in group)
        row["prefill_s"] = statistics.median(r["prefill_s"] for r in group)
        row["repeats"] = len(group)
        out.append(row)
    return out


def table(rows: list[dict]) -> list[str]:
    rows = _median_rows(rows)
    lines = ["| ratio | press | peak over the model MiB | bytes after prefill MiB | at the answer's end MiB | after "
             "MiB | x chunked_stride after prefill / at end | entries (budget) | prefill s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for ratio in sorted({r["ratio"] for r in rows}):
        here = [r for r in rows if r["ratio"] == ratio]
        chunked = next((r for r in here if r["press"] == "chunked_stride"), None)
        for r in here:
            versus = ""
            if chunked is not None:
                versus = (f"{r['bytes_prefill'] / chunked['bytes_prefill']:.3f} / "
                          f"{r['bytes_answer_end'] / chunked['bytes_answer_end']:.3f}")
            budget = f" ({r['budget']:,})" if r["budget"] else ""
            lines.append(f"| {ratio:g} | `{r['press']}` | {r['peak'] / MIB:.0f} | {r['bytes_prefill'] / MIB:.1f} | "
                         f"{r['bytes_answer_end'] / MIB:.1f} | {r['bytes_after'] / MIB:.1f} | {versus} | "
                         f"{r['entries']:,}{budget} | {r['prefill_s']:.1f} |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="a real model's name (load_builtin_model)")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--ratios", default="0.5,0.75")
    p.add_argument("--presses", default=PRESSES)
    p.add_argument("--stride", type=int, default=8)
    p.add_argument("--answer-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1,
                   help="fresh processes per press and ratio; the table gives the median of peak and prefill time")
    p.add_argument("--output", help="append the Markdown table to this file")
    p.add_argument("--json", help="write every row to this JSON file (rows already there are kept and skipped)")
    p.add_argument("--press", help=argparse.SUPPRESS)
    p.add_argument("--ratio", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.press is not None:  # the child: one press, one ratio
        print("RESULT " + json.dumps(one(args)), flush=True)
        return 0
    try:
        ratios = parse_list(args.ratios, float, "ratios")
        presses = parse_names(args.presses)
        from kvpress_phase.builtin import check_model_name

        check_model_name(args.model)
    except ValueError as exc:
        return bad_input(exc)
    rows = json.load(open(args.json)) if args.json and os.path.exists(args.json) else []
    done = {(r["press"], r["ratio"], r.get("repeat", 0)) for r in rows}
    from tqdm import tqdm

    todo = [(ratio, spec, repeat) for repeat in range(args.repeats) for ratio in ratios for spec in presses
            if (spec, ratio, repeat) not in done]
    for ratio, spec, repeat in tqdm(todo, desc="presses", unit="process"):
        command = [sys.executable, os.path.abspath(__file__), "--model", args.model, "--tokens", str(args.tokens),
                   "--stride", str(args.stride), "--answer-tokens", str(args.answer_tokens), "--seed", str(args.seed),
                   "--threads", str(args.threads), "--press", spec, "--ratio", str(ratio)]
        # big allocations mapped and unmapped one by one: the peak follows the live tensors, not glibc's cached heap
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(64 * 1024), MALLOC_TRIM_THRESHOLD_=str(128 * 1024))
        out = subprocess.run(command, capture_output=True, text=True, env=env)
        found = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        if out.returncode != 0 or not found:
            tqdm.write(f"{spec} at {ratio:g} failed:\n{out.stderr[-2000:]}")
            continue
        rows.append(dict(json.loads(found[-1][len("RESULT "):]), repeat=repeat))
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(rows, fh, indent=1)
    lines = [run_line("bench_press_memory.py", argv), "", *table(rows)]
    print("\n".join(lines))
    append_result(args.output, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
