"""R11, the phase effect at 4k-16k tokens on Qwen2.5-Coder-0.5B (docs/preregistration-long-context.md): its runs,
resumable on any machine, committed to git as they go, with a line that says how far they are.

    python -m studies.long_context run                 # every pre-registered length in turn, resuming each
    python -m studies.long_context run --lengths 4096  # one length
    python -m studies.long_context status              # answers held and left, and the time left, per length
    python -m studies.long_context command 8192        # the eval command of one length (to run it by hand)

``run`` starts ``kvpress-phase eval`` for each length into ``outputs/long-context/n<LENGTH>`` (it resumes a run
where its answers stop: an answer is written once, under its key), commits that folder every ``--commit-every``
seconds (default 1800) and when the length ends, then packs the finished run and commits it. Stopped (Ctrl-C, a
session's end), it stops the evaluation, commits what the folder holds and exits; the next ``run``, on this machine
or a fresh clone, resumes. Each commit appends a line to the folder's ``progress.jsonl`` (time, answers held), from
which ``status`` reads the rate of the latest stretch of work. The run refuses to start unless the
pre-registration is committed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from typing import Optional

PREREGISTRATION = "docs/preregistration-long-context.md"
OUTPUT = "outputs/long-context"
LENGTHS = (4096, 8192, 16384)
"""The lengths R11 may run, in this order; which of them it reports is the pre-registration's rule."""
PRESSES = ("no_press", "chunked_stride", "chunked_stride:mode=pool", "phase_aware", "global_budget:scorer=kvzap",
           "kvzip_plus", "keydiff", "snapkv", "adakv")
"""The pre-registered presses: ours, the recommended press, and the strongest baselines of the last split."""
EVAL_FLAGS = ("--model", "qwen2.5-coder-0.5b", "--tasks", "niah_single,niah_multikey", "--strides", "4,8",
              "--windows", "8", "--compression-ratios", "0.5,0.75", "--protocol", "offset", "--matched-cache",
              "--samples", "8", "--seed", "91", "--no-diagnostics", "--threads", "2", "--dtype", "float32")
SECONDS_PER_TEXT = {4096: 294.0, 8192: 659.0, 16384: 1775.0}
"""The sizing's estimate of one text's cost (a prefill, KVzip+'s scoring and every press's replay and decoding), on
the 2-core machine: measured at 4,096 tokens (docs/results/long-context/sizing.md), scaled by the prefill's growth
above it. ``status`` uses it only where a length has no timed stretch of its own yet."""
TEXTS = 16
"""Texts per length: 8 samples per phase of 2 tasks under the offset protocol (a text is placed at every phase)."""


def run_dir(length: int) -> str:
    return os.path.join(OUTPUT, f"n{length}")


def eval_command(length: int) -> list[str]:
    return ["kvpress-phase", "eval", *EVAL_FLAGS, "--presses", ",".join(PRESSES), "--context-lengths", str(length),
            "--output-dir", run_dir(length)]


# ------------------------------------------------------------------------------------------------ progress
@dataclasses.dataclass
class Progress:
    length: int
    held: int
    planned: int
    packed: bool
    rate: Optional[float]  # answers per second over the latest timed stretch, None when none
    estimated: bool  # the time left is the sizing's estimate, not this run's own rate

    @property
    def left(self) -> int:
        return self.planned - self.held

    @property
    def seconds_left(self) -> float:
        if self.left <= 0:
            return 0.0
        if self.rate:
            return self.left / self.rate
        return SECONDS_PER_TEXT[self.length] * TEXTS * self.left / self.planned

    def line(self) -> str:
        state = "finished, packed" if self.packed else ("finished" if self.left <= 0 else "")
        eta = "" if self.left <= 0 else (f"about {_hours(self.seconds_left)} left"
                                         + (" (the sizing's estimate)" if self.estimated else " (at its last rate)"))
        return (f"n{self.length}: {self.held:,} of {self.planned:,} answers held, {self.left:,} left"
                + (f"; {eta}" if eta else "") + (f"; {state}" if state else ""))


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 5400 else f"{seconds / 60:.0f} min"


def planned(length: int) -> int:
    from kvpress_phase.cli import build_parser
    from kvpress_phase.evaluation.config import EvalConfig, planned_answers

    args = build_parser().parse_args(eval_command(length)[1:])
    return planned_answers(EvalConfig(tasks=args.tasks, presses=args.presses,
                                      compression_ratios=args.compression_ratios, strides=args.strides,
                                      windows=args.windows, phases=args.phases, context_lengths=args.context_lengths,
                                      samples=args.samples))


def held(length: int) -> int:
    from kvpress_phase.evaluation.store import read_results

    folder = run_dir(length)
    return 0 if not os.path.isdir(folder) else len(read_results(folder))


def _log_path(length: int) -> str:
    return os.path.join(run_dir(length), "progress.jsonl")


def _log(length: int) -> list[dict]:
    path = _log_path(length)
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _latest_rate(entries: list[dict]) -> Optional[float]:
    """Answers per second over the latest stretch (entries since the last ``start``) that gained answers."""
    starts = [i for i, e in enumerate(entries) if e.get("event") == "start"]
    stretch = entries[starts[-1]:] if starts else entries
    if len(stretch) < 2:
        return None
    gained = stretch[-1]["held"] - stretch[0]["held"]
    seconds = stretch[-1]["time"] - stretch[0]["time"]
    return gained / seconds if gained > 0 and seconds > 0 else None


