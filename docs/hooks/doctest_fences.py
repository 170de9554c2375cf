"""griffe extension for the API reference: the docstrings' doctest examples (``>>>`` lines and
their output) become ``pycon`` code blocks; left as text, Markdown reads ``>`` as quotes and
``x[0]`` as a link."""

from __future__ import annotations

from typing import Any

import griffe


def fence_doctests(text: str) -> str:
    """Wrap each run of ``>>>``/``...`` lines and the output after them in a fenced block.

    >>> fence_doctests("Use it:\\n\\n>>> 1 + 1\\n2\\n\\nMore.")
    'Use it:\\n\\n```pycon\\n>>> 1 + 1\\n2\\n```\\n\\nMore.'
    """
    out: list[str] = []
    inside = False
    for line in text.split("\n"):
        stripped = line.strip()
        starts = stripped.startswith((">>>", "..."))
        if starts and not inside:
            out.append("```pycon")
            inside = True
        elif inside and not stripped:
            out.append("```")
            inside = False
        out.append(line)
    if inside:
        out.append("```")
    return "\n".join(out)


class DoctestFences(griffe.Extension):
    def on_object(self, *, obj: Any, **_: Any) -> None:
        if obj.docstring is not None and ">>>" in obj.docstring.value:
            obj.docstring.value = fence_doctests(obj.docstring.value)
