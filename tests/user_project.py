"""The user project of docs/your-model.md, written out of the doc into a folder of its own.

The doc is the single source: every fenced block whose first line is `# <path>.py` or
`# <path>.yaml` is a file of the project; the other blocks are the commands it documents.
Tests select the project's model, task and data on the command line exactly as a user would
(`hydra.searchpath=[file://DIR/my_configs]`, the package on PYTHONPATH), from outside this
repository's package.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import REPO

DOC = REPO / "docs" / "your-model.md"
_FILE = re.compile(r"# ([\w/.]+\.(?:py|yaml))")


def blocks() -> list[tuple[str, str]]:
    """(language, body) of every fenced block of the doc, in order."""
    return re.findall(r"```(\w+)\n(.*?)```", DOC.read_text(), flags=re.S)


def write_project(root: Path) -> Path:
    """Write the doc's files under `root`; returns `root`."""
    written = 0
    for _, body in blocks():
        match = _FILE.fullmatch(body.splitlines()[0])
        if match:
            path = root / match.group(1)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(body)
            written += 1
    assert written >= 4, f"docs/your-model.md lost its project files ({written} found)"
    return root


def commands(language: str) -> list[str]:
    """The doc's blocks in `language` that are not project files (what a user runs)."""
    return [
        b for lang, b in blocks() if lang == language and not _FILE.fullmatch(b.splitlines()[0])
    ]


def select(root: Path) -> list[str]:
    """Overrides that select the project's model, task and data."""
    return [
        f"hydra.searchpath=[file://{root / 'my_configs'}]",
        "model=tagger",
        "task=tagging",
        "data=tagging",
    ]
