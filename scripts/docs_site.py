"""What the documentation site generates at build time (mkdocs.yml's hook, scripts/docs_hooks.py),
so that it cannot go stale:

- the config-key reference, from trainer/config/schema.py (every section's keys with their
  types, defaults and the comments that explain them) and configs/ (every group, its options
  with their leading comment and keys);
- GitHub's escaped pipes in tables' code spans, read as Python-Markdown reads them.

Plain functions of the repository's files: tests/test_docs_site.py calls them without MkDocs.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SCHEMA = REPO / "trainer" / "config" / "schema.py"
CONFIGS = REPO / "configs"
CONFIG_PAGE = "reference/config.md"


# --- the schema's comments ------------------------------------------------------------------


def class_docs(source: str) -> dict[str, str]:
    """`class -> docstring` (one paragraph) of the classes in `source` that have one
    (a dataclass without one has `__doc__` made up from its signature)."""
    return {
        node.name: " ".join((ast.get_docstring(node) or "").split())
        for node in ast.parse(source).body
        if isinstance(node, ast.ClassDef) and ast.get_docstring(node)
    }


def field_comments(source: str) -> dict[tuple[str, str], str]:
    """`(class, field) -> comment` of every dataclass field in `source`: the comment lines
    directly above the field, then its trailing comment, as one sentence each."""
    lines = source.splitlines()
    trailing = {
        tok.start[0]: tok.string.lstrip("#").strip()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT and lines[tok.start[0] - 1].strip() != tok.string
    }
    comments: dict[tuple[str, str], str] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            above: list[str] = []
            row = stmt.lineno - 2
            while row >= 0 and lines[row].strip().startswith("#"):
                above.insert(0, lines[row].strip().lstrip("#").strip())
                row -= 1
            parts = [" ".join(above), trailing.get(stmt.lineno, "")]
            comments[(node.name, stmt.target.id)] = " ".join(p for p in parts if p)
    return comments


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


RANDOM_INIT_MARK = "${random_init:"
RANDOM_INIT_NOTE = "(random init only: beside `model.pretrained`, the directory's own value)"


def yaml_text(value: Any) -> str:
    """A value as a user writes it on the command line (`null`, `true`, `[3, 4]`)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | tuple):
        return "[" + ", ".join(yaml_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_text(v)}" for k, v in value.items()) + "}"
    return str(value)


def random_init_value(text: str) -> str | None:
    """`${random_init:V}` (trainer/config/pretrained.py) written in a config file: V, a default
    for random init only; None for any other value."""
    if text.startswith(RANDOM_INIT_MARK) and text.endswith("}"):
        return text[len(RANDOM_INIT_MARK) : -1]
    return None


def cell(text: str) -> str:
    """Prose safe inside a Markdown table cell: its pipes escaped outside code spans (inside
    them, the table reads a pipe as text)."""
    parts = text.replace("\n", " ").split("`")
    return "`".join(p if i % 2 else p.replace("|", "\\|") for i, p in enumerate(parts))


@dataclass(frozen=True)
class Key:
    """One key of the schema: its dotted name, type, default and meaning."""

    name: str
    type: str
    default: str
    meaning: str


@dataclass(frozen=True)
class Section:
    """One dataclass of the schema, at its dotted place (`train`, `logger.mlflow`)."""

    name: str
    doc: str
    keys: tuple[Key, ...]


