"""MkDocs hooks (mkdocs.yml `hooks:`): the pages generated from the code when the site is built
(scripts/docs_site.py), so none of them can go stale."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # the generator reads the trainer's schema
    sys.path.insert(0, str(REPO))

from scripts import docs_site  # noqa: E402


def on_files(files: Any, config: Any) -> Any:
    """Add the config-key reference, generated from the schema and configs/."""
    from mkdocs.structure.files import File

    files.append(
        File.generated(config, docs_site.CONFIG_PAGE, content=docs_site.config_reference())
    )
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Read tables' code spans as GitHub writes them (the pages read well on GitHub too)."""
    return docs_site.table_code_pipes(markdown)
