"""What the command-line benchmarks share: their lists of numbers and names, the way they refuse bad input (a message
on stderr, exit code 2, before any model loads), their torch threads, the first line of their Markdown result,
appending that result to ``--output``, and the process's peak resident memory (Linux).

    from common import bad_input, parse_list, set_threads
"""

from __future__ import annotations

import datetime
import gc
import platform
import sys


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else the platform's machine name."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def parse_list(text: str, kind, name: str) -> list:
    """The comma-separated numbers of the flag ``--name`` as ``kind`` (empty parts skipped); ValueError naming the
    flag when a part is not a number or there is none."""
    try:
        values = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--{name} takes a comma-separated list of numbers, got {text!r}") from None
    if not values:
        raise ValueError(f"--{name} is empty")
    return values


def parse_names(text: str) -> list[str]:
    """The comma-separated names of ``text``, stripped, empty parts skipped."""
    return [part.strip() for part in text.split(",") if part.strip()]


def bad_input(exc: Exception) -> int:
    """Print ``exc`` as an error on stderr; the exit code of bad input, 2."""
    print(f"error: {exc}", file=sys.stderr)
    return 2


def set_threads(threads: int | None) -> None:
    """Give torch ``threads`` threads; ``None`` or 0 keeps torch's default."""
    if threads:
        import torch

        torch.set_num_threads(threads)


def run_line(script: str, argv=None) -> str:
    """The start of a result's first line: the command run (``argv``, else the process's arguments), the UTC time,
    the CPU, torch's threads and version."""
    import torch

    command = f"python benchmarks/{script} {' '.join(argv if argv is not None else sys.argv[1:])}"
    return (f"`{command}`, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {cpu_name()}, "
            f"{torch.get_num_threads()} threads, torch {torch.__version__}")


def append_result(path: str | None, lines: list[str]) -> None:
    """Append ``lines`` and a blank line to the Markdown file ``path``, if one is given."""
    if path:
        with open(path, "a") as fh:
            fh.write("\n".join(lines) + "\n\n")


def proc_status(field: str) -> int:
    """The bytes of ``field`` (``VmRSS``, ``VmHWM``, ...) in ``/proc/self/status``; RuntimeError when it is not
    there."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak() -> int:
    """Reset VmHWM to the current resident size; return that size."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    return proc_status("VmRSS")
