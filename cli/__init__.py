"""The ``kvpress-phase`` command (installed as ``kvpress_phase.cli``; ``python -m kvpress_phase.cli`` runs it).

    kvpress-phase eval            # quick phase sweep on the built-in model, both presses and the baselines
    kvpress-phase eval --tasks niah_single,qa_single_doc --strides 4,8,16 --compression-ratios 0.5,0.75
    kvpress-phase list            # task, press and built-in model names the flags accept
    kvpress-phase train --recipe chunked --output-dir outputs/models/chunked   # press in the loop

Bad input exits with code 2 and a one-line message; `train --max-minutes` exits with code 3 when it pauses
(rerun the same command to resume).

This package only composes the commands: ``eval``, ``audit``, ``report``, ``pack``, ``drop`` and ``list`` are
evaluation's (:mod:`kvpress_phase.evaluation.cli`), ``train``, ``train-scorer`` and ``calibrate-scorer`` are training's
(:mod:`kvpress_phase.training.cli`, :mod:`kvpress_phase.training.scorer_cli`). Nothing in the package imports it, so that evaluation stays below training (``tests/test_import_layers.py``).
"""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

from kvpress_phase.evaluation import cli as evaluation_cli
from kvpress_phase.evaluation.arguments import Parser, run_command_line

DESCRIPTION = evaluation_cli.DESCRIPTION
EXAMPLES = """examples:
  kvpress-phase eval      quick phase sweep on the built-in model
  kvpress-phase eval --tasks niah_single,qa_single_doc --strides 4,8,16 --compression-ratios 0.5,0.75 \\
      --output-dir outputs/sweep
  kvpress-phase audit chunkkv,chunk:scorer=keydiff --model smollm2 --output-dir outputs/audit
  kvpress-phase report outputs/sweep outputs/phase-eval --output-dir outputs/merged
  kvpress-phase pack outputs/sweep   finished runs stored compactly (one Parquet file of every answer)
  kvpress-phase drop outputs/sweep --presses knorm   a press's answers taken out, to answer them again by resuming
  kvpress-phase list      task, press and model names the flags accept
  kvpress-phase train --recipe chunked --output-dir outputs/models/chunked
  kvpress-phase train-scorer --model smollm2 --output-dir outputs/scorers/smollm2
  kvpress-phase calibrate-scorer --model smollm2   the scorer's score quantiles (thresholds.json)

Run kvpress-phase COMMAND --help for the options of a command. Bad input exits with code 2 and a one-line
message; train --max-minutes exits with code 3 when it pauses (rerun the same command to resume)."""


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``kvpress-phase``: evaluation's commands, then ``train``."""
    from kvpress_phase.training import cli as training_cli  # imported when the parser is built, as before
    from kvpress_phase.training import scorer_cli

    parser = Parser(prog="kvpress-phase", description=DESCRIPTION, epilog=EXAMPLES,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = list(evaluation_cli.COMMANDS) + ["train", "train-scorer", "calibrate-scorer"]  # evaluation's commands, then training's
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(commands) + "}", parser_class=Parser)
    sub.required = True
    evaluation_cli.add_commands(sub)
    training_cli.add_command(sub)
    scorer_cli.add_command(sub)
    scorer_cli.add_calibrate_command(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``kvpress-phase`` with ``argv`` (None: ``sys.argv[1:]``); the exit code."""

    def run(args: argparse.Namespace) -> int:
        if args.command == "train":
            from kvpress_phase.training import cli as training_cli

            return training_cli.run_command(args, argv)
        if args.command == "train-scorer":
            from kvpress_phase.training import scorer_cli

            return scorer_cli.run_command(args, argv)
        if args.command == "calibrate-scorer":
            from kvpress_phase.training import scorer_cli

            return scorer_cli.run_calibrate(args, argv)
        return evaluation_cli.run_command(args)

    return run_command_line(build_parser(), run, argv)


__all__ = ["build_parser", "main"]
