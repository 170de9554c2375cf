"""docs/cli.md holds the command-line reference as the code prints it, so that it reads on the
repository's web view as on the docs site."""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_the_committed_reference_is_what_the_code_prints() -> None:
    sys.path.insert(0, str(DOCS / "hooks"))
    from generated import CLI_PAGE, with_reference

    page = CLI_PAGE.read_text()
    assert page == with_reference(page), (
        "docs/cli.md is stale: run `python docs/hooks/generated.py` and commit it"
    )
