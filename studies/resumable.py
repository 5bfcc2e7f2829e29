"""Long runs that outlive a machine: ``kvpress-phase eval`` into one folder, the folder committed to git as it fills,
and a progress line (answers held, answers left, the time left at the latest rate).

``eval`` writes every answer once, under its key, and resumes where a folder's answers stop; this adds the commits
(every ``commit_every`` seconds, when the run ends, and when it is stopped with Ctrl-C or SIGTERM) and a
``progress.jsonl`` in the folder (time, answers held), from which :func:`progress` reads the rate of the latest
stretch of work, so that a fresh clone on another machine resumes the run and knows how long it has left. The
studies' runners (:mod:`studies.long_context`, :mod:`studies.low_ratio_dev`) use it; it imports none of them.
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

LOG = "progress.jsonl"


@dataclasses.dataclass
class Progress:
    name: str
    held: int
    planned: int
    packed: bool
    rate: Optional[float]  # answers per second over the latest timed stretch; None when there is none yet
    estimate: Optional[float] = None  # seconds for the whole run from a sizing, used while there is no rate

    @property
    def left(self) -> int:
        return max(self.planned - self.held, 0)

    @property
    def seconds_left(self) -> Optional[float]:
        if self.left == 0:
            return 0.0
        if self.rate:
            return self.left / self.rate
        return None if self.estimate is None else self.estimate * self.left / self.planned

    def line(self) -> str:
        state = "finished, packed" if self.packed else ("finished" if self.left == 0 else "")
        eta = ""
        if self.left:
            s = self.seconds_left
            eta = ("time left unknown until it runs" if s is None else
                   f"about {hours(s)} left" + (" (at its last rate)" if self.rate else " (the sizing's estimate)"))
        return (f"{self.name}: {self.held:,} of {self.planned:,} answers held, {self.left:,} left"
                + (f"; {eta}" if eta else "") + (f"; {state}" if state else ""))


def hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 5400 else f"{seconds / 60:.0f} min"


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def held(folder: str) -> int:
    from kvpress_phase.evaluation.store import read_results

    return 0 if not os.path.isdir(folder) else len(read_results(folder))


def read_log(folder: str) -> list[dict]:
    path = os.path.join(folder, LOG)
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def append_log(folder: str, event: str, n_held: int) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, LOG), "a") as fh:
        fh.write(json.dumps({"time": round(time.time(), 1), "utc": now(), "event": event, "held": n_held}) + "\n")


def latest_rate(entries: list[dict]) -> Optional[float]:
    """Answers per second over the latest stretch (the entries since the last ``start``), when it gained answers."""
    starts = [i for i, e in enumerate(entries) if e.get("event") == "start"]
    stretch = entries[starts[-1]:] if starts else entries
    if len(stretch) < 2:
        return None
    gained = stretch[-1]["held"] - stretch[0]["held"]
    seconds = stretch[-1]["time"] - stretch[0]["time"]
    return gained / seconds if gained > 0 and seconds > 0 else None


def eval_config(command: list[str]):
    """The configuration of a ``kvpress-phase eval`` command line, as ``eval`` would run it (not validated)."""
    from kvpress_phase.cli import build_parser
    from kvpress_phase.evaluation.commands import eval_config as from_args

    return from_args(build_parser().parse_args(command[1:]))


def planned(command: list[str]) -> int:
    """How many answers a complete run of the ``eval`` command line holds."""
    from kvpress_phase.evaluation.config import planned_answers

    return planned_answers(eval_config(command))


def progress(folder: str, planned: int, name: Optional[str] = None, estimate: Optional[float] = None) -> Progress:
    from kvpress_phase.evaluation.store import packed_path

    return Progress(name or folder, held(folder), planned, os.path.exists(packed_path(folder)),
                    latest_rate(read_log(folder)), estimate)


def commit(folder: str, message: str, *, tries: int = 5) -> bool:
    """Commit ``folder`` alone (other staged work stays staged); True when there was nothing new. False, with a line
    on stderr, when git cannot after ``tries`` attempts (another git command may hold the index)."""
    error = ""
    for attempt in range(tries):
        add = subprocess.run(["git", "add", "--", folder], capture_output=True, text=True)
        if add.returncode == 0:
            if subprocess.run(["git", "diff", "--cached", "--quiet", "--", folder]).returncode == 0:
                return True  # nothing new
            done = subprocess.run(["git", "commit", "-q", "-m", message, "--", folder], capture_output=True,
                                  text=True)
            if done.returncode == 0:
                return True
            error = done.stderr.strip()
        else:
            error = add.stderr.strip()
        time.sleep(2 + 3 * attempt)
    print(f"resumable: could not commit {folder}: {error}", file=sys.stderr)
    return False


def add_run_options(parser) -> None:
    """The options every runner's ``run`` takes: ``--commit-every`` and ``--no-commit``."""
    parser.add_argument("--commit-every", type=float, default=1800.0, help="seconds between commits (default 1800)")
    parser.add_argument("--no-commit", action="store_true", help="leave git alone (the progress log is still kept)")