def schema_sections() -> tuple[list[Key], list[Section]]:
    """The root's own keys and every section of the schema (the `Config` dataclass, its
    nested dataclasses, and the keys of the `model`, `data`, `task` groups that the trainer
    reads itself), in the schema's order."""
    from trainer.config.schema import EXTRAS, Config

    source = SCHEMA.read_text()
    comments, docs = field_comments(source), class_docs(source)
    sections: list[Section] = []

    def keys_of(cls: type, prefix: str) -> list[Key]:
        keys = []
        for f in dataclasses.fields(cls):
            name = f"{prefix}{f.name}"
            default = _default(f)
            if dataclasses.is_dataclass(default):
                walk(type(default), name)
                continue
            meaning = comments.get((cls.__name__, f.name), "")
            keys.append(Key(name, str(f.type), yaml_text(_plain(default)), meaning))
        return keys

    def walk(cls: type, name: str, doc: str = "") -> None:
        index = len(sections)  # the section before the sections nested in it
        keys = keys_of(cls, f"{name}.")
        sections.insert(index, Section(name, docs.get(cls.__name__, doc), tuple(keys)))

    root = keys_of(Config, "")
    for group, cls in EXTRAS.items():
        walk(cls, group, EXTRAS_DOC.format(group=group))
    return root, sections


EXTRAS_DOC = (
    "The keys of the `{group}` group that the trainer reads itself, whichever option is "
    "selected; every other key of the group is an argument of its `_target_`, checked against "
    "the target's signature (see the group's options below)."
)


def _plain(value: Any) -> Any:
    """OmegaConf nodes (a component's default) as plain containers."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(value, DictConfig | ListConfig):
        return OmegaConf.to_container(value)
    return value


# --- configs/ -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Option:
    """One file of a config group: `model=gpt_tiny`."""

    group: str
    name: str
    comment: str  # the leading comment, Markdown
    keys: tuple[tuple[str, str, str], ...]  # (dotted key, value as written, comment)


def _comment_markdown(lines: list[str]) -> str:
    """A leading comment as Markdown: prose lines joined, `#   command` lines (indented after
    the hash) as a code block."""
    out: list[str] = []
    code: list[str] = []
    prose: list[str] = []

    def flush() -> None:
        if prose:
            out.append(" ".join(prose))
            prose.clear()
        if code:
            out.append("```bash\n" + "\n".join(code) + "\n```")
            code.clear()

    for line in lines:
        text = line[1:]
        if text.startswith("   ") and text.strip():
            if prose:
                flush()
            code.append(text.strip())
        else:
            if code:
                flush()
            prose.append(text.strip())
    flush()
    return "\n\n".join(p for p in out if p.strip())


def read_option(path: Path, prefix: str) -> Option:
    """A config file's leading comment and its keys, each with the comment above it or after it
    (`prefix`: where the file's keys land, `model.` or `` for a `# @package _global_` one)."""
    lines = path.read_text().splitlines()
    lead: list[str] = []
    row = 0
    while row < len(lines) and lines[row].startswith("#"):
        if not lines[row].startswith("# @package"):
            lead.append(lines[row])
        row += 1
    if path.parent.name == "experiment" or "# @package _global_" in lines[:1]:
        prefix = ""
    keys: list[tuple[str, str, str]] = []
    stack: list[tuple[int, str]] = []  # (indent, key) of the mappings above a line
    above: list[str] = []
    in_defaults = False
    for line in lines[row:]:
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("#").strip())
            continue
        match = re.match(r"^(\s*)([\w.@/-]+):(?:\s+(.*?))?\s*(?:#\s*(.*))?$", line)
        if not match:
            above = []
            continue
        indent, key, value, trailing = len(match[1]), match[2], match[3] or "", match[4] or ""
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if indent == 0:
            in_defaults = key == "defaults"
        if in_defaults:
            above = []
            continue
        dotted = ".".join([*(k for _, k in stack), key])
        if value:
            meaning = " ".join(p for p in (" ".join(above), trailing) if p)
            if (plain := random_init_value(value)) is not None:
                value = plain
                meaning = " ".join([meaning, RANDOM_INIT_NOTE]).strip()
            keys.append((prefix + dotted, value, meaning))
        else:
            stack.append((indent, key))
        above = []
    return Option(path.parent.name, path.stem, _comment_markdown(lead), tuple(keys))


def group_defaults() -> dict[str, str]:
    """`group -> default option` from configs/train.yaml's defaults list."""
    defaults: dict[str, str] = {}
    for line in (CONFIGS / "train.yaml").read_text().splitlines():
        match = re.match(r"^\s+- (?:optional )?(\w+): (\S+)", line)
        if match and (CONFIGS / match[1]).is_dir():
            defaults[match[1]] = match[2]
    return defaults


