"""A griffe extension for the API reference (mkdocs.yml, mkdocstrings options).

jaxckpt's docstrings are Google style and title their doctest blocks ``Example:``.
griffe knows only the plural, ``Examples:``, as the section whose ``>>>`` lines are
rendered as Python code; the singular would become an admonition whose ``>>>`` lines
are read as Markdown (nested quotes, and ``x["a"][0]`` taken for a link). This maps
the one title onto the other before the docstrings are parsed, so the docstrings
stay as they are.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
