"""The documentation site (mkdocs.yml, docs/, scripts/docs_site.py): the config-key reference
names every key of the schema and every option of configs/, and `mkdocs build --strict` passes
with no network resource in the built pages."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
import time
from pathlib import Path

import pytest

from scripts import docs_site
from tests.conftest import REPO
from tests.ranks import explain, launch


def schema_keys() -> list[str]:
    """Every dotted key of the schema, walked here from the dataclasses (not by the generator):
    the sections' keys, nested sections' keys, and the group keys the trainer reads itself."""
    from trainer.config.schema import EXTRAS, Config

    def walk(cls: type, prefix: str) -> list[str]:
        keys = []
        for f in dataclasses.fields(cls):
            default = f.default_factory() if callable(f.default_factory) else f.default
            if dataclasses.is_dataclass(default):
                keys += walk(type(default), f"{prefix}{f.name}.")
            else:
                keys.append(f"{prefix}{f.name}")
        return keys

    keys = walk(Config, "")
    for group, cls in EXTRAS.items():
        keys += walk(cls, f"{group}.")
    return keys


@pytest.fixture(scope="module")
def reference() -> str:
    return docs_site.config_reference()


def key_rows(page: str) -> dict[str, str]:
    """`key -> meaning` of the page's key tables (first cell a key in backticks)."""
    rows = {}
    for line in page.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if cells and re.fullmatch(r"`[\w.@/-]+`", cells[0]):
            rows.setdefault(cells[0].strip("`"), cells[-1])
    return rows


def test_reference_names_every_schema_key_with_its_meaning(reference: str) -> None:
    """Each key of trainer/config/schema.py has a row in the generated reference, and the row
    says what the key means (the comment at the field in the schema)."""
    keys = schema_keys()
    assert len(keys) > 80 and "train.log_every" in keys and "logger.mlflow.experiment" in keys
    rows = key_rows(reference)
    missing = [k for k in keys if k not in rows]
    assert not missing, f"keys of the schema missing from the reference: {missing}"
    unexplained = [k for k in keys if rows[k] in ("", "—")]
    assert not unexplained, (
        f"keys with no comment in trainer/config/schema.py (the reference shows none): "
        f"{unexplained}"
    )


def test_reference_names_every_config_option(reference: str) -> None:
    """Each file of configs/GROUP/ is an option `GROUP=NAME` of the reference, with its leading
    comment and its keys."""
    options = sorted(p for p in (REPO / "configs").glob("*/*.yaml"))
    assert len(options) > 40
    for path in options:
        group, name = path.parent.name, path.stem
        assert f"#### `{group}={name}`" in reference, f"{group}={name} not in the reference"
    llama = reference.split("#### `model=hf_llama`", 1)[1].split("####", 1)[0]
    assert "transformers Llama" in llama  # the file's leading comment
    assert "| `model.config.num_key_value_heads` | `2` |" in llama
    dpo = reference.split("#### `task=dpo`", 1)[1].split("####", 1)[0]
    assert "simpo's target margin" in dpo  # a key's trailing comment
    digits = reference.split("#### `experiment=digits`", 1)[1].split("####", 1)[0]
    assert "| `train.global_batch_size` | `64` |" in digits  # a _global_ package: root keys


def test_field_comments_read_above_and_after_the_field() -> None:
    source = (
        "class A:\n"
        "    # Line one\n"
        "    # line two.\n"
        "    x: int = 1  # trailing\n"
        "\n"
        "    y: str = '#'\n"
        "    z: int = 2  # only trailing\n"
    )
    assert docs_site.field_comments(source) == {
        ("A", "x"): "Line one line two. trailing",
        ("A", "y"): "",
        ("A", "z"): "only trailing",
    }


@pytest.mark.launches
@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
    reason="the docs extra is not installed (make setup installs it): pip install -e '.[docs]'",
)
def test_site_builds_strict_and_offline(tmp_path: Path) -> None:
    """`mkdocs build --strict` (what `make docs` runs): no broken link or anchor, no page
    missing from the navigation; no page loads a script, a
    style sheet or a font from the network; search's index inlined for file://."""
    site = tmp_path / "site"
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)]
    start = time.monotonic()
    proc = launch(cmd, 300, real=True, NO_MKDOCS_2_WARNING="1")
    seconds = time.monotonic() - start
    assert proc.returncode == 0, explain(proc)
    assert "WARNING" not in proc.stderr, proc.stderr[-4000:]
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 30
    for page in pages:
        html = page.read_text()
        remote = re.findall(r"<(?:script|link|img)[^>]+(?:src|href)=\"(https?://[^\"]+)", html)
        assert not remote, f"{page.relative_to(site)} loads {remote} from the network"
    config = (site / "reference" / "config.html").read_text()
    assert "train.log_every" in config and "model=hf_llama" in config
    assert (site / "search" / "search_index.js").stat().st_size > 10_000
    print(f"mkdocs build --strict: {seconds:.1f} s, {len(pages)} pages")


def test_pictures_drawn_from_the_code_are_the_committed_ones() -> None:
    """docs/images/layout.svg is the rank layout as engine/parallel/dims.py's mesh order gives
    it (scripts/docs_pictures.py redraws it), and the guides show their pictures."""
    from scripts import docs_pictures

    committed = (REPO / "docs" / "images" / "layout.svg").read_text()
    assert committed == docs_pictures.layout_svg(docs_pictures.LAYOUT)
    grid = docs_pictures.rank_grid({"pp": 2, "dp": 2, "cp": 2, "tp": 2})
    assert grid[0, 0, 0].tolist() == [0, 1] and grid[1, 0, 0, 0] == 8  # tp innermost, pp outer
    pictures = {
        "guides/parallelism.md": "../images/layout.svg",
        "guides/planning.md": "../images/plan.svg",
        "guides/seeing-runs.md": "../report.png",
    }
    for page, picture in pictures.items():
        assert f"]({picture})" in (REPO / "docs" / page).read_text(), page
        assert (REPO / "docs" / page).parent.joinpath(picture).resolve().is_file(), picture
