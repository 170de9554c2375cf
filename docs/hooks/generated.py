"""mkdocs hooks: the command-line reference (docs/cli.md) is generated from the parser itself, so
every flag, key, default and choice in the docs is the one the code has; the home page is the
README, its links made relative to docs/."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

MARKER = "<!-- generated: cli reference -->"
README = "<!-- generated: README -->"


def _reference() -> str:
    import os

    os.environ["COLUMNS"] = "100"  # argparse wraps help at the terminal's width
    from bigbatch.cli.main import COMMANDS, _subparser, build_parser

    parser = build_parser()
    parts = ["## bigbatch", "", "```text", parser.format_help().rstrip(), "```", ""]
    for name in COMMANDS:
        parts += [f"## bigbatch {name}", "", "```text"]
        parts += [_subparser(parser, name).format_help().rstrip(), "```", ""]
    return "\n".join(parts)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, _reference())
    if README in markdown:
        text = (Path(__file__).parents[2] / "README.md").read_text()
        # The README names pages as paths (a package index cannot follow relative links);
        # here they are links.
        text = re.sub(r"`docs/([a-z_]+)\.md`", r"[\1](\1.md)", text)
        return markdown.replace(README, text)
    return markdown
