"""Griffe extension for the API reference: doctest lines in docstrings become code blocks.

The docstrings write examples as ``>>>`` lines under an ``Example:`` heading (Google style).
Markdown would read ``>`` as a quotation and ``x["a"]["b"]`` as a link reference; fenced as
``pycon`` they render as the code they are.
"""

from __future__ import annotations

import griffe


def fence_doctests(text: str) -> str:
    """``text`` with every run of doctest lines (``>>>``, ``...`` and their output) fenced."""
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.lstrip()
        if not stripped.startswith(">>>"):
            out.append(line)
            i += 1
            continue
        indent = line[: len(line) - len(stripped)]
        out.append(f"{indent}```pycon")
        while i < len(lines) and lines[i].strip() and lines[i].startswith(indent):
            out.append(lines[i])
            i += 1
        out.append(f"{indent}```")
    return "\n".join(out)


class DoctestBlocks(griffe.Extension):
    """Fences the doctest lines of every docstring before it is parsed."""

    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None and ">>>" in obj.docstring.value:
            obj.docstring.value = fence_doctests(obj.docstring.value)
