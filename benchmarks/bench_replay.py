"""Replay runner versus one kvpress pipeline call per variant, on an 8-phase x 4-press grid.

Offset-shift protocol: one context of ``--context-length`` tokens per sample; every phase moves the presses' grid
offset. The replay runner prefills each context once and replays every (press, phase) compression; the baseline
calls ``pipeline("kv-press-text-generation")(context, question=..., press=...)`` once per variant. Both must give
the same answers (checked), and the end-to-end times are compared.

    python benchmarks/bench_replay.py --context-length 2048 --samples 2
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time

import torch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context-length", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=2, help="base samples (each run at 8 phases)")
    parser.add_argument("--presses", default="chunked_stride,phase_aware,knorm,chunk")
    parser.add_argument("--compression-ratio", type=float, default=0.5)
    parser.add_argument("--stride", type=int, default=8)
    parser.add_argument("--output", help="append the Markdown result to this file")
    args = parser.parse_args(argv)

    from transformers import pipeline

    from kvpress_phase import load_builtin_model
    from kvpress_phase.evaluation.presses import PHASE_GRID_PRESSES, build_press, parse_press_spec
    from kvpress_phase.evaluation.runner import ReplayEngine
    from kvpress_phase.evaluation.tasks import generate

    model, tokenizer = load_builtin_model()
    rows = generate("niah_single", tokenizer, n_samples=args.samples, context_length=args.context_length,
                    stride=args.stride, phases=list(range(args.stride)), protocol="offset", seed=7)
    specs = [parse_press_spec(p) for p in args.presses.split(",")]
    variants = [(row, spec) for row in rows for spec in specs]

    def offset_of(row, spec):
        return row["offset"] if spec.name in PHASE_GRID_PRESSES else 0

    # baseline: one pipeline call per variant
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    t0 = time.perf_counter()
    direct = []
    for row, spec in variants:
        press = build_press(spec, args.compression_ratio, args.stride, None, offset_of(row, spec))
        direct.append(pipe(row["context"], question=row["question"], answer_prefix=row["answer_prefix"],
                           press=press, max_new_tokens=row["max_new_tokens"])["answer"])
    t_pipeline = time.perf_counter() - t0

    # replay: one prefill per distinct context
    t0 = time.perf_counter()
    engine = ReplayEngine(model, tokenizer)
    prefills = {}
    replayed = []
    for row, spec in variants:
        encoded = engine.encode(row["context"], [row["question"]], row["answer_prefix"])
        if row["context"] not in prefills:
            prefills[row["context"]] = engine.prefill(encoded["context_ids"])
        press = build_press(spec, args.compression_ratio, args.stride, None, offset_of(row, spec))
        answers, _ = engine.answer(prefills[row["context"]], press, encoded["questions_ids"], row["max_new_tokens"])
        replayed.append(answers[0])
    t_replay = time.perf_counter() - t0

    same = sum(a == b for a, b in zip(direct, replayed))
    report = "\n".join([
        f"### Replay runner vs pipeline, {datetime.date.today().isoformat()}",
        "",
        f"Command: `python benchmarks/bench_replay.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
        f"Machine: {platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}; "
        "built-in model, float32, CPU",
        f"Grid: {args.samples} contexts of {args.context_length} tokens x {args.stride} phases (offset shift) x "
        f"{len(specs)} presses ({args.presses}) = {len(variants)} answers",
        "",
        "| path | seconds | answers |",
        "|---|---|---|",
        f"| one pipeline call per variant | {t_pipeline:.1f} | {len(direct)} |",
        f"| replay runner | {t_replay:.1f} | {len(replayed)} |",
        "",
        f"Speed-up {t_pipeline / t_replay:.1f}x; identical answers: {same}/{len(variants)}.",
        "",
    ])
    print(report)
    if args.output:
        with open(args.output, "a") as fh:
            fh.write(report + "\n")
    return 0 if same == len(variants) else 1


if __name__ == "__main__":
    raise SystemExit(main())
