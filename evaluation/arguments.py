"""What the ``eval`` and ``train`` commands share: comma-separated list flags, the device and threads flags, the
check of ``--model`` (:func:`check_model_flag`), the first line of an error for the one-line messages of bad input,
and the parser and error handling of the command line (:class:`UsageError`, :class:`Parser`,
:func:`run_command_line`).

Nothing here imports torch when the module is imported, so that parsing a command line (and ``--help``) is fast."""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
from typing import Callable, Iterator, Optional, Sequence

MIN_BOOTSTRAP = 100
"""Fewest bootstrap resamples ``--bootstrap`` accepts (``eval`` and ``report``)."""


def int_at_least(minimum: int, name: str):
    """The argparse ``type`` of an integer flag ``name`` that must be ``>= minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} takes an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{name} must be >= {minimum}, got {value}")
        return value

    return parse


def csv_list(cast, name: str, check: Optional[Callable[[object], Optional[str]]] = None):
    """The argparse ``type`` of a comma-separated list flag ``name`` whose items are ``cast``: empty items are
    skipped, and a bad item or an empty list is an error naming the flag. ``check(value)``: what is wrong with an
    item, the error's words after the flag's name (``must hold ...``), or None when it is good."""

    def parse(text: str):
        try:
            values = [cast(x) for x in text.split(",") if x.strip() != ""]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} takes a comma-separated list, got {text!r}") from None
        if not values:
            raise argparse.ArgumentTypeError(f"{name} must not be empty")
        for value in values if check else ():
            problem = check(value)
            if problem:
                raise argparse.ArgumentTypeError(f"{name} {problem}")
        return values

    return parse


def at_least(minimum: int, what: str) -> Callable[[int], Optional[str]]:
    """A :func:`csv_list` check: integers ``what`` that are ``>= minimum``."""
    return lambda value: None if value >= minimum else f"must hold {what} >= {minimum}, got {value}"


def compression_ratios(name: str = "--compression-ratios"):
    """The argparse ``type`` of a list of compression ratios, each in ``[0, 1)``: refused while the command line is
    parsed, before torch is imported."""
    return csv_list(float, name, lambda r: None if 0 <= r < 1 else f"must hold compression ratios in [0, 1), got {r:g}")


threads = int_at_least(1, "--threads")
"""The argparse ``type`` of ``--threads`` (``eval``, ``audit`` and ``train``): torch's intra-op CPU threads, >= 1."""


@contextlib.contextmanager
def torch_threads(n: Optional[int]) -> Iterator[int]:
    """Run the body with ``n`` torch intra-op threads (None: torch's own choice) and give back the number in effect;
    the previous number is restored afterwards."""
    import torch

    previous = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield torch.get_num_threads()
    finally:
        if n is not None:
            torch.set_num_threads(previous)


def resolve_device(text: str) -> str:
    """``cpu``/``cuda[:N]`` from ``auto``, ``cpu``, ``cuda`` or ``cuda:N``; ValueError when unavailable."""
    import torch

    if text == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if text.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {text}: no CUDA device is available")
    if text != "cpu" and not text.startswith("cuda"):
        raise ValueError(f"device must be cpu, cuda, cuda:N or auto, got {text!r}")
    return text


def first_line(exc: Exception) -> str:
    """The first line of ``exc``'s message, or its type's name when the message is empty."""
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


class UsageError(Exception):
    """Bad command-line input: reported in one line with exit code 2."""


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are :class:`UsageError` (one line, exit code 2, no usage dump)."""

    def error(self, message):  # one line, exit code 2, no usage dump
        # "argument --x: --x must be ..." (our flag types name their flag) -> "--x must be ..."
        raise UsageError(re.sub(r"^argument (\S+): \1 ", r"\1 ", message))


def check_model_flag(model: Optional[str]) -> None:
    """:class:`UsageError` with one line when ``--model`` names nothing the commands can load (an unknown name is
    refused naming the registered models: :func:`kvpress_phase.builtin.check_model_name`), found before anything
    imports torch, fetches or loads a model."""
    from kvpress_phase.builtin import check_model_name

    try:
        check_model_name(model)
    except ValueError as exc:
        raise UsageError(first_line(exc)) from None


def run_command_line(parser: argparse.ArgumentParser, run: Callable[[argparse.Namespace], int],
                     argv: Optional[Sequence[str]] = None) -> int:
    """Parse ``argv`` (None: ``sys.argv[1:]``) with ``parser`` and return ``run(args)``, the exit code.

    Bad input (:class:`UsageError`) is one line ``kvpress-phase: error: ...`` on stderr and exit code 2; an
    interrupt exits with code 130 and a line saying that the same command resumes; output piped into a command
    that stopped reading (e.g. ``| head``) ends quietly with code 0.
    """
    try:
        return run(parser.parse_args(argv))
    except UsageError as exc:
        print(f"kvpress-phase: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvpress-phase: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into a command that stopped reading (e.g. `| head`)
        sys.stderr.close()
        return 0
