"""One version, in trainer/version.py: pyproject.toml reads it, the installed package reports
it, CHANGELOG.md's newest release names it, and every command answers `--version` with it."""

from __future__ import annotations

import importlib.metadata
import re
import runpy
import sys

import pytest

from tests.conftest import REPO
from trainer.version import __version__

COMMANDS = ("train", "evaluate", "plan", "certify", "compare", "report", "preview", "lighthouse")


def test_the_version_has_one_place() -> None:
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11 reads TOML")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "trainer.version.__version__"
    assert importlib.metadata.version("cumulus") == __version__  # as `make setup` installed it
    releases = re.findall(
        r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d\d-\d\d$", (REPO / "CHANGELOG.md").read_text(), re.M
    )
    assert releases and releases[0] == __version__, f"CHANGELOG.md's newest release: {releases[:1]}"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_answers_version(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`python -m trainer.COMMAND --version`, run as `-m` runs it (its `__main__` block), in
    this process: one line naming the version, exit 0, before anything else is parsed (the
    other arguments would be refused)."""
    monkeypatch.setattr(sys, "argv", [f"trainer/{command}.py", "--version", "no.such_key=1"])
    # As `-m` finds it: not yet imported (another test may have), so runpy runs it afresh.
    monkeypatch.delitem(sys.modules, f"trainer.{command}", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module(f"trainer.{command}", run_name="__main__", alter_sys=False)
    assert exit_info.value.code in (0, None)
    assert capsys.readouterr().out == f"cumulus {__version__} (python -m trainer.{command})\n"
