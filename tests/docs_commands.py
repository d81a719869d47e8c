"""The `python -m trainer.*` commands the README and docs/ write, and a check of each against the
real config (tests/test_docs_commands.py).

A command is found in a fenced code block (`bash`, `sh`, `console`, `text` or none; continued
lines joined, comments dropped, `a && b`, `a | b` and `a; b` split) or in an inline code span,
wherever `-m trainer.NAME` appears (`python -m`, `torchrun ... -m`). Placeholders are read as
such: `[training overrides]`, `...` and `<...>` are skipped; `[key=value]` is an optional
override, checked; a value in capitals (`plan.world=W`, `model.pretrained=DIR`) stands for the
user's: only its key is checked.

A marker on one of the two lines above a code block says what its commands are:
`<!-- illustrative -->`: they need files the test lacks (a config folder of the user's, their
own package): a group option that cumulus does not ship, and the keys under it, are dropped;
the rest is composed and validated against the schema, the components' targets are not
imported. `<!-- refused -->` (or ` (refused)` after an inline command): the page shows the
trainer refusing them, and the check must refuse them.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ILLUSTRATIVE = "<!-- illustrative -->"
REFUSED = "<!-- refused -->"  # a block whose commands the page shows being refused
SHELL_BLOCKS = ("", "bash", "sh", "shell", "console", "text")
PLACEHOLDER_VALUE = re.compile(r"^[A-Z][A-Z0-9_]*(?:[./][A-Z0-9_.]*)*/?$|\.\.\.|^<.*>$")


@dataclass(frozen=True)
class DocCommand:
    """One command as a page writes it: where, which module, its arguments."""

    where: str  # FILE:LINE
    module: str  # trainer.train, trainer.evaluate, ...
    args: tuple[str, ...]
    illustrative: bool
    text: str
    refused: bool = False  # the page shows it being refused: it must be

    def __str__(self) -> str:
        mark = " (illustrative)" if self.illustrative else " (refused)" if self.refused else ""
        return f"{self.where}{mark}: {self.text}"


def _blocks(text: str) -> list[tuple[int, str, str, str]]:
    """(line, language, body, marker) of every fenced code block; the marker is the comment
    on one of the two lines above it (`<!-- illustrative -->`, `<!-- refused -->`) or ""."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        match = re.match(r"^(\s*)```(\w*)", lines[i])
        if not match:
            i += 1
            continue
        start, lang, indent = i, match[2], match[1]
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith("```"):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        above = " ".join(lines[max(0, start - 2) : start])
        marker = next((m for m in (ILLUSTRATIVE, REFUSED) if m in above), "")
        blocks.append((start + 1, lang, "\n".join(body), marker))
        i += 1
    return blocks


def _shell_commands(body: str) -> list[tuple[int, str]]:
    """(line offset, command) of a shell block: continuations joined, split at && | ;."""
    out, pending, first = [], "", 0
    for n, line in enumerate(body.splitlines()):
        if not pending:
            first = n
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((first, pending + line))
        pending = ""
    if pending:
        out.append((first, pending))
    commands = []
    for n, line in out:
        for part in re.split(r"\s(?:&&|\|\||\||;)\s", line):
            commands.append((n, part))
    return commands


def parse_command(text: str) -> tuple[str, list[str]] | None:
    """(module, arguments) of a command that runs `-m trainer.NAME`, else None."""
    if "-m trainer." not in text:
        return None
    try:
        words = shlex.split(text, comments=True)
    except ValueError:  # an unclosed quote: prose, not a command
        return None
    for i, word in enumerate(words[:-1]):
        if word == "-m" and words[i + 1].startswith("trainer."):
            return words[i + 1], words[i + 2 :]
    return None


def commands_in(text: str, name: str) -> list[DocCommand]:
    """Every `-m trainer.*` command of a Markdown page's text (`name`: the page, for messages)."""
    found = []
    spans = set()
    for line, lang, body, marker in _blocks(text):
        spans.update(range(line, line + body.count("\n") + 2))
        if lang not in SHELL_BLOCKS:
            continue
        for offset, command in _shell_commands(body):
            parsed = parse_command(command)
            if parsed:
                where = f"{name}:{line + 1 + offset}"
                args = tuple(parsed[1])
                illustrative, refused = marker == ILLUSTRATIVE, marker == REFUSED
                found.append(
                    DocCommand(where, parsed[0], args, illustrative, command.strip(), refused)
                )
    for n, line_text in enumerate(text.splitlines(), 1):
        if n in spans:
            continue
        for span, after in re.findall(r"`([^`]*-m trainer\.[^`]*)`( \(refused\))?", line_text):
            parsed = parse_command(span)
            if parsed and parsed[1]:  # a command line, not the command's name in a sentence
                args = tuple(parsed[1])
                found.append(DocCommand(f"{name}:{n}", parsed[0], args, False, span, bool(after)))
    return [c for c in found if re.fullmatch(r"trainer\.\w+", c.module)]


def documented_commands(repo: Path) -> list[DocCommand]:
    """The commands of README.md and every page under docs/."""
    pages = [repo / "README.md", *sorted((repo / "docs").rglob("*.md"))]
    found = []
    for page in pages:
        found += commands_in(page.read_text(), str(page.relative_to(repo)))
    return found


# --- reading the arguments ------------------------------------------------------------------


