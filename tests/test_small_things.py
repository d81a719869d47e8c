"""Small things that erode trust (issue 40, item 9): the README's table of contents, figures
stated twice that must agree, a NOTE where it does not apply, and a refusal that says what
would fit."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.ranks import explain, run_cli, run_torchrun

README = (REPO / "README.md").read_text()


def headings(text: str) -> list[tuple[int, str]]:
    """(level, title) of every `##` and `###` heading outside code blocks."""
    out, code = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            code = not code
        m = None if code else re.match(r"^(#{2,3}) (.+)$", line)
        if m:
            out.append((len(m.group(1)), m.group(2).strip()))
    return out


def github_anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def test_readme_table_of_contents_lists_every_section() -> None:
    """Every section and subsection, in order, each linked to its own anchor."""
    sections = [h for h in headings(README) if h != (2, "Contents")]
    start = README.index("## Contents\n")
    block = README[start:].split("\n\n")[1]
    entries = re.findall(r"^( *)- \[(.+)\]\(#(.+)\)$", block, flags=re.M)
    assert [(2 + len(indent) // 2, title) for indent, title, _ in entries] == sections
    for _, title, anchor in entries:
        assert anchor == github_anchor(title), title


def test_digits_accuracy_is_stated_alike() -> None:
    """The experiment's own comment and the README give the same validation accuracy (98.9%
    measured at step 300; tests/test_digits.py asserts >= 95%)."""
    yaml = (REPO / "configs" / "experiment" / "digits.yaml").read_text()
    (in_yaml,) = set(re.findall(r"~(\d+)% validation accuracy", yaml))
    (row,) = [ln for ln in README.splitlines() if ln.startswith("| `experiment=digits`")]
    (in_readme,) = re.findall(r"~(\d+)% validation accuracy", row)
    assert in_yaml == in_readme


def test_torch_floor_is_stated_alike() -> None:
    """pyproject's torch requirement is the one constraints-cpu.txt and the README name."""
    (floor,) = re.findall(r'^ *"torch>=([\d.]+)"', (REPO / "pyproject.toml").read_text(), re.M)
    constraints = (REPO / "constraints-cpu.txt").read_text()
    assert re.findall(r"torch>=([\d.]+)", constraints) == [floor]
    assert re.findall(r"library itself asks for\s+`torch>=([\d.]+)`", README) == [floor]


@pytest.mark.launches
def test_digits_has_no_note_about_the_default_accumulation(tmp_path: Path) -> None:
    """experiment=digits sets its batch (global 64 = micro 32 x accumulation 2 on one
    process): the NOTE about the default train.grad_accum_steps is not printed."""
    args = ["experiment=digits", "logger=none", "train.max_steps=1", "eval.every_steps=0"]
    proc = run_cli([*args, "checkpoint.every_steps=0", f"hydra.run.dir={tmp_path}"])
    assert proc.returncode == 0, explain(proc)
    assert "micro 32 x accum 2 = global batch 64" in proc.stdout, explain(proc)
    assert "NOTE: accumulation is the default" not in proc.stdout, explain(proc)


@pytest.mark.launches
def test_accumulation_named_on_the_command_line_has_no_note(tmp_path: Path) -> None:
    """train.grad_accum_steps=2 typed by the user (the default's value): no NOTE that the
    accumulation is the default; the same run without it prints the NOTE."""
    args = ["model=gpt_tiny", "logger=none", "train.max_steps=1", "eval.every_steps=0"]
    args += ["checkpoint.every_steps=0"]
    chosen = run_cli([*args, "train.grad_accum_steps=2", f"hydra.run.dir={tmp_path / 'a'}"])
    default = run_cli([*args, f"hydra.run.dir={tmp_path / 'b'}"])
    for proc in (chosen, default):
        assert proc.returncode == 0, explain(proc)
        assert "x accum 2 = global batch" in proc.stdout, explain(proc)
    assert "NOTE: accumulation is the default" not in chosen.stdout, explain(chosen)
    assert "NOTE: accumulation is the default" in default.stdout, explain(default)


@pytest.mark.multiproc
def test_a_pipeline_deeper_than_the_model_says_what_fits(tmp_path: Path) -> None:
    """dist.pp=2 on a one-block GPT: one paragraph naming dist.pp, the model's block count
    and the largest dist.pp that would fit."""
    args = ["model=gpt_tiny", "model.n_layer=1", "dist.pp=2", "logger=none"]
    proc = run_torchrun(2, [*args, "train.max_steps=1", f"hydra.run.dir={tmp_path}"])
    assert proc.returncode != 0, explain(proc)
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error")]
    assert "invalid config `dist.pp`" in line, line
    assert "the model has 1" in line and "largest valid dist.pp is 1" in line, line
