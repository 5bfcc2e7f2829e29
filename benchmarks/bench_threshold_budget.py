"""The budget over the model decided layer by layer (ThresholdBudgetPress) against the exact global choice
(GlobalBudgetPress): the share of the cache each keeps over many contexts, and the prefill's peak memory.

Both wrap ``PhaseAwarePress(ratio, scorer="kvzap")`` and store each KV head ragged. GlobalBudgetPress keeps exactly
the matched cache's entries (ChunkedStridePress's at the same ratio) in every context; ThresholdBudgetPress keeps
the window tokens scoring above the threshold calibrated on the scorer's text (``thresholds.json``), so what it
keeps varies with the context.

1. **Entries kept.** For every context of the evaluation's generators (``--tasks``, ``--context-lengths``,
   ``--seeds``, ``--samples`` per task; the dev seeds by default) and every ``--ratios``, one prefill under each
   press; reports the achieved ratio (``1 - attended / before``, :func:`~kvpress_phase.cache_summary`) of each, and
   ThresholdBudgetPress's entries as a multiple of GlobalBudgetPress's: mean, standard deviation, min and max over
   the contexts.
2. **Peak memory** (``--peak-length``, 0 to skip): the growth of the process's peak resident memory (VmHWM, reset
   before each prefill; Linux) during one prefill of that many tokens under no press, ``LayerBudgetPress``,
   ``GlobalBudgetPress`` and ``ThresholdBudgetPress`` (ratio ``--peak-ratio``), beside the uncompressed cache's bytes.

    python benchmarks/bench_threshold_budget.py --model smollm2 --output docs/results/threshold-budget.md
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from common import append_result, bad_input, parse_list, parse_names, proc_status, reset_peak, run_line, set_threads


def make_press(kind: str, ratio: float, stride: int):
    from kvpress_phase import GlobalBudgetPress, LayerBudgetPress, PhaseAwarePress
    from kvpress_phase.presses.ablations import ThresholdBudgetPress

    wrappers = {"global": GlobalBudgetPress, "threshold": ThresholdBudgetPress, "layers": LayerBudgetPress}
    return None if kind == "none" else wrappers[kind](PhaseAwarePress(ratio, stride=stride, scorer="kvzap"))


def prefill(model, ids: torch.Tensor, press):
    """One prefill under ``press`` as kvpress's pipeline runs it; the cache."""
    import contextlib

    from transformers import DynamicCache

    cache = DynamicCache()
    try:
        with torch.no_grad(), (press(model) if press is not None else contextlib.nullcontext()):
            model.model(ids, past_key_values=cache)
    finally:
        model.set_attn_implementation("sdpa")
        for layer in model.model.layers:
            layer.self_attn.masked_key_indices = None
    return cache


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--ratios", default="0.25,0.5,0.75")
    parser.add_argument("--context-lengths", default="1024,2048")
    parser.add_argument("--tasks", default="niah_single,niah_multikey,niah_multivalue")
    parser.add_argument("--seeds", default="10,15", help="generator seeds (default: the dev seeds 10,15)")
    parser.add_argument("--samples", type=int, default=2, help="contexts per task, length and seed")
    parser.add_argument("--stride", type=int, default=8)
    parser.add_argument("--peak-length", type=int, default=8192, help="tokens of the peak-memory prefill (0: skip)")
    parser.add_argument("--peak-ratio", type=float, default=0.75)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output", help="append the Markdown result to this file")
    args = parser.parse_args(argv)
    try:
        ratios = parse_list(args.ratios, float, "ratios")
        lengths = parse_list(args.context_lengths, int, "context-lengths")
        seeds = parse_list(args.seeds, int, "seeds")
        tasks = parse_names(args.tasks)
        if args.samples < 1 or args.peak_length < 0:
            raise ValueError("--samples must be >= 1 and --peak-length >= 0")
    except ValueError as exc:
        return bad_input(exc)
    set_threads(args.threads)

    from tqdm.auto import tqdm

    from kvpress_phase import cache_summary, load_builtin_model
    from kvpress_phase.evaluation.tasks import generate

    model, tokenizer = load_builtin_model(name=args.model)
    model.set_attn_implementation("sdpa")
    lines = [f"{run_line('bench_threshold_budget.py', argv)}, {args.model}, stride {args.stride}", ""]
    contexts = []
    for task in tasks:
        for length in lengths:
            for seed in seeds:
                for row in generate(task, tokenizer, n_samples=args.samples, context_length=length, stride=args.stride,
                                    phases=[0], seed=seed):
                    contexts.append((task, length, tokenizer(row["context"], return_tensors="pt").input_ids))
    found = []
    for ratio in ratios:
        for task, length, ids in tqdm(contexts, desc=f"ratio {ratio:g}", unit="context", dynamic_ncols=True):
            row = {"ratio": ratio, "task": task, "length": length}
            for kind in ("global", "threshold"):
                press = make_press(kind, ratio, args.stride)
                prefill(model, ids, press)
                summary = cache_summary(press)
                row[kind] = summary.achieved_ratio
                row[kind + "_entries"] = summary.entries_attended
            row["multiple"] = row["threshold_entries"] / row["global_entries"]
            found.append(row)
    lines += [f"Entries kept over {len(contexts)} contexts ({', '.join(tasks)}; {args.context_lengths} tokens; seeds "
              f"{args.seeds}; {args.samples} per task, length and seed)", "",
              "| ratio | tokens | GlobalBudgetPress achieved | ThresholdBudgetPress achieved (mean, sd, min-max) | "
              "threshold's entries / global's (mean, min-max) |", "|---|---|---|---|---|"]
    for ratio in ratios:
        for length in lengths + ["all"]:
            part = [r for r in found if r["ratio"] == ratio and (length == "all" or r["length"] == length)]
            g = [r["global"] for r in part]
            t = [r["threshold"] for r in part]
            m = [r["multiple"] for r in part]
            sd = statistics.stdev(t) if len(t) > 1 else 0.0
            lines.append(f"| {ratio:g} | {length} | {statistics.mean(g):.3f} | {statistics.mean(t):.3f}, {sd:.3f}, "
                         f"{min(t):.3f}-{max(t):.3f} | {statistics.mean(m):.2f}x, {min(m):.2f}-{max(m):.2f}x |")
    by_task = {}
    for r in found:
        by_task.setdefault((r["ratio"], r["task"]), []).append(r["multiple"])
    lines += ["", "By task (threshold's entries / global's, mean):", "",
              "| ratio | " + " | ".join(tasks) + " |", "|---|" + "---|" * len(tasks)]
    for ratio in ratios:
        lines.append(f"| {ratio:g} | " + " | ".join(f"{statistics.mean(by_task[(ratio, t)]):.2f}x" for t in tasks)
                     + " |")
    print("\n".join(lines), flush=True)
    if args.peak_length:
        row = generate("niah_single", tokenizer, n_samples=1, context_length=args.peak_length, stride=args.stride,
                       phases=[0], seed=7)[0]
        ids = tokenizer(row["context"], return_tensors="pt").input_ids
        peak = ["", f"Prefill peak memory, {ids.shape[1]} tokens, ratio {args.peak_ratio:g} (VmHWM growth during the "
                "prefill; the cache's bytes after it)", "",
                "| press | peak growth (MiB) | cache after the prefill (MiB) |", "|---|---|---|"]
        from kvpress_phase.ragged import cache_nbytes

        prefill(model, ids[:, :256], None)  # warm-up: allocator and first-call costs outside the measure
        for kind in ("none", "layers", "global", "threshold"):
            press = make_press(kind, args.peak_ratio, args.stride)
            base = reset_peak()
            cache = prefill(model, ids, press)
            growth = proc_status("VmHWM") - base
            nbytes = cache_nbytes(cache)
            del cache
            name = {"none": "no press", "layers": "LayerBudgetPress", "global": "GlobalBudgetPress",
                    "threshold": "ThresholdBudgetPress"}[kind]
            peak.append(f"| {name} | {growth / 2**20:.0f} | {nbytes / 2**20:.1f} |")
            print(peak[-1], flush=True)
        lines += peak
    append_result(args.output, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
