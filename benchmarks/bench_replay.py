"""The replay runner versus one kvpress pipeline call per variant, on an 8-phase x 4-press grid.

Offset-shift protocol: one context of ``--context-length`` tokens per sample; every phase moves the presses' grid
offset. The baseline calls ``pipeline("kv-press-text-generation")(context, question=..., press=...)`` once per
(sample, phase, press). The runner is ``run_evaluation`` itself, as ``kvpress-phase eval`` runs it (diagnostic
included, results written to a temporary directory): it prefills each context once, replays every compression
on the recorded inputs and reuses a compression that does not depend on the phase (the kvpress presses have no grid
offset). For transparency the script also times the replay engine on every variant without that reuse. All paths
must give the same answers (checked); each is timed ``--repeats`` times, alternating, and the medians are compared.

    python benchmarks/bench_replay.py --context-length 2048 --samples 2
    python benchmarks/bench_replay.py --model smollm2 --context-length 1024 --samples 1 --repeats 1 \
        --presses chunked_stride,phase_aware,knorm,snapkv,streaming_llm,tova,kvzip

The runner decodes a context's compressed caches in batches (``--decode-batch``, default 16, as ``kvpress-phase
eval``); with batch 1 it decodes each alone, exactly as the pipeline does, and a batch can change an answer at a
near-tie through float rounding: the table counts identical answers for both.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import tempfile
import time

import torch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context-length", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=2, help="base samples (each run at every phase)")
    parser.add_argument("--presses", default="chunked_stride,phase_aware,knorm,chunk")
    parser.add_argument("--compression-ratio", type=float, default=0.5)
    parser.add_argument("--stride", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of each path (median reported)")
    parser.add_argument("--model", default="builtin", help="model name (default: builtin)")
    parser.add_argument("--decode-batch", type=int, default=16, help="the runner's decode batch (default: 16)")
    parser.add_argument("--output", help="append the Markdown result to this file")
    args = parser.parse_args(argv)

    from transformers import pipeline

    from kvpress_phase import load_builtin_model
    from kvpress_phase.evaluation.presses import build_press, parse_press_spec
    from kvpress_phase.evaluation.config import EvalConfig
    from kvpress_phase.evaluation.replay import ReplayEngine
    from kvpress_phase.evaluation.runner import run_evaluation
    from kvpress_phase.evaluation.tasks import generate

    model, tokenizer = load_builtin_model(name=args.model)
    config = EvalConfig(tasks=["niah_single"], presses=args.presses.split(","),
                        compression_ratios=[args.compression_ratio], strides=[args.stride], protocol="offset",
                        context_lengths=[args.context_length], samples=args.samples, seed=7,
                        decode_batch=args.decode_batch)
    # the rows the runner plans for this configuration (see runner.plan_units)
    rows = generate("niah_single", tokenizer, n_samples=args.samples, context_length=args.context_length,
                    stride=args.stride, phases=list(range(args.stride)), protocol="offset", seed=7)
    specs = [parse_press_spec(p) for p in config.presses]
    variants = [(row, spec) for row in rows for spec in specs]

    def press_for(row, spec):
        offset = row["offset"] if spec.entry.grid_offset else 0
        return build_press(spec, args.compression_ratio, args.stride, None, offset)

    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")

    def run_pipeline():
        return [pipe(row["context"], question=row["question"], answer_prefix=row["answer_prefix"],
                     press=press_for(row, spec), max_new_tokens=row["max_new_tokens"])["answer"]
                for row, spec in variants]

    def run_runner(diagnostics=True, batch=None):
        cfg = EvalConfig(**{**config.__dict__, "diagnostics": diagnostics, "decode_batch": batch or args.decode_batch})
        with tempfile.TemporaryDirectory() as out:
            df = run_evaluation(cfg, model, tokenizer, out, progress=False)
        got = {(r.sample_id, r.phase, r.press): r.prediction for r in df.itertuples()}
        return [got[(row["sample_id"], row["phase"], spec.label)] for row, spec in variants]

    @torch.inference_mode()
    def run_engine():  # every variant replayed, one prefill per context, decoded by the pipeline's generate_answer
        engine = ReplayEngine(model, tokenizer)
        states, answers = {}, []
        for row, spec in variants:
            encoded = engine.encode(row["context"], [row["question"]], row["answer_prefix"])
            if row["context"] not in states:
                states.clear()
                states[row["context"]] = engine.prefill(encoded["context_ids"])
            state = states[row["context"]]
            cache = engine.compressed_cache(state, press_for(row, spec))
            answers.append(engine.pipe.generate_answer(question_ids=encoded["questions_ids"][0].to(model.device),
                                                       cache=cache, context_length=state.context_length,
                                                       max_new_tokens=row["max_new_tokens"]))
        return answers

    paths = {"one pipeline call per variant": run_pipeline,
             f"replay runner (`run_evaluation`, as `kvpress-phase eval` runs it, decode batch {args.decode_batch})":
                 run_runner,
             "replay runner, diagnostic off": lambda: run_runner(False),
             "replay runner, decode batch 1 (exact)": lambda: run_runner(True, 1),
             "replay engine, every variant replayed (no reuse)": run_engine}
    times = {name: [] for name in paths}
    answers = {}
    for _ in range(args.repeats):
        for name, fn in paths.items():
            t0 = time.perf_counter()
            answers[name] = fn()
            times[name].append(time.perf_counter() - t0)

    base_name = next(iter(paths))
    base = statistics.median(times[base_name])
    same_all = True  # on the paths that decode one cache at a time
    table = []
    for name in paths:
        t = statistics.median(times[name])
        same = sum(a == b for a, b in zip(answers[base_name], answers[name]))
        if "batch 1" in name or "no reuse" in name:
            same_all &= same == len(variants)
        speed = "1.0x" if name == base_name else f"{base / t:.1f}x"
        table.append(f"| {name} | {t:.2f} | {speed} | {same}/{len(variants)} |")
    runner_speedup = base / statistics.median(times[list(paths)[1]])
    report = "\n".join([
        f"### Replay runner vs pipeline, {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        "",
        f"Command: `python benchmarks/bench_replay.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
        f"Machine: {platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}; "
        f"model {args.model}, float32, CPU",
        f"Grid: {args.samples} contexts of {args.context_length} tokens x {args.stride} phases (offset shift) x "
        f"{len(specs)} presses ({args.presses}) = {len(variants)} answers; median of {args.repeats} run(s) per path",
        "",
        "| path | seconds | speed-up | answers identical to the pipeline's |",
        "|---|---|---|---|",
        *table,
        "",
        f"Runner speed-up {runner_speedup:.1f}x; identical answers on the paths that decode one cache at a time: "
        f"{'yes' if same_all else 'NO'}.",
        "",
    ])
    print(report)
    if args.output:
        with open(args.output, "a") as fh:
            fh.write(report + "\n")
    return 0 if same_all else 1


if __name__ == "__main__":
    raise SystemExit(main())
