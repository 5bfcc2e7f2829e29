"""The decoding step of a compressed cache: per-head budgets stored ragged, left masked, and a dense budget.

For every context length and compression ratio, one context (a ``niah_single`` haystack of the model's tokenizer) is
prefilled under each press as kvpress's pipeline runs it (the press as a context manager around the model's
forward), and then ``--steps`` single-token decoding steps are timed one by one (greedy, the median reported, after
``--warmup`` untimed steps). The variants:

- ``ragged``: ``GlobalBudgetPress(PhaseAwarePress(r, scorer=...))`` as a user gets it: the padded layers stored as
  :class:`~kvpress_phase.ragged.RaggedLayer` and decoded with the ragged attention (:mod:`kvpress_phase.ragged`);
- ``masked``: the same press and prefill without the ragged store: each layer at its longest KV head, the shorter
  heads' padding masked by kvpress's attention patch (what kvpress's per-head presses do);
- ``dense``: ``LayerBudgetPress`` over the same inner press: every layer dense at its own length, nothing masked;
- ``none``: the uncompressed cache (for scale).

The cache's bytes after the prefill are those of every tensor it holds (:func:`~kvpress_phase.ragged.cache_nbytes`:
a ragged layer's buffers and index, a dense layer's keys and values, masked entries included).

    python benchmarks/bench_decode_step.py --model smollm2 --context-lengths 1024,4096,8192 --ratios 0.5,0.75 \\
        --output docs/results/decode-step.md
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import torch

from common import append_result, bad_input, parse_list, parse_names, run_line, set_threads

VARIANTS = ("none", "dense", "masked", "ragged")


def press_for(variant: str, ratio: float, stride: int, scorer: str):
    from kvpress_phase import GlobalBudgetPress, LayerBudgetPress, PhaseAwarePress

    if variant == "none":
        return None
    inner = PhaseAwarePress(ratio, stride=stride, scorer=scorer)
    return LayerBudgetPress(inner) if variant == "dense" else GlobalBudgetPress(inner)


def compressing(press, model, variant: str):
    """The context manager the prefill runs in: the press's own (``ragged``, ``dense``), or its compression without
    the ragged store (``masked``)."""
    if press is None:
        return contextlib.nullcontext()
    if variant != "masked":
        return press(model)
    from kvpress_phase.presses.storage import stored_masked

    return stored_masked(press, model)


def decode_steps(model, ids: torch.Tensor, press, variant: str, steps: int, warmup: int) -> tuple[list, int]:
    """Prefill ``ids`` under ``press``, then time ``warmup + steps`` greedy single-token steps; returns the timed
    steps' seconds and the cache's bytes after the prefill."""
    from transformers import DynamicCache

    from kvpress_phase.ragged import cache_nbytes

    model.set_attn_implementation("sdpa")
    cache = DynamicCache()
    n = ids.shape[1]
    try:
        with torch.no_grad():
            with compressing(press, model, variant):
                out = model(ids, past_key_values=cache, logits_to_keep=1)
            nbytes = cache_nbytes(cache)
            token = out.logits[:, -1:].argmax(-1)
            times = []
            for i in range(warmup + steps):
                start = time.perf_counter()
                out = model(token, past_key_values=cache, position_ids=torch.tensor([[n + i]]))
                token = out.logits[:, -1:].argmax(-1)
                times.append(time.perf_counter() - start)
    finally:
        for layer in model.model.layers:
            layer.self_attn.masked_key_indices = None
        model.set_attn_implementation("sdpa")
    return times[warmup:], nbytes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="model name (default: smollm2)")
    parser.add_argument("--context-lengths", default="1024,4096,8192")
    parser.add_argument("--ratios", default="0.5,0.75")
    parser.add_argument("--stride", type=int, default=8)
    parser.add_argument("--scorer", default="kvzap", help="the inner PhaseAwarePress's scorer (default: kvzap)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"any of {', '.join(VARIANTS)}")
    parser.add_argument("--steps", type=int, default=16, help="timed decoding steps (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--output", help="append the Markdown result to this file")
    args = parser.parse_args(argv)
    try:
        lengths = parse_list(args.context_lengths, int, "context-lengths")
        ratios = parse_list(args.ratios, float, "ratios")
        variants = parse_names(args.variants)
        unknown = sorted(set(variants) - set(VARIANTS))
        if unknown:
            raise ValueError(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
        if args.steps < 1 or args.warmup < 0:
            raise ValueError("--steps must be >= 1 and --warmup >= 0")
        if any(not 0 < r < 1 for r in ratios):
            raise ValueError(f"--ratios must be in (0, 1), got {args.ratios}")
    except ValueError as exc:
        return bad_input(exc)
    set_threads(args.threads)

    from kvpress_phase import load_builtin_model
    from kvpress_phase.evaluation.tasks import generate

    model, tokenizer = load_builtin_model(name=args.model)
    lines = [f"{run_line('bench_decode_step.py', argv)}, {args.model}, stride {args.stride}, scorer {args.scorer}; "
             f"median of {args.steps} steps after {args.warmup}", "",
             "| tokens | ratio | variant | step (ms) | vs dense | vs masked | cache MiB |",
             "|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    warm = tokenizer("A warm-up line of text.", return_tensors="pt").input_ids
    decode_steps(model, warm, None, "none", 2, 0)  # the first forwards of a process are slow: none of them is timed
    for length in lengths:
        row = generate("niah_single", tokenizer, n_samples=1, context_length=length, stride=args.stride, phases=[0],
                       protocol="offset", seed=7)[0]
        ids = tokenizer(row["context"], return_tensors="pt").input_ids
        for ratio in ratios:
            found = {}
            for variant in variants:
                if variant == "none" and ratio != ratios[0]:
                    continue
                press = press_for(variant, ratio, args.stride, args.scorer)
                times, nbytes = decode_steps(model, ids, press, variant, args.steps, args.warmup)
                found[variant] = statistics.median(times)
                vs = {ref: (f"{found[variant] / found[ref]:.2f}x" if ref in found and variant not in (ref, "none")
                            else "") for ref in ("dense", "masked")}
                line = (f"| {ids.shape[1]} | {ratio:g} | {variant} | {found[variant] * 1000:.1f} | {vs['dense']} | "
                        f"{vs['masked']} | {nbytes / 2**20:.2f} |")
                lines.append(line)
                print(line, flush=True)
    append_result(args.output, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
