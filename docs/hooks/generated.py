"""mkdocs hooks: the command-line reference (docs/cli.md) is generated from the parser itself, so
every flag, key, default and choice in the docs is the one the code has; the home page is the
README, its links made relative to docs/.

docs/cli.md also keeps the generated text itself, between the markers, so that it reads on the
repository's web view too; `python docs/hooks/generated.py` writes it again after a change
(tests/test_docs_cli.py fails while it is stale)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

MARKER = "<!-- generated: cli reference -->"
END = "<!-- end of the generated reference -->"
CLI_PAGE = Path(__file__).parents[1] / "cli.md"
README = "<!-- generated: README -->"
# docs/plugins.md shows the files `bigbatch new-task tags` writes, from the templates themselves.
TASK_PACKAGE = "<!-- generated: task package -->"


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


def with_reference(markdown: str) -> str:
    """The page with the reference between its markers made anew."""
    head, _, rest = markdown.partition(MARKER)
    _, _, tail = rest.partition(END)
    return f"{head}{MARKER}\n\n{_reference()}\n{END}{tail}"


def task_package_files(name: str = "tags") -> str:
    """The files ``bigbatch new-task NAME`` writes, each under its path, as Markdown.

    >>> "### `pyproject.toml`" in task_package_files()
    True
    """
    from bigbatch.train.scaffold import task_package

    languages = {".py": "python", ".toml": "toml", ".md": "markdown"}
    parts = []
    for path, text in task_package(name).items():
        language = languages.get(Path(path).suffix, "text")
        parts += [f"### `{path}`", "", f"```{language}", text.rstrip(), "```", ""]
    return "\n".join(parts)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if MARKER in markdown:
        return with_reference(markdown)
    if TASK_PACKAGE in markdown:
        return markdown.replace(TASK_PACKAGE, task_package_files())
    if README in markdown:
        text = (Path(__file__).parents[2] / "README.md").read_text()
        # The README names pages as paths (a package index cannot follow relative links);
        # here they are links.
        text = re.sub(r"`docs/([a-z_]+)\.md`", r"[\1](\1.md)", text)
        return markdown.replace(README, text)
    return markdown


if __name__ == "__main__":
    CLI_PAGE.write_text(with_reference(CLI_PAGE.read_text()))
    print(f"wrote {CLI_PAGE}")
