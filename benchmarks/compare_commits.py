"""Run one benchmark of this repository at several commits on this machine, in turn, to tell code from CPU.

    python benchmarks/compare_commits.py 90be0b5 HEAD --rounds 3 -- \\
        --sizes 16384 --cases copy,chunked_select,chunked_pool,phase_aware,kvpress_chunk --repeats 9 --no-memory

Each commit is checked out into a temporary worktree and installed there (``pip install --no-deps --target``, so
the environment's own install is untouched), and ``benchmarks/bench_presses.py`` *of that commit* runs with the
arguments after ``--``, with that install first on ``PYTHONPATH``. The commits alternate for ``--rounds`` rounds,
so that a change in the machine's load falls on all of them alike. Every round's Markdown table is printed, then
the median over rounds of each case's time per commit. A commit whose figures match another's within the rounds'
spread did not change the benchmark on this machine.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = "benchmarks/bench_presses.py"
ROW = re.compile(r"^\| (\w+) \| ([0-9.]+) \|")


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", ROOT, *args], check=True, capture_output=True, text=True).stdout.strip()


def prepare(commit: str, work: str) -> tuple[str, str]:
    """``(worktree, install dir)`` of ``commit`` under ``work``."""
    sha = _git("rev-parse", "--verify", f"{commit}^{{commit}}")
    tree, target = os.path.join(work, sha[:12]), os.path.join(work, sha[:12] + "-site")
    _git("worktree", "add", "--detach", "--force", tree, sha)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", target, tree], check=True)
    return tree, target


def run(tree: str, target: str, bench_args: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": target}
    job = subprocess.run([sys.executable, os.path.join(tree, BENCH), *bench_args], cwd=tempfile.gettempdir(),
                         env=env, capture_output=True, text=True, check=True)
    return job.stdout


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("commits", nargs="+", help="commits to compare (any git revision)")
    parser.add_argument("--rounds", type=int, default=3, help="times each commit runs, alternating (default 3)")
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    times: dict[str, dict[str, list[float]]] = {c: {} for c in args.commits}
    try:
        with tempfile.TemporaryDirectory(prefix="compare-commits-") as work:
            trees = {c: prepare(c, work) for c in args.commits}
            for r in range(args.rounds):
                for commit in args.commits:
                    out = run(*trees[commit], bench_args)
                    print(f"## {commit} ({_git('rev-parse', '--short', commit)}), round {r + 1}\n\n{out}", flush=True)
                    for line in out.splitlines():
                        m = ROW.match(line)
                        if m:
                            times[commit].setdefault(m.group(1), []).append(float(m.group(2)))
    finally:
        _git("worktree", "prune")  # the temporary worktrees are gone with their folder
    cases = list(dict.fromkeys(case for c in args.commits for case in times[c]))
    print("## Median over rounds (ms, first size)\n")
    print("| case | " + " | ".join(args.commits) + " |")
    print("|---|" + "---|" * len(args.commits))
    for case in cases:
        cells = [f"{statistics.median(times[c][case]):.1f} ({min(times[c][case]):.1f}-{max(times[c][case]):.1f})"
                 if case in times[c] else "-" for c in args.commits]
        print(f"| {case} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
