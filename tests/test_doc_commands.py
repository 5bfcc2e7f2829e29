"""Every ``kvpress-phase`` command in the README and the docs parses with today's flags and press specs, and every
``python -m studies.NAME`` and ``python benchmarks/NAME.py`` they name exists: a dry run of the docs' commands (none
is executed). Pre-registrations are records of what was decided when, and are not checked."""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import shlex

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = ["README.md", "RESULTS.md"] + sorted(
    os.path.relpath(f, ROOT) for f in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)
    if not os.path.basename(f).startswith("preregistration-"))
PREFIXES = ("kvpress-phase ", "python -m studies.", "python benchmarks/")


def doc_commands(text: str) -> list[str]:
    """The commands of ``text``'s fenced bash blocks that start with :data:`PREFIXES`, as the shell would run them:
    line continuations joined, comments dropped, ``&&`` chains split, and the block's own ``NAME="..."`` variables
    expanded. A command that still holds a ``$`` (a variable set elsewhere or by a loop) or ``...`` is left out."""
    out = []
    for block in re.findall(r"```(?:bash|sh)\n(.*?)```", text, re.S):
        block = block.replace("\\\n", "")
        env = {m.group(1): " ".join(m.group(2).split()) for m in re.finditer(r'^(\w+)="([^"]*)"', block, re.M)}
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line)
            for part in line.split("&&"):
                part = part.strip()
                for name, value in sorted(env.items(), key=lambda kv: -len(kv[0])):
                    part = part.replace("$" + name, value)
                if part.startswith(PREFIXES) and "$" not in part and "..." not in part:
                    out.append(part)
    return out


def _commands():
    found = []
    for name in FILES:
        with open(os.path.join(ROOT, name), encoding="utf-8") as fh:
            found += [(name, command) for command in doc_commands(fh.read())]
    return found


COMMANDS = _commands()


def test_the_docs_have_commands_to_check():
    assert sum(c.startswith("kvpress-phase ") for _, c in COMMANDS) >= 10


def test_doc_commands_extraction_follows_the_shell():
    text = ('```bash\nP="a,\\\nb"\nkvpress-phase eval --presses $P --x 1 \\\n  --y 2  # note\n'
            'for L in 8; do kvpress-phase eval --strides $L; done\nkvpress-phase eval ... # elided\n```\n')
    assert doc_commands(text) == ["kvpress-phase eval --presses a,b --x 1   --y 2"]


@pytest.mark.parametrize("where,command", COMMANDS, ids=[f"{w}:{i}" for i, (w, _) in enumerate(COMMANDS)])
def test_a_documented_command_parses(where, command):
    argv = shlex.split(command)
    if argv[0] == "kvpress-phase":
        from kvpress_phase.cli import build_parser
        from kvpress_phase.evaluation.presses import parse_press_spec

        args = build_parser().parse_args(argv[1:])  # UsageError (a failing test) for a flag or value that is gone
        for spec in getattr(args, "presses", None) or []:
            parse_press_spec(spec)
    elif argv[:2] == ["python", "-m"]:
        assert importlib.util.find_spec(argv[2]) is not None, f"{where}: no module {argv[2]}"
    else:
        assert os.path.isfile(os.path.join(ROOT, argv[1])), f"{where}: no file {argv[1]}"
