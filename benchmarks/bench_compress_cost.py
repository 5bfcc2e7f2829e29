"""A press's whole compress step in prefills of the model, and the bytes of the cache it leaves.

The cost rule of docs/preregistration-budgets.md: every layer of one context compressed (scores included, and for
a budget across layers the plan over every layer's scores; for KVzip its reconstruction passes and masks), timed
against the prefill of the same context on the same model, each the median of ``--repeats`` runs. The cache's
bytes are the stored keys and values of every layer (masked entries are stored and count); the attended entries
exclude them. "ragged MiB" is what the same cache holds stored ragged (:mod:`kvpress_phase.ragged`: every layer with
masked entries as a RaggedLayer of its unmasked entries, index included), what ``HeadBudgetPress`` and
``GlobalBudgetPress`` store through kvpress's pipeline; for kvpress's masking presses it is what they would store.
Nothing is shared between timed runs (every run scores from scratch).

    python benchmarks/bench_compress_cost.py --model smollm2 --context-length 1024 --compression-ratio 0.75 \
        --presses chunked_stride,phase_aware,phase_aware:allocate=layers,kvzip,keydiff
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time

import torch

from common import append_result, bad_input


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin", help="model name (default: builtin)")
    parser.add_argument("--context-length", type=int, default=1024)
    parser.add_argument("--compression-ratio", type=float, default=0.5)
    parser.add_argument("--stride", type=int, default=8)
    parser.add_argument("--presses", default="chunked_stride,phase_aware,keydiff,kvzip")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each (median reported)")
    parser.add_argument("--output", help="append the Markdown result to this file")
    args = parser.parse_args(argv)

    from kvpress_phase import load_builtin_model
    from kvpress_phase.evaluation.presses import build_press, parse_press_spec
    from kvpress_phase.evaluation.replay import ReplayEngine
    from kvpress_phase.evaluation.tasks import generate

    try:
        specs = [parse_press_spec(text) for text in args.presses.split(",")]
    except ValueError as exc:
        return bad_input(exc)
    model, tokenizer = load_builtin_model(name=args.model)
    row = generate("niah_single", tokenizer, n_samples=1, context_length=args.context_length, stride=args.stride,
                   phases=[0], protocol="offset", seed=7)[0]
    engine = ReplayEngine(model, tokenizer)
    ids = engine.encode(row["context"], [row["question"]], row["answer_prefix"])["context_ids"]

    def timed(fn):
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times), out

    prefill_s, state = timed(lambda: engine.prefill(ids))
    n = ids.shape[1]
    lines = [f"`{' '.join(sys.argv)}`, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
             f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}, {args.model}, "
             f"{n} tokens: prefill {prefill_s * 1000:.0f} ms (median of {args.repeats})", "",
             "| press | compress step (ms) | in prefills | cache MiB | ragged MiB "
             "| attended entries per layer and head |",
             "|---|---|---|---|---|---|"]
    for spec in specs:
        def run():
            state.memo.clear()  # no scores reused between runs
            press = build_press(spec, args.compression_ratio, args.stride, None, 0, matched_context_length=n)
            cache = engine.compressed_cache(state, press)
            return cache, engine.masks(state, press)

        seconds, (cache, masks) = timed(run)
        stored = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        slots = sum(layer.keys.shape[0] * layer.keys.shape[1] for layer in cache.layers)
        entries = sum(layer.keys.shape[0] * layer.keys.shape[1] * layer.keys.shape[2] for layer in cache.layers)
        entries -= sum(int(h.numel()) for h, _ in (masks or {}).values())
        ragged = ragged_bytes(cache, masks)
        lines.append(f"| `{spec.label}` | {seconds * 1000:.1f} | {seconds / prefill_s:.3f} | {stored / 2**20:.2f} | "
                     f"{ragged / 2**20:.2f} | {entries / slots:.1f} |")
    print("\n".join(lines))
    append_result(args.output, lines)
    return 0


def ragged_bytes(cache, masks) -> int:
    """Bytes of ``cache`` (batch 1) with every layer that ``masks`` names (``{layer: (heads, positions)}``) stored as
    a RaggedLayer of its unmasked entries, its index included; the other layers as they are."""
    from kvpress_phase.ragged import RaggedLayer

    total = 0
    for idx, layer in enumerate(cache.layers):
        if idx not in (masks or {}):
            total += layer.keys.nbytes + layer.values.nbytes
            continue
        heads, positions = masks[idx]
        masked = torch.zeros(layer.keys.shape[1:3], dtype=torch.bool, device=layer.keys.device)
        masked[heads.to(masked.device), positions.to(masked.device)] = True
        total += RaggedLayer.from_dense(layer.keys, layer.values, masked=masked).nbytes
    return total


if __name__ == "__main__":
    sys.exit(main())
