"""Small things that erode trust (issue 40, item 9): the README's links, figures
stated twice that must agree, a NOTE where it does not apply, and a refusal that says what
would fit."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.ranks import explain, launch, run_cli, run_torchrun

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


def test_readme_is_one_screenful_whose_links_land() -> None:
    """The README says what cumulus is and how to start in at most 150 lines (issue 69; it had
    1,936), its first two commands are `make train` and `make test` (CONTRACT), and every link
    of it lands on a file of the repository, at a heading that exists."""
    assert len(README.splitlines()) <= 150, len(README.splitlines())
    commands = re.findall(r"^(make \w+)", README, flags=re.M)
    assert commands[:2] == ["make train", "make test"], commands
    links = re.findall(r"\]\(([^)\s]+)\)", README)
    assert len(links) > 30, links
    for link in links:
        if re.match(r"https?://", link):
            continue
        path, _, anchor = link.partition("#")
        target = REPO / path
        assert path and target.is_file(), f"README links {link}: no such file"
        if anchor:
            titles = [t for _, t in headings(target.read_text())]
            assert anchor in {github_anchor(t) for t in titles}, f"README links {link}"


def test_digits_accuracy_is_stated_alike() -> None:
    """The experiment's own comment and the commands reference give the same validation
    accuracy (98.9% measured at step 300; tests/test_digits.py asserts >= 95%)."""
    yaml = (REPO / "configs" / "experiment" / "digits.yaml").read_text()
    (in_yaml,) = set(re.findall(r"~(\d+)% validation accuracy", yaml))
    commands = (REPO / "docs" / "reference" / "commands.md").read_text()
    (row,) = [ln for ln in commands.splitlines() if ln.startswith("| `experiment=digits`")]
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


# Composes a mixture's config and validates it (every `__post_init__`, moe.balance's among
# them), has a bad moe.balance refused, and prints `--help`: none of it may import torch
# (issue 65, item 13: `--help` took 1.8 s, up from 0.78 s, for torch's import alone).
CONFIG_WITHOUT_TORCH = """
import runpy, sys
from omegaconf import OmegaConf
from trainer.config.cli import compose_train, to_config
from trainer.config.errors import UserError
OmegaConf.to_object(compose_train(["model.moe.experts=4", "moe.balance=micro"]))
try:
    to_config(compose_train(["model.moe.experts=4", "moe.balance=perlayer"]))
    raise SystemExit("moe.balance=perlayer was accepted")
except UserError as exc:
    assert "moe.balance" in str(exc), exc
sys.argv = ["trainer.train", "--help"]
try:
    runpy.run_module("trainer.train", run_name="__main__")
except SystemExit as exc:
    assert not exc.code, exc.code
print("torch imported:", "torch" in sys.modules)
"""


@pytest.mark.launches
def test_the_config_layer_answers_without_torch() -> None:
    """A fresh interpreter (the warm ranks have torch already): composing and validating a
    config, refusing one and `--help` leave torch unimported."""
    proc = launch([sys.executable, "-c", CONFIG_WITHOUT_TORCH], 120.0)
    assert proc.returncode == 0, explain(proc)
    assert proc.stdout.strip().splitlines()[-1] == "torch imported: False", explain(proc)
