"""The dev round of docs/preregistration-low-ratio.md (issue: a press for the low ratios): its four runs, resumable on
any machine and committed to git as they go.

    python -m studies.low_ratio_dev status        # answers held and left per run
    python -m studies.low_ratio_dev run           # every run in turn, each resumed where it stopped
    python -m studies.low_ratio_dev run --runs smollm2-s8
    python -m studies.low_ratio_dev command smollm2-s8

Each run is one ``kvpress-phase eval`` into ``outputs/low-ratio-dev/<run>`` (:mod:`studies.resumable`: committed every
30 minutes, when it ends and when it is stopped; packed once complete). The run refuses to start unless the
pre-registration is committed.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from studies import resumable

PREREGISTRATION = "docs/preregistration-low-ratio.md"
OUTPUT = "outputs/low-ratio-dev"
PRESSES = ("no_press", "chunked_stride", "global_budget:scorer=kvzap", "global_budget:scorer=kvzap_keydiff_25",
           "global_budget:scorer=kvzap_keydiff_50", "global_budget:scorer=kvzap_keydiff_75",
           "global_budget:scorer=kvzap_mlp", "global_budget:scorer=kvzap:n_local=64",
           "global_budget:scorer=kvzap:n_local=256", "phase_aware", "head_budget:floor=1.0", "keydiff", "adakv",
           "snapkv", "kvzip_plus", "expected_attention", "pyramidkv")
"""The pre-registration's candidates, references, controls and baselines."""
COMMON = ("--compression-ratios", "0.25,0.5,0.75", "--protocol", "offset", "--matched-cache", "--samples", "4",
          "--no-diagnostics", "--threads", "2", "--dtype", "float32")
RUNS = {
    "smollm2-s8": ("smollm2", 8, 10, "1024,2048", "niah_single,niah_multikey"),
    "smollm2-s12": ("smollm2", 12, 15, "1024,2048", "niah_single,niah_multikey"),
    "qwen-s8": ("qwen2.5-coder-0.5b", 8, 10, "2048", "niah_multiquery,qa_multi_doc"),
    "qwen-s12": ("qwen2.5-coder-0.5b", 12, 15, "2048", "niah_multiquery,qa_multi_doc"),
}
"""Run name: (model, stride, seed (R9's dev texts), context lengths, tasks)."""


def run_dir(name: str) -> str:
    return os.path.join(OUTPUT, name)


def eval_command(name: str) -> list[str]:
    model, stride, seed, lengths, tasks = RUNS[name]
    return ["kvpress-phase", "eval", "--model", model, "--tasks", tasks, "--strides", str(stride), "--seed", str(seed),
            "--context-lengths", lengths, *COMMON, "--presses", ",".join(PRESSES), "--output-dir", run_dir(name)]


def planned(name: str) -> int:
    return resumable.planned(eval_command(name))


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m studies.low_ratio_dev", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    run = sub.add_parser("run", help="run or resume the dev round's runs in turn, committing as they go")
    run.add_argument("--runs", default=",".join(RUNS), help="comma-separated runs, of " + ", ".join(RUNS))
    resumable.add_run_options(run)
    sub.add_parser("status", help="answers held and left per run")
    command = sub.add_parser("command", help="the eval command of one run")
    command.add_argument("run", choices=list(RUNS))
    args = parser.parse_args(argv)
    if args.what == "command":
        print(" ".join(eval_command(args.run)))
        return 0
    if args.what == "status":
        for name in RUNS:
            print(resumable.progress(run_dir(name), planned(name), name=name).line())
        return 0
    names = [x.strip() for x in args.runs.split(",") if x.strip()]
    resumable.start_runs(parser, args, names, list(RUNS), PREREGISTRATION)
    for name in names:
        if not resumable.run_committed(eval_command(name), run_dir(name), planned(name),
                                       title=f"Low-ratio dev round, {name}", commit_every=args.commit_every,
                                       do_commit=not args.no_commit):
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
