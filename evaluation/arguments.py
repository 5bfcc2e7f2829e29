"""What the ``eval`` and ``train`` commands share: comma-separated list flags, the device flag, and the first
line of an error for the one-line messages of bad input."""

from __future__ import annotations

import argparse

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


def csv_list(cast, name: str):
    """The argparse ``type`` of a comma-separated list flag ``name`` whose items are ``cast``: empty items are
    skipped, and a bad item or an empty list is an error naming the flag."""

    def parse(text: str):
        try:
            values = [cast(x) for x in text.split(",") if x.strip() != ""]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} takes a comma-separated list, got {text!r}") from None
        if not values:
            raise argparse.ArgumentTypeError(f"{name} must not be empty")
        return values

    return parse


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