def is_placeholder(word: str) -> bool:
    """`[training overrides]`-like words, `...`, `<...>`, `ARGS`: the user's, not a value."""
    return (
        word in ("...", "[...]", "[overrides]", "key=value")
        or word.startswith("<")
        or ("=" not in word and not word.startswith("-"))
    )


def overrides_of(args: list[str]) -> list[str]:
    """The `key=value` words of a command: optional `[key=value]` unwrapped, placeholders
    dropped, a group list `[a,b]` value kept."""
    out = []
    for word in args:
        if word.startswith("[") and word.endswith("]") and "=" in word:
            word = word[1:-1]
        if word.startswith("[") and not word.endswith("]"):
            continue  # `[training` of `[training overrides]` split by a space
        if word.endswith("]") and "=" not in word:
            continue
        if is_placeholder(word):
            continue
        out.append(word)
    return out


# --- checking a command against the real config ---------------------------------------------

FLAGS = ("--help", "-h", "--version")  # what every trainer command answers
ARGPARSE_COMMANDS = ("trainer.compare", "trainer.report", "trainer.lighthouse")


def _split_selection(
    overrides: list[str], config_dir: Path
) -> tuple[list[str], list[str], list[str]]:
    """(checked, key-only, user's): overrides to check and compose; those whose value is a
    placeholder (only their key is checked); selections of a group option cumulus does not
    ship (a folder of the user's), with the keys under that group."""
    checked, key_only, users = [], [], []
    for word in overrides:
        key, _, value = word.partition("=")
        bare = key.lstrip("+~")
        if PLACEHOLDER_VALUE.search(value):
            key_only.append(bare)
            continue
        group = bare.split(".")[0]
        shipped = [p.stem for p in (config_dir / group).glob("*.yaml")]
        is_group = (config_dir / group).is_dir() and "." not in bare
        names = value.strip("[]").split(",") if is_group else []
        if is_group and value not in ("null", "") and any(n.strip() not in shipped for n in names):
            users.append(group)
        checked.append(word)
    user_keys = [
        w
        for w in checked
        if w.partition("=")[0].lstrip("+~").split(".")[0] in users
        or w.startswith("hydra.searchpath=")
    ]
    return [w for w in checked if w not in user_keys], key_only, user_keys


def check_overrides_composed(words: list[str], illustrative: bool, compose: Any) -> None:
    """The overrides as `python -m trainer.train` takes them: the command line's checks
    (unknown keys, ill-typed values, config names found nowhere), Hydra's compose, and the
    schema's validation of the composed config (and, unless illustrative, every component's
    target imported and its arguments fitted to its signature). Raises on the first problem."""
    from omegaconf import OmegaConf

    from trainer.config import cli
    from trainer.config.errors import ConfigError
    from trainer.run.assemble import CONFIG_DIR

    flags = [w for w in words if w.startswith("-")]
    unknown = [f for f in flags if f not in FLAGS]
    if unknown:
        raise ConfigError(unknown[0], f"not a flag the trainer's commands take ({FLAGS})")
    overrides = [w for w in overrides_of(words) if not w.startswith("-")]
    checked, key_only, users = _split_selection(overrides, CONFIG_DIR)
    if users and not illustrative:
        checked += users  # a config name found nowhere fails below, as it would for a user
        users = []
    for key in key_only:
        group = CONFIG_DIR / key.split(".")[0]
        if "." not in key and group.is_dir():
            continue
        error = cli.unknown_key(key.split("."))
        if error is not None and key.split(".")[0] != "hydra":
            raise error
    cli.check_overrides(checked, CONFIG_DIR)
    cfg = compose(checked)
    if illustrative:
        cli._check_composed(cfg)
        OmegaConf.to_object(cfg)  # every section's __post_init__
    else:
        cli.to_config(cfg)


def check_command(command: DocCommand, compose: Any) -> None:
    """Raise if `command` would be refused before any work: its own arguments (a command's
    `certify.*`, `checkpoint=`...), then the training overrides it passes on."""
    import importlib.util

    from trainer.config.errors import ConfigError

    module, args = command.module, list(command.args)
    if importlib.util.find_spec(module) is None:
        raise ConfigError(module, "no such command")
    if any(a in FLAGS for a in args):
        return  # --help / --version: answered before anything is read
    if module in ARGPARSE_COMMANDS:
        parser = importlib.import_module(module).parse_args  # type: ignore[attr-defined]
        # `[--atol 1e-5]`, `[--keys GLOB ...]`: optional arguments, checked.
        words = [w.removeprefix("[").removesuffix("]") for w in args]
        try:
            parser([w for w in words if w and w != "..."])
        except SystemExit as exc:
            raise ConfigError(module, f"its arguments are refused: {args}") from exc
        return
    if module == "trainer.evaluate":
        from trainer.evaluate import parse_args

        *_, args = parse_args(overrides_of(args))
    elif module == "trainer.certify":
        from trainer.checks.certify import parse

        _, args = parse(overrides_of(args))
    elif module == "trainer.preview":
        from trainer.preview import parse

        _, args = parse(overrides_of(args))
    elif module not in ("trainer.train", "trainer.plan"):
        raise ConfigError(module, "a command this checker does not know: teach it its arguments")
    check_overrides_composed(args, command.illustrative, compose)