def config_groups() -> dict[str, list[Option]]:
    """Every group of configs/ with its options, in name order."""
    return {
        group.name: [read_option(p, f"{group.name}.") for p in sorted(group.glob("*.yaml"))]
        for group in sorted(CONFIGS.iterdir())
        if group.is_dir()
    }


# --- the page -------------------------------------------------------------------------------


def _key_table(keys: tuple[Key, ...] | list[Key]) -> list[str]:
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for k in keys:
        rows.append(f"| `{k.name}` | `{k.type}` | `{k.default}` | {cell(k.meaning) or '—'} |")
    return rows


def _group_link(key: Key, groups: dict[str, list[Option]]) -> str:
    """A root key that is also a config group: its meaning, and where its options are."""
    see = f"A config group: `{key.name}=NAME`, [its options](#group-{key.name})."
    return f"{key.meaning} {see}".strip()


def config_reference() -> str:
    """The config-key reference page (Markdown)."""
    root, sections = schema_sections()
    groups = config_groups()
    defaults = group_defaults()
    out = [
        "# Config keys",
        "",
        "Generated when the site is built, from `trainer/config/schema.py` (the sections, their "
        "keys, types and defaults, and the comments that explain them) and `configs/` (the "
        "groups and their options), so it is the code's own word. Every key is set on the "
        "command line as `key=value` (`python -m trainer.train train.max_steps=100`), a group's "
        "option as `group=name` (`model=gpt_tiny`); unknown keys and ill-typed values fail "
        "before any work, in one paragraph naming the key.",
        "",
        "## Groups and their defaults",
        "",
        "| group | default | options |",
        "| --- | --- | --- |",
    ]
    for group, options in groups.items():
        names = ", ".join(f"[`{o.name}`](#{group}-{o.name})" for o in options)
        default = defaults.get(group, "null")
        out.append(f"| `{group}` | {'—' if default == 'null' else f'`{default}`'} | {names} |")
    root = [
        dataclasses.replace(k, meaning=_group_link(k, groups)) if k.name in groups else k
        for k in root
    ]
    out += ["", "## The root", "", *_key_table(root), ""]
    out += ["Sections of the schema: " + ", ".join(f"`{s.name}`" for s in sections) + ".", ""]
    for section in sections:
        out += [f"## `{section.name}`", ""]
        if section.doc:
            out += [section.doc, ""]
        out += [*_key_table(section.keys), ""]
    out += [
        "## Config groups",
        "",
        "Each option is a file `configs/GROUP/NAME.yaml`; its keys (below) can be overridden "
        "one by one after selecting it. A group option of your own is found once its folder "
        "is joined with `hydra.searchpath=[file://DIR]`.",
        "",
    ]
    for group, options in groups.items():
        out += [f"### `{group}` {{#group-{group}}}", ""]
        for option in options:
            default = " (default)" if defaults.get(group) == option.name else ""
            out += [f"#### `{group}={option.name}`{default} {{#{group}-{option.name}}}", ""]
            if option.comment:
                out += [option.comment, ""]
            if option.keys:
                out += ["| key | value | meaning |", "| --- | --- | --- |"]
                out += [f"| `{k}` | `{v}` | {cell(m) or '—'} |" for k, v, m in option.keys]
                out.append("")
    return "\n".join(out) + "\n"


def table_code_pipes(markdown: str) -> str:
    """GitHub's tables need a pipe inside a code span escaped (`a\\|b`); Python-Markdown's read
    it as text and would show the backslash: unescaped there, in table rows only."""

    def row(line: str) -> str:
        if not line.lstrip().startswith("|"):
            return line
        parts = line.split("`")
        return "`".join(p.replace("\\|", "|") if i % 2 else p for i, p in enumerate(parts))

    return "\n".join(row(line) for line in markdown.split("\n"))
