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
    args = parser.parse_args(argv)

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
                cmd = [sys.executable, "-m", "kvpress_phase.evaluation.cli", "eval", "--output-dir", out,
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
    report = "\n".join(lines)
    print(report)
    if args.output:
        with open(args.output, "a") as fh:
            fh.write(report + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
