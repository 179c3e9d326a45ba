"""MkDocs hooks of the documentation site (mkdocs.yml ``hooks:``).

The configuration reference page is generated from tierkv's code at every build
(:func:`tierkv.docs_reference.render`) and added to the site's files, so it is never stale
and never committed.
"""

from __future__ import annotations

from typing import Any

from mkdocs.structure.files import File, Files

from tierkv.docs_reference import PAGE, render


def on_files(files: Files, config: Any) -> Files:
    """Add the generated configuration reference to the pages MkDocs builds."""
    files.append(File.generated(config, PAGE, content=render()))
    return files
