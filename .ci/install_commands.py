"""Print README.md's install commands, one a line: the `pip install` commands of the first fenced bash block of its
"Two commands" section, in order (the block's last command, `kvpress-phase eval`, is the job, not the install).

.ci/run runs exactly these, so CI installs as the README says; tests/test_packaging.py checks what they install.
"""

from __future__ import annotations

import pathlib
import re
import sys

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def install_commands(text: str) -> list[str]:
    """The ``pip install`` commands of the first fenced bash block under ``## Two commands`` in ``text``."""
    _, found, section = text.partition("\n## Two commands\n")
    block = re.search(r"```bash\n(.*?)```", section.split("\n## ", 1)[0], re.S) if found else None
    if block is None:
        raise ValueError("README.md has no fenced bash block under '## Two commands'")
    commands = [c.strip() for line in block.group(1).splitlines() for c in line.split("&&") if c.strip()]
    install = [c for c in commands if c.startswith("pip install ")]
    if not install:
        raise ValueError("the bash block under '## Two commands' in README.md has no `pip install` command")
    return install


if __name__ == "__main__":
    try:
        print("\n".join(install_commands(README.read_text(encoding="utf-8"))))
    except ValueError as exc:
        sys.exit(f"error: {exc}")