def progress(length: int, plan: Optional[int] = None) -> Progress:
    from kvpress_phase.evaluation.store import packed_path

    rate = _latest_rate(_log(length))
    return Progress(length, held(length), plan if plan is not None else planned(length),
                    os.path.exists(packed_path(run_dir(length))), rate, rate is None)


def _append_log(length: int, event: str, n_held: int) -> None:
    os.makedirs(run_dir(length), exist_ok=True)
    with open(_log_path(length), "a") as fh:
        fh.write(json.dumps({"time": round(time.time(), 1), "utc": _now(), "event": event, "held": n_held}) + "\n")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


# ------------------------------------------------------------------------------------------------ git
def commit(length: int, message: str, *, tries: int = 5) -> bool:
    """Commit ``run_dir(length)`` alone (other staged work is left staged); False, with a line on stderr, when
    git cannot (after ``tries`` attempts: another git command may hold the index)."""
    folder = run_dir(length)
    for attempt in range(tries):
        add = subprocess.run(["git", "add", "--", folder], capture_output=True, text=True)
        if add.returncode == 0:
            staged = subprocess.run(["git", "diff", "--cached", "--quiet", "--", folder])
            if staged.returncode == 0:
                return True  # nothing new
            done = subprocess.run(["git", "commit", "-q", "-m", message, "--", folder], capture_output=True,
                                  text=True)
            if done.returncode == 0:
                return True
            error = done.stderr.strip()
        else:
            error = add.stderr.strip()
        time.sleep(2 + 3 * attempt)
    print(f"long_context: could not commit {folder}: {error}", file=sys.stderr)
    return False


def _check_preregistered() -> None:
    shown = subprocess.run(["git", "show", f"HEAD:{PREREGISTRATION}"], capture_output=True, text=True)
    if shown.returncode != 0:
        raise SystemExit(f"long_context: {PREREGISTRATION} is not committed; commit the pre-registration before "
                         "the study's first answer")


# ------------------------------------------------------------------------------------------------ run
def run_length(length: int, commit_every: float, do_commit: bool) -> bool:
    """Run (or resume) one length to its end; False when it was stopped or failed."""
    from kvpress_phase.evaluation.store import pack_run, packed_path

    plan = planned(length)
    if os.path.exists(packed_path(run_dir(length))):
        print(progress(length, plan).line(), flush=True)
        return True
    _append_log(length, "start", held(length))
    print(progress(length, plan).line(), flush=True)
    child = subprocess.Popen(eval_command(length), start_new_session=True)
    stopped = False

    def stop(signum, frame):
        nonlocal stopped
        stopped = True
        os.killpg(child.pid, signal.SIGINT)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        last = time.monotonic()
        while child.poll() is None:
            time.sleep(5)
            if time.monotonic() - last >= commit_every:
                last = time.monotonic()
                _append_log(length, "commit", held(length))
                line = progress(length, plan).line()
                print(f"\n[{_now()}] {line}", flush=True)
                if do_commit:
                    commit(length, f"Long-context study (R11), {line}")
        if stopped:
            try:
                child.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    n_held = held(length)
    _append_log(length, "stop" if (stopped or child.returncode) else "end", n_held)
    finished = not stopped and child.returncode == 0 and n_held >= plan
    if finished:
        pack_run(run_dir(length))
    line = progress(length, plan).line()
    print(f"[{_now()}] {line}", flush=True)
    if do_commit:
        commit(length, f"Long-context study (R11), {line}")
    return finished


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m studies.long_context", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    run = sub.add_parser("run", help="run or resume the study's lengths in turn, committing as it goes")
    run.add_argument("--lengths", default=",".join(map(str, LENGTHS)),
                     help="comma-separated context lengths, of " + ", ".join(map(str, LENGTHS)))
    run.add_argument("--commit-every", type=float, default=1800.0, help="seconds between commits (default 1800)")
    run.add_argument("--no-commit", action="store_true", help="leave git alone (the progress log is still kept)")
    sub.add_parser("status", help="answers held and left per length, and the time left")
    command = sub.add_parser("command", help="the eval command of one length")
    command.add_argument("length", type=int)
    args = parser.parse_args(argv)

    if args.what == "command":
        if args.length not in LENGTHS:
            parser.error(f"length must be one of {', '.join(map(str, LENGTHS))}, got {args.length}")
        print(" ".join(eval_command(args.length)))
        return 0
    if args.what == "status":
        total = 0.0
        for length in LENGTHS:
            p = progress(length)
            total += p.seconds_left
            print(p.line())
        print(f"all lengths: about {_hours(total)} left")
        return 0
    try:
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--lengths must be comma-separated integers, got {args.lengths!r}")
    unknown = [n for n in lengths if n not in LENGTHS]
    if unknown or not lengths:
        parser.error(f"--lengths must name lengths of {', '.join(map(str, LENGTHS))}, got {args.lengths!r}")
    if args.commit_every <= 0:
        parser.error(f"--commit-every must be positive, got {args.commit_every:g}")
    if not args.no_commit:
        _check_preregistered()
    for length in lengths:
        if not run_length(length, args.commit_every, not args.no_commit):
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
