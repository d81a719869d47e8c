"""cumulus's version, in one place: pyproject.toml reads it (setuptools' dynamic version) and
every command answers `--version` with it. CHANGELOG.md's newest release names it."""

from __future__ import annotations

import sys

__version__ = "0.1.0"


def answer_version(argv: list[str], command: str) -> None:
    """`python -m trainer.COMMAND --version`: print the version and exit 0, before the command
    parses anything else (for trainer.train, Hydra's own `--version` would name Hydra's)."""
    if "--version" in argv:
        print(f"cumulus {__version__} (python -m {command})", flush=True)
        sys.exit(0)
