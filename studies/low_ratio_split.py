"""R10, the low-ratio fresh split of docs/preregistration-low-ratio.md: its six runs, resumable on any machine and
committed to git as they go, and its targets.

    python -m studies.low_ratio_split status        # answers held and left per run
    python -m studies.low_ratio_split run           # every run in turn, each resumed where it stopped
    python -m studies.low_ratio_split run --runs smollm2-agnostic-1024
    python -m studies.low_ratio_split command smollm2-agnostic-1024
    python -m studies.low_ratio_split targets --output docs/results/low-ratio/tables.md

A run is one ``kvpress-phase eval`` (model x setting x context length; both strides, 6 and 12, in it) into
``outputs/low-ratio-split/<run>`` (:mod:`studies.resumable`: committed every 30 minutes, when it ends and when it is
stopped; packed once complete). The presses are the frozen recommendation, which the pre-registration's "Frozen
configuration" section names on a line ``- recommendation: `SPEC` `` (:func:`frozen_recommendation`), G,
``phase_aware``, ``no_press``, ``chunked_stride`` and every registered kvpress baseline. ``run`` refuses to start
until that line is committed: the split does not run before the dev round's choice is frozen.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Optional

from kvpress_phase.evaluation.presses import parse_press_spec

from studies import resumable
from studies.common import kvpress_baselines

PREREGISTRATION = "docs/preregistration-low-ratio.md"
OUTPUT = "outputs/low-ratio-split"
SEED, STRIDES, SAMPLES = 71, "6,12", "8"
COMMON = ("--compression-ratios", "0.25,0.5,0.75", "--protocol", "offset", "--matched-cache", "--samples", SAMPLES,
          "--strides", STRIDES, "--seed", str(SEED), "--no-diagnostics", "--threads", "2", "--dtype", "float32")
MODELS = {"smollm2": ("smollm2", "1024,2048".split(","), "niah_single,niah_multikey"),
          "qwen": ("qwen2.5-coder-0.5b", ["2048"], "niah_multiquery,qa_multi_doc")}
"""Short name: (model, context lengths, tasks): the pre-registration's R10 section."""
SETTINGS = {"agnostic": (), "aware": ("--query-aware",)}
RUNS = {f"{short}-{setting}-{length}": (model, length, tasks, setting)
        for short, (model, lengths, tasks) in MODELS.items() for setting in SETTINGS for length in lengths}
"""Run name: (model, context length, tasks, setting): 4 SmolLM2 runs and 2 Qwen runs."""
FIXED = ("global_budget:scorer=kvzap", "phase_aware", "no_press", "chunked_stride")
FROZEN_LINE = re.compile(r"^- recommendation: `([^`]+)`", re.MULTILINE)


def frozen_recommendation(text: Optional[str] = None) -> str:
    """The press spec the pre-registration's "Frozen configuration" section names (``- recommendation: `SPEC` ``).
    ValueError when the section names none, or names a spec the registry does not know."""
    if text is None:
        with open(PREREGISTRATION, encoding="utf-8") as fh:
            text = fh.read()
    _, found, section = text.partition("## Frozen configuration")
    section = section.split("\n## ", 1)[0]
    match = FROZEN_LINE.search(section) if found else None
    if match is None:
        raise ValueError(f"{PREREGISTRATION} freezes no recommendation yet (its \"Frozen configuration\" section has "
                         "no line \"- recommendation: `SPEC`\"): run the dev round and apply its rule first "
                         "(python -m studies.low_ratio_dev analyse)")
    return parse_press_spec(match.group(1)).label


def presses(recommendation: str) -> list[str]:
    """The split's presses: the recommendation, G, ``phase_aware``, ``no_press``, ``chunked_stride`` and every
    registered kvpress baseline (each once)."""
    return list(dict.fromkeys([recommendation, *FIXED, *kvpress_baselines()]))


def run_dir(name: str) -> str:
    return os.path.join(OUTPUT, name)


def eval_command(name: str, recommendation: str) -> list[str]:
    model, length, tasks, setting = RUNS[name]
    return ["kvpress-phase", "eval", "--model", model, "--tasks", tasks, "--context-lengths", length, *COMMON,
            *SETTINGS[setting], "--presses", ",".join(presses(recommendation)), "--output-dir", run_dir(name)]


def planned(name: str, recommendation: str) -> int:
    return resumable.planned(eval_command(name, recommendation))


def report_targets(recommendation: str, partial: bool, replicates: int, output: Optional[str]) -> int:
    """``targets``: :mod:`studies.low_ratio_targets` on the split's runs, the recommendation's and every other press
    of ours the split answered. ValueError for an unfinished split without ``partial``."""
    from studies import low_ratio_targets
    from studies.common import emit

    if replicates < 100:
        raise ValueError(f"--replicates must be at least 100, got {replicates}")
    records, answers, unfinished = resumable.read_round({name: run_dir(name) for name in RUNS}, partial,
                                                        "python -m studies.low_ratio_split run")
    if unfinished:
        answers += f" **Provisional: {unfinished}.**"
    ours = [p for p in presses(recommendation) if p not in (*kvpress_baselines(), "no_press", "chunked_stride")]
    emit(low_ratio_targets.report(records, recommendation, ours, kvpress_baselines(), answers, replicates), output)
    return 0


def main(argv: Optional[list] = None) -> int:
    parser, sub = resumable.runner_parser("python -m studies.low_ratio_split", __doc__, list(RUNS),
                                          "the split's runs")
    report = sub.add_parser("targets", help="R10's pre-registered targets from the runs (studies.low_ratio_targets)")
    report.add_argument("--partial", action="store_true", help="report an unfinished split (marked provisional)")
    report.add_argument("--replicates", type=int, default=2000, help="the yardstick's simulated splits")
    report.add_argument("--output", help="write the Markdown to this file as well")
    args = parser.parse_args(argv)
    try:
        recommendation = frozen_recommendation()
    except ValueError as exc:
        parser.error(str(exc))
    if args.what == "targets":
        try:
            return report_targets(recommendation, args.partial, args.replicates, args.output)
        except ValueError as exc:
            parser.error(str(exc))
    if args.what == "command":
        print(" ".join(eval_command(args.run, recommendation)))
        return 0
    if args.what == "status":
        for name in RUNS:
            print(resumable.progress(run_dir(name), planned(name, recommendation), name=name).line())
        return 0
    return resumable.run_in_turn(parser, args, RUNS, PREREGISTRATION,
                                 command=lambda name: eval_command(name, recommendation), folder=run_dir,
                                 planned=lambda name: planned(name, recommendation), title="R10 (low-ratio split)")


if __name__ == "__main__":
    sys.exit(main())
