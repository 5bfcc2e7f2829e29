"""Where the decoding time of one evaluation goes: every model forward, by batch size and kind.

Runs one job (by default one ``niah_single`` sample of the real model's pre-registered test-split grid at 1,024
tokens, query-agnostic) through ``run_evaluation`` with the model's ``forward`` wrapped, and prints the total time,
the time inside model forwards, and per (batch rows, kind) the number of forwards and their seconds, where kind is
``question`` (a forward of the question, with a draft when one is checked) or ``step`` (one token per row). With
``--profile`` it also prints the functions that took the most time (cProfile, internal time).

    python benchmarks/profile_decoding.py --model smollm2
    python benchmarks/profile_decoding.py --model smollm2 --step-by-step --context-length 1536 --query-aware
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import dataclasses
import os
import pstats
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--task", default="niah_single")
    parser.add_argument("--context-length", type=int, default=1024)
    parser.add_argument("--query-aware", action="store_true", help="compress the question with the context")
    parser.add_argument("--step-by-step", action="store_true", help="the reference decoding path")
    parser.add_argument("--profile", action="store_true", help="also print the top functions by internal time")
    args = parser.parse_args(argv)

    from bench_eval import TEST_SPLIT

    from kvpress_phase.evaluation import runner
    from kvpress_phase.evaluation.cli import QUICK, load_model

    model, tokenizer = load_model(args.model, "cpu", "float32")
    job = dataclasses.replace(QUICK, model=args.model, **TEST_SPLIT)
    job = dataclasses.replace(job, samples=1, tasks=[args.task], context_lengths=[args.context_length],
                              compress_question=args.query_aware, step_by_step=args.step_by_step)
    counts, seconds = collections.Counter(), collections.Counter()
    forward = model.forward

    def timed(*a, **kw):
        ids = kw["input_ids"]
        t0 = time.perf_counter()
        out = forward(*a, **kw)
        key = (ids.shape[0], "step" if ids.shape[1] == 1 else "question")
        counts[key] += 1
        seconds[key] += time.perf_counter() - t0
        return out

    model.forward = timed
    profiler = cProfile.Profile() if args.profile else None
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        if profiler:
            profiler.enable()
        df = runner.run_evaluation(job, model, tokenizer, out, progress=False)
        if profiler:
            profiler.disable()
        total = time.perf_counter() - t0
    print(f"{len(df)} answers in {total:.1f} s; model forwards {sum(seconds.values()):.1f} s "
          f"({'step by step' if args.step_by_step else 'fast'} decoding, {args.task}, {args.context_length} tokens, "
          f"{'query-aware' if args.query_aware else 'query-agnostic'})")
    print("rows  kind      forwards  seconds")
    for key in sorted(seconds, key=lambda k: -seconds[k]):
        print(f"{key[0]:>4}  {key[1]:<8}  {counts[key]:>8}  {seconds[key]:7.2f}")
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
