"""`python -m agent.extract extract --spec RUN.json` / `python -m agent.extract tiny-model DIR --arch ...`."""

from __future__ import annotations

import sys

from agent.extract.cli import run_extract, run_tiny_model


def main(argv: list[str]) -> int:
    """Dispatch the two sub-commands."""
    commands = {"extract": run_extract, "tiny-model": run_tiny_model}
    if not argv or argv[0] not in commands:
        print("usage: python -m agent.extract {extract --spec RUN.json | tiny-model DIR --arch ARCH}")
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
