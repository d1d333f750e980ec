"""Sphinx configuration: Markdown pages (MyST), API reference from the docstrings (autodoc)."""

from __future__ import annotations

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import muonfn  # noqa: E402

project = "muonfn"
release = muonfn.__version__
copyright = "the muonfn authors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = f"muonfn {release}"
html_static_path: list[str] = []


def _plain_results_links(app: object, relative_path: pathlib.Path, parent_docname: str, content: list[str]) -> None:
    """benchmarks/RESULTS.md links its JSON files, which are not pages of this site: cite them as paths."""
    if relative_path.name == "RESULTS.md":
        content[0] = re.sub(r"\[[^\]]+\]\((results/[^)\s]+)\)", r"`benchmarks/\1`", content[0])


def setup(app: object) -> None:
    app.connect("include-read", _plain_results_links)  # type: ignore[attr-defined]
