"""mkdocs hook: tables that come from the code, so the reference cannot drift from it.

``<!-- optimizers -->`` becomes the table of every PS optimizer and its hyperparameters with
defaults (``ps.config.OPTIMIZER_DEFAULTS``); ``<!-- initializers -->`` the same for initializers.
"""
from __future__ import annotations

from typing import Any


def _table(title: str, rows: dict[str, dict[str, float]]) -> str:
    lines = [f"| {title} | hyperparameters (default) |", "| --- | --- |"]
    for name, params in rows.items():
        ps = ", ".join(f"`{k}={v:g}`" for k, v in params.items()) or "-"
        lines.append(f"| `{name}` | {ps} |")
    return "\n".join(lines)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """Replace the placeholders with tables built from ``ps.config``."""
    if "<!-- optimizers -->" in markdown or "<!-- initializers -->" in markdown:
        from ps.config import INITIALIZER_DEFAULTS, OPTIMIZER_DEFAULTS

        markdown = markdown.replace("<!-- optimizers -->", _table("optimizer", OPTIMIZER_DEFAULTS))
        markdown = markdown.replace("<!-- initializers -->", _table("init", INITIALIZER_DEFAULTS))
    return markdown
