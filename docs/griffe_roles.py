"""griffe extension for the API reference: the docstrings' Sphinx roles (``:class:`Task```,
``:func:`diagnose```) become plain code spans, so the rendered pages show no raw markup."""
from __future__ import annotations

import re
from typing import Any

from griffe import Extension

_ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|exc|obj|py:\w+):`~?([^`]+)`")


class SphinxRoles(Extension):
    """Rewrite ``:role:`name``` to ```name``` in every docstring as it is loaded."""

    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(r"`\1`", obj.docstring.value)
