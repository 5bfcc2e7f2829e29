"""The dev round of docs/preregistration-low-ratio.md (issue: a press for the low ratios): its four runs, resumable on
any machine and committed to git as they go.

    python -m studies.low_ratio_dev status        # answers held and left per run
    python -m studies.low_ratio_dev run           # every run in turn, each resumed where it stopped
    python -m studies.low_ratio_dev run --runs smollm2-s8
    python -m studies.low_ratio_dev command smollm2-s8
    python -m studies.low_ratio_dev analyse --memory smollm2=FILE.json --memory qwen2.5-coder-0.5b=FILE.json

``analyse`` applies the pre-registered rule (:mod:`studies.low_ratio_rule`) once every run holds every answer
(``--partial``: on what is held, marked provisional).

Each run is one ``kvpress-phase eval`` into ``outputs/low-ratio-dev/<run>`` (:mod:`studies.resumable`: committed every
30 minutes, when it ends and when it is stopped; packed once complete). The run refuses to start unless the
pre-registration is committed.
"""

from __future__ import annotations

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


def analyse_round(memory: list, partial: bool, output: Optional[str]) -> int:
    """``analyse``: the rule of :mod:`studies.low_ratio_rule` on the four runs. ValueError for an unfinished round
    without ``partial``, a ``--memory`` value that is not MODEL=FILE of a model of the round, or a file that is not
    the benchmark's."""
    from studies import low_ratio_rule as rule
    from studies.common import emit, model_files

    models = {RUNS[name][0] for name in RUNS}
    files = {model: rule.read_memory(path) for model, path in model_files(memory, models, "--memory").items()}
    records, answers, unfinished = resumable.read_round({name: run_dir(name) for name in RUNS}, partial,
                                                        "python -m studies.low_ratio_dev run")
    reasons = [unfinished] if unfinished else []
    if set(files) != models:
        reasons.append("bytes not measured for " + ", ".join(sorted(models - set(files))))
    per_model, scores = rule.design_scores(records)
    flat = rule.flat_table(records, [run_dir(name) for name in RUNS])
    nbytes = rule.bytes_table(files)
    decision = rule.decide(scores, flat, nbytes, provisional="; ".join(reasons) or None)
    paired = rule.paired_to_pick(records, decision)
    emit(rule.markdown(per_model, scores, flat, nbytes, decision, answers, paired), output)
    return 0


def main(argv: Optional[list] = None) -> int:
    parser, sub = resumable.runner_parser("python -m studies.low_ratio_dev", __doc__, list(RUNS),
                                          "the dev round's runs")
    analyse = sub.add_parser("analyse", help="the pre-registered rule on the round's answers")
    analyse.add_argument("--memory", action="append", default=[], metavar="MODEL=FILE",
                         help="benchmarks/bench_press_memory.py --json of one model (give one per model)")
    analyse.add_argument("--partial", action="store_true", help="apply the rule to an unfinished round (provisional)")
    analyse.add_argument("--output", help="write the Markdown to this file as well")
    args = parser.parse_args(argv)
    if args.what == "analyse":
        try:
            return analyse_round(args.memory, args.partial, args.output)
        except ValueError as exc:
            parser.error(str(exc))
    if args.what == "command":
        print(" ".join(eval_command(args.run)))
        return 0
    if args.what == "status":
        for name in RUNS:
            print(resumable.progress(run_dir(name), planned(name), name=name).line())
        return 0
    return resumable.run_in_turn(parser, args, RUNS, PREREGISTRATION, command=eval_command, folder=run_dir,
                                 planned=planned, title="Low-ratio dev round")


if __name__ == "__main__":
    sys.exit(main())