def runner_parser(prog: str, doc: str, runs: list, what: str) -> tuple:
    """A study runner's command line: ``run [--runs A,B] [--commit-every S] [--no-commit]``, ``status`` and
    ``command RUN`` (``what``: what the study's runs are, for the help). Returns the parser and its subparsers, for
    the runner's own commands."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    run = sub.add_parser("run", help=f"run or resume {what} in turn, committing as they go")
    run.add_argument("--runs", default=",".join(runs), help="comma-separated runs, of " + ", ".join(runs))
    add_run_options(run)
    sub.add_parser("status", help="answers held and left per run")
    command = sub.add_parser("command", help="the eval command of one run")
    command.add_argument("run", choices=list(runs))
    return parser, sub


def run_in_turn(parser, args, runs: list, preregistration: str, *, command, folder, planned, title: str) -> int:
    """``run``: the runs ``args.runs`` names, each to its end in turn (:func:`run_committed`), after
    :func:`start_runs`' checks; ``command(name)``, ``folder(name)`` and ``planned(name)`` give a run's eval, its
    output folder and its answers, ``title`` the commits' subject (``{title}, {name}``). 0 when every run finished,
    1 when one was stopped or failed."""
    names = [x.strip() for x in args.runs.split(",") if x.strip()]
    start_runs(parser, args, names, list(runs), preregistration)
    for name in names:
        if not run_committed(command(name), folder(name), planned(name), title=f"{title}, {name}",
                             commit_every=args.commit_every, do_commit=not args.no_commit):
            return 1
    return 0


def read_round(folders: dict, partial: bool, resume: str) -> tuple:
    """The answers of a study's runs (``{name: folder}``) for its analysis: ``(records, answers, unfinished)``, with
    ``answers`` a line saying how many answers of how many planned, from which runs, and ``unfinished`` None or a
    line naming the runs short of their plan. ValueError when a run is short and not ``partial`` (``resume``: the
    command that finishes them), or when no run has started."""
    from studies.common import load_runs

    held = {name: folder for name, folder in folders.items() if os.path.exists(os.path.join(folder, "config.json"))}
    if not held:
        raise ValueError(f"no run has started: {resume}")
    records, infos = load_runs(list(held.values()))
    short = [f"{os.path.basename(i.path)} {i.answers:,} of {i.planned:,}" for i in infos if i.answers < i.planned]
    short += [f"{name} not started" for name in folders if name not in held]
    if short and not partial:
        raise ValueError("the round is not finished (" + "; ".join(short) + f"): finish it with `{resume}`, or give "
                         "--partial for a provisional reading")
    answers = (f"{len(records):,} answers held, of {sum(i.planned for i in infos):,} planned in the runs started, "
               f"from {', '.join(held)}.")
    return records, answers, ("the round is not finished: " + "; ".join(short)) if short else None


def start_runs(parser, args, chosen: list, known, preregistration: str) -> None:
    """Refuse (``parser.error``: exit code 2 with a line) an empty or unknown choice of runs and a ``--commit-every``
    that is not positive; unless ``--no-commit``, refuse to start before ``preregistration`` is committed."""
    unknown = [x for x in chosen if x not in known]
    if unknown or not chosen:
        parser.error(f"choose runs of {', '.join(map(str, known))}; got {', '.join(map(str, unknown)) or 'none'}")
    if args.commit_every <= 0:
        parser.error(f"--commit-every must be positive, got {args.commit_every:g}")
    if not args.no_commit:
        check_committed(preregistration, "the pre-registration")


def check_committed(path: str, what: str) -> None:
    """SystemExit (exit code 2 with a line) unless ``path`` is committed: a study's runs start after its
    pre-registration."""
    if subprocess.run(["git", "show", f"HEAD:{path}"], capture_output=True).returncode != 0:
        print(f"{path} is not committed; commit {what} before the first answer", file=sys.stderr)
        raise SystemExit(2)


def check_trackable(folder: str) -> None:
    """SystemExit (exit code 2 with a line) when git ignores ``folder``: every commit of the run would fail, and a
    machine that goes away would take the run's answers with it. A run's folder needs a ``!/outputs/NAME/`` line in
    .gitignore."""
    probe = os.path.join(folder, "results.parquet")  # a file every run writes; the folder itself may not exist yet
    ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", "--", probe], capture_output=True)
    if ignored.returncode == 0:
        top = "/".join(folder.strip("/").split("/")[:2])
        print(f"git ignores {folder}, so the run could not be committed as it goes: add the line '!/{top}/' to "
              ".gitignore, or give --no-commit", file=sys.stderr)
        raise SystemExit(2)


def run_committed(command: list[str], folder: str, planned: int, *, title: str, commit_every: float = 1800.0,
                  do_commit: bool = True, estimate: Optional[float] = None, grace: float = 60.0) -> bool:
    """Run (or resume) ``command`` (a ``kvpress-phase eval`` into ``folder``) to its end, committing ``folder`` as it
    goes (``title``: the commits' subject); pack the run when every planned answer is held. True when it finished;
    False when it was stopped or failed (what it wrote is committed either way). Stopped, the evaluation gets SIGINT
    and, if it has not ended ``grace`` seconds later, SIGKILL (an answer is written whole or not at all)."""
    from kvpress_phase.evaluation.store import pack_run, packed_path

    def line() -> str:
        return progress(folder, planned, estimate=estimate).line()

    if os.path.exists(packed_path(folder)):
        print(line(), flush=True)
        return True
    if do_commit:
        check_trackable(folder)
    stopped = False
    child = None

    def stop(signum, frame):
        nonlocal stopped
        stopped = True
        if child is not None and child.poll() is None:
            os.killpg(child.pid, signal.SIGINT)

    # from here on Ctrl-C and SIGTERM stop the run cleanly (a runner started in the background by a shell ignores
    # SIGINT until it installs a handler, and its children would inherit that: they get the default back)
    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        append_log(folder, "start", held(folder))
        print(line(), flush=True)
        if not stopped:
            child = subprocess.Popen(command, start_new_session=True,
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        last = time.monotonic()
        while child is not None and child.poll() is None and not stopped:
            time.sleep(1)
            if time.monotonic() - last >= commit_every:
                last = time.monotonic()
                append_log(folder, "commit", held(folder))
                text = line()
                print(f"\n[{now()}] {text}", flush=True)
                if do_commit:
                    commit(folder, f"{title}: {text}")
        if stopped and child is not None:
            try:
                child.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    returncode = child.returncode if child is not None else 1
    n_held = held(folder)
    append_log(folder, "stop" if (stopped or returncode) else "end", n_held)
    finished = not stopped and returncode == 0 and n_held >= planned
    if finished:
        pack_run(folder)
    text = line()
    print(f"[{now()}] {text}", flush=True)
    if do_commit:
        commit(folder, f"{title}: {text}")
    return finished
