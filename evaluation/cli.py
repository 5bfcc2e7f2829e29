"""The evaluation commands of ``kvpress-phase``: ``eval``, ``audit``, ``report``, ``pack``, ``drop`` and ``list``.

    kvpress-phase eval            # quick phase sweep on the built-in model, both presses and the baselines
    kvpress-phase eval --tasks niah_single,qa_single_doc --strides 4,8,16 --compression-ratios 0.5,0.75
    kvpress-phase list            # task, press and built-in model names the flags accept

This module runs the command asked for (:func:`run_command`), on top of the others: the commands' flags and
defaults are :mod:`.flags` (:func:`add_commands`, :func:`build_parser`, :data:`QUICK_SETTINGS`,
:func:`default_presses`, re-exported here), what each command does is :mod:`.commands`. The ``kvpress-phase``
command itself, which adds training's ``train`` (:mod:`kvpress_phase.training.cli`), is :mod:`kvpress_phase.cli`;
this module registers its commands there and imports nothing from training. ``python -m
kvpress_phase.evaluation.cli`` runs these commands alone. Bad input exits with code 2 and a one-line message.
"""

from __future__ import annotations

import argparse

from .arguments import (MIN_BOOTSTRAP, Parser, UsageError, at_least, compression_ratios, csv_list,  # noqa: F401
                        int_at_least, run_command_line, threads)
from .flags import (AUDIT_DESCRIPTION, AUDIT_REFERENCE, COMMANDS, DESCRIPTION, QUICK_SETTINGS,  # noqa: F401
                    THREADS_HELP, add_commands, build_parser, default_presses)


def run_command(args: argparse.Namespace) -> int:
    """Run one of :data:`COMMANDS` from parsed flags (:mod:`.commands`); the exit code (:class:`UsageError` for bad
    input)."""
    from . import commands

    run = {"list": lambda: commands.cmd_list(), "pack": lambda: commands.cmd_pack(args),
           "drop": lambda: commands.cmd_drop(args), "report": lambda: commands.cmd_report(args),
           "audit": lambda: commands.cmd_audit(args)}
    return run.get(args.command, lambda: commands.cmd_eval(args))()


def __getattr__(name: str):
    """:data:`QUICK`, the :class:`~.config.EvalConfig` of :data:`QUICK_SETTINGS`, built when first asked for (the
    configuration module imports torch); and the model loading of :mod:`.commands` (:func:`~.commands.load_model`,
    :func:`~.commands.resolve_model_path`), which scripts import from here."""
    if name == "QUICK":
        import copy

        from .config import EvalConfig

        return EvalConfig(**copy.deepcopy(QUICK_SETTINGS))
    if name in ("load_model", "resolve_model_path"):
        from . import commands

        return getattr(commands, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(argv=None) -> int:
    """The evaluation commands alone (``python -m kvpress_phase.evaluation.cli``); ``kvpress-phase`` is
    :func:`kvpress_phase.cli.main`."""
    return run_command_line(build_parser(), run_command, argv)


if __name__ == "__main__":
    raise SystemExit(main())
