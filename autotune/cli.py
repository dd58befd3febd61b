"""The ``autotune`` command line: ``main(argv) -> int``."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    print("autotune: the report command is not available yet", file=sys.stderr)
    return 2
