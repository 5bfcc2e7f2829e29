"""Throughput of the phase evaluation, and the share of it the needle-attention diagnostic takes.

Runs the default job's configuration (``kvpress-phase eval`` with no arguments: the built-in model, both tasks,
every registered press, ratio 0.25, stride 8, 6 samples; ``--context-lengths`` changes the context length) through
``run_evaluation`` into fresh temporary directories, alternating runs with and without the diagnostic, and reports
for each: seconds, answers per second, and, for the runs with the diagnostic, the time spent inside the diagnostic's
own code (measured by timers around its functions). ``--cli`` also times the whole command in a subprocess
(imports, model load, reports included). ``--profile FILE`` writes a cProfile of one run with the diagnostic.

The timers wrap whichever diagnostic functions the code being measured has, so the same script measures an older
checkout too (``PYTHONPATH=<checkout> python benchmarks/bench_eval.py``).

    python benchmarks/bench_eval.py --repeats 2 --cli
    python benchmarks/bench_eval.py --context-lengths 2048 --repeats 1
    python benchmarks/bench_eval.py --model smollm2 --context-lengths 1024 --samples 2 --repeats 1   # real model

``--compare-decoding`` instead runs one job twice, decoding step by step (one token per forward over a growing
``DynamicCache``, ``--step-by-step``) and with the default fast path (draft checking in preallocated buffers), in
both settings (query-agnostic and question compressed), and reports the time of each, where it went (prefill,
KVzip's scoring, compression, masks, decoding, the rest), the measured floor of one batched decoding step, and a last
line ``fast decoding: X.Xx the step-by-step path, N/N answers identical``. ``--grid test-split`` takes the real
model's pre-registered test split's grid (strides 6/10/12, ratios 0.125/0.25/0.5, its presses, offset protocol,
matched cache, seed 11) instead of the default job's:

    python benchmarks/bench_eval.py --model smollm2 --grid test-split --compare-decoding --samples 1 \
        --context-lengths 1024
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch


class _Timers:
    """Accumulated wall time spent inside wrapped functions (outermost calls only)."""

    def __init__(self):
        self.total = 0.0
        self.depth = 0

    def wrap(self, owner, name):
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            self.depth += 1
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.depth -= 1
                if self.depth == 0:
                    self.total += time.perf_counter() - t0

        setattr(owner, name, timed)
        return lambda: setattr(owner, name, original)


def _instrument(timers: _Timers):
    """Wrap the diagnostic's functions where the runner looks them up; returns the undo callables."""
    from kvpress_phase.evaluation import diagnostics, runner

    undo = []
    if hasattr(diagnostics, "AttentionProbe"):  # the diagnostic taken from the answer's first decoding step
        undo.append(timers.wrap(diagnostics.AttentionProbe, "_hook"))
        undo.append(timers.wrap(diagnostics, "needle_mass"))
        undo.append(timers.wrap(runner.ReplayEngine, "attention_rows"))
    else:  # an older runner: a separate eager forward per variant
        undo.append(timers.wrap(runner, "needle_attention"))
    return undo


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context-lengths", default="512", help="comma-separated (default: 512, the default job's)")
    parser.add_argument("--model", default=None, help="model name or path (default: the built-in model)")
    parser.add_argument("--samples", type=int, default=None, help="samples per phase (default: the default job's)")
    parser.add_argument("--protocol", choices=["prefix", "offset"], default=None,
                        help="placement protocol (default: the default job's, prefix)")
    parser.add_argument("--repeats", type=int, default=2, help="runs with and without the diagnostic, alternated")
    parser.add_argument("--cli", action="store_true", help="also time `kvpress-phase eval` end to end")
    parser.add_argument("--profile", help="write a cProfile of one run with the diagnostic to this file")
    parser.add_argument("--output", help="append the Markdown result to this file")
    parser.add_argument("--grid", choices=["default", "test-split"], default="default",
                        help="the default job's grid, or the real model's pre-registered test split's")
    parser.add_argument("--tasks", help="comma-separated tasks (default: the grid's)")
    parser.add_argument("--compare-decoding", action="store_true",
                        help="time step-by-step against fast decoding on the same job and compare every answer")
    args = parser.parse_args(argv)
    if args.compare_decoding:
        return compare_decoding(args, argv)

    from kvpress_phase.evaluation.cli import QUICK, load_model
    from kvpress_phase.evaluation.runner import run_evaluation

    lengths = [int(x) for x in args.context_lengths.split(",")]
    model, tokenizer = load_model(args.model, "cpu", "float32")
    job = dataclasses.replace(QUICK, model=args.model, samples=args.samples or QUICK.samples,
                              protocol=args.protocol or QUICK.protocol)
    results = {True: [], False: []}
    inside = []
    n_answers = None
    for _ in range(args.repeats):
        for diagnostics in (True, False):
            config = dataclasses.replace(job, context_lengths=lengths, diagnostics=diagnostics)
            timers = _Timers()
            undo = _instrument(timers) if diagnostics else []
            with tempfile.TemporaryDirectory() as out:
                t0 = time.perf_counter()
                df = run_evaluation(config, model, tokenizer, out, progress=False)
                elapsed = time.perf_counter() - t0
            for u in undo:
                u()
            n_answers = len(df)
            results[diagnostics].append(elapsed)
            if diagnostics:
                inside.append(timers.total)
    if args.profile:
        import cProfile

        config = dataclasses.replace(job, context_lengths=lengths, diagnostics=True)
        with tempfile.TemporaryDirectory() as out:
            cProfile.runctx("run_evaluation(config, model, tokenizer, out, progress=False)", globals(),
                            {"run_evaluation": run_evaluation, "config": config, "model": model,
                             "tokenizer": tokenizer, "out": out}, args.profile)

    cli_times = []
    if args.cli:
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as out:
                cmd = [sys.executable, "-m", "kvpress_phase.cli", "eval", "--output-dir", out,
                       "--no-progress", "--context-lengths", args.context_lengths, "--samples", str(job.samples),
                       "--protocol", job.protocol] + (["--model", args.model] if args.model else [])
                t0 = time.perf_counter()
                subprocess.run(cmd, check=True, capture_output=True)
                cli_times.append(time.perf_counter() - t0)

    on, off = statistics.median(results[True]), statistics.median(results[False])
    share = statistics.median(t / r for t, r in zip(inside, results[True]))
    code = os.environ.get("PYTHONPATH", "").split(os.pathsep)[0] or "installed package"
    lines = [
        f"### Evaluation throughput, {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        "",
        f"Command: `python benchmarks/bench_eval.py {' '.join(argv if argv is not None else sys.argv[1:])}` "
        f"(code: {code})",
        f"Machine: {platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}; "
        f"model {args.model or 'builtin'}, float32, CPU",
        f"Job: the default configuration (every registered press, ratio 0.25, stride 8, {job.protocol} protocol, "
        f"{job.samples} samples per phase) at context length(s) {args.context_lengths}: {n_answers} answers; "
        f"median of {args.repeats} run(s) each",
        "",
        "| run | seconds | answers/s |",
        "|---|---|---|",
        f"| run_evaluation, diagnostic on (default) | {on:.1f} | {n_answers / on:.1f} |",
        f"| run_evaluation, diagnostic off | {off:.1f} | {n_answers / off:.1f} |",
    ]
    if cli_times:
        t = statistics.median(cli_times)
        lines.append(f"| `kvpress-phase eval` end to end (imports, model load, reports) | {t:.1f} | "
                     f"{n_answers / t:.1f} |")
    lines += [
        "",
        f"Diagnostic share: {share:.1%} of run_evaluation measured inside its functions; "
        f"{(on - off) / on:.1%} from the on/off difference.",
        "",
    ]
    return _emit(lines, args.output)


def _emit(lines: list, output) -> int:
    """Print the Markdown report and append it to ``output`` when given."""
    report = "\n".join(lines)
    print(report)
    if output:
        with open(output, "a") as fh:
            fh.write(report + "\n")
    return 0


TEST_SPLIT = dict(  # docs/preregistration-real-model.md, "Test split" (the 1,024-token cells' press list)
    tasks=["niah_single", "niah_multikey"], strides=[6, 10, 12], compression_ratios=[0.125, 0.25, 0.5],
    presses=["no_press", "chunked_stride", "phase_aware", "snapkv", "knorm", "streaming_llm", "chunkkv", "chunk",
             "expected_attention", "tova", "keydiff", "pyramidkv", "kvzip", "chunked_stride:mode=pool"],
    protocol="offset", seed=11, matched_cache=True, diagnostics=False,
)


def _job(args):
    from kvpress_phase.evaluation.cli import QUICK

    job = dataclasses.replace(QUICK, model=args.model, **(TEST_SPLIT if args.grid == "test-split" else {}))
    if args.samples:
        job = dataclasses.replace(job, samples=args.samples)
    if args.protocol:
        job = dataclasses.replace(job, protocol=args.protocol)
    if args.tasks:
        job = dataclasses.replace(job, tasks=args.tasks.split(","))
    return job


_PARTS = {  # where a run's time goes: (owner, attribute) timed, outermost calls only
    "prefill": ("ReplayEngine", "prefill"),
    "KVzip scoring": ("ReplayEngine", "_kvzip_scores"),
    "compression": ("ReplayEngine", "_compress_layers"),
    "masks (KVzip)": ("kvzip_adapter", "kvzip_masks"),
    "decoding": ("decoding", "decode_tokens"),
}


def _timed_run(config, model, tokenizer):
    """(seconds, results, seconds per part) of one run_evaluation of ``config`` into a fresh directory."""
    from kvpress_phase.evaluation import decoding, runner
    from kvpress_phase.presses import kvzip_adapter

    owners = {"ReplayEngine": runner.ReplayEngine, "decoding": decoding, "kvzip_adapter": kvzip_adapter}
    timers = {name: _Timers() for name in _PARTS}
    undo = [timers[name].wrap(owners[owner], attr) for name, (owner, attr) in _PARTS.items()]
    # the runner imports decode_tokens inside answer_many, from the module: the wrapper is what it finds
    try:
        with tempfile.TemporaryDirectory() as out:
            t0 = time.perf_counter()
            df = runner.run_evaluation(config, model, tokenizer, out, progress=False)
            elapsed = time.perf_counter() - t0
    finally:
        for u in undo:
            u()
    return elapsed, df, {name: t.total for name, t in timers.items()}


@torch.inference_mode()
def decode_floor(model, context_length: int, batch: int = 16, steps: int = 8) -> dict:
    """Median seconds of one decoding step of ``batch`` caches of ``context_length`` entries: over a DynamicCache
    that grows by concatenation (as step by step) and over preallocated buffers (the floor: the model's own
    arithmetic and attention, no copy of the caches)."""
    from transformers import DynamicCache

    from kvpress_phase.evaluation.decoding import FilledLayer

    cfg = model.config
    heads, dim = cfg.num_key_value_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    out = {}
    for kind in ("concatenating", "preallocated"):
        cache = DynamicCache()
        if kind == "preallocated":
            cache.layers = [FilledLayer(torch.randn(batch, heads, context_length + steps + 4, dim),
                                        torch.randn(batch, heads, context_length + steps + 4, dim), context_length)
                            for _ in range(cfg.num_hidden_layers)]
        else:
            for i in range(cfg.num_hidden_layers):
                cache.update(torch.randn(batch, heads, context_length, dim), torch.randn(batch, heads, context_length, dim), i)
        ids = torch.zeros(batch, 1, dtype=torch.long)
        times = []
        for step in range(steps):
            t0 = time.perf_counter()
            model(input_ids=ids, past_key_values=cache, position_ids=torch.tensor([[context_length + step]]))
            times.append(time.perf_counter() - t0)
        out[kind] = statistics.median(times[1:])
    return out


def compare_decoding(args, argv) -> int:
    from kvpress_phase.evaluation.cli import load_model

    model, tokenizer = load_model(args.model, "cpu", "float32")
    job = _job(args)
    lengths = [int(x) for x in args.context_lengths.split(",")]
    lines = [
        f"### Fast decoding against step by step, {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        "",
        f"Command: `python benchmarks/bench_eval.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}; model {args.model or 'builtin'}, float32, CPU",
        f"Job: {args.grid} grid, tasks {','.join(job.tasks)}, strides {job.strides}, ratios {job.compression_ratios}, "
        f"{len(job.presses)} presses, {job.protocol} protocol, {job.samples} sample(s) per phase, both settings",
        "",
        "| length | setting | path | answers | seconds | answers/s | prefill | KVzip scoring | compression | masks "
        "| decoding | rest |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    total = {True: 0.0, False: 0.0}
    same = n = 0
    for length in lengths:
        for question in (False, True):
            runs = {}
            for step in (True, False):
                config = dataclasses.replace(job, context_lengths=[length], compress_question=question,
                                             step_by_step=step)
                elapsed, df, parts = _timed_run(config, model, tokenizer)
                runs[step] = df
                total[step] += elapsed
                rest = elapsed - sum(parts.values())
                cells = " | ".join(f"{parts[p]:.1f}" for p in _PARTS)
                lines.append(f"| {length} | {'question compressed' if question else 'query-agnostic'} | "
                             f"{'step by step' if step else 'fast'} | {len(df)} | {elapsed:.1f} | "
                             f"{len(df) / elapsed:.2f} | {cells} | {rest:.1f} |")
                print(lines[-1], flush=True)
            a = runs[True].set_index("key")["prediction"]
            b = runs[False].set_index("key")["prediction"].reindex(a.index)
            same += int((a == b).sum())
            n += len(a)
    floors = {length: decode_floor(model, length) for length in lengths}
    lines.append("")
    for length, f in floors.items():
        lines.append(f"One decoding step of 16 caches of {length} entries: {f['concatenating'] * 1000:.0f} ms over a "
                     f"concatenating DynamicCache, {f['preallocated'] * 1000:.0f} ms over preallocated buffers "
                     f"(the floor).")
    lines += ["", f"fast decoding: {total[True] / total[False]:.1f}x the step-by-step path, {same}/{n} answers "
                  "identical", ""]
    return _emit(lines, args.output)


if __name__ == "__main__":
    raise SystemExit(main())
