"""A griffe extension for the Python API reference (mkdocs.yml, mkdocstrings' ``extensions``): Keel's docstrings
name other objects with Sphinx roles (``:class:`~agents.client.Client```, ``:func:`load```), which Markdown would
show as they are written. Each becomes inline code naming the object (its last part, with ``~``)."""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|func|meth|data|attr|mod|exc|obj):`(~?)([^`]+)`")


def _code(found: re.Match[str]) -> str:
    short, target = found.groups()
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


class SphinxRoles(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(_code, obj.docstring.value)
