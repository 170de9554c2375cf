"""What every test of the suite shares, the docstring examples of ``src/`` included.

Temporary files go under pytest's own folder for the run, which it removes when the run passes
and prunes to the last three otherwise. The docstring examples make folders with
``tempfile.mkdtemp()`` as a reader would, wandb makes its own, and the subprocesses (torchrun, the
command line) inherit ``TMPDIR``: left in ``/tmp``, each ``make test`` added about a thousand
folders there.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True, scope="session")
def _temporary_files_in_the_runs_folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    folder = str(tmp_path_factory.mktemp("tempfile"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tempfile, "tempdir", folder)
        patch.setenv("TMPDIR", folder)
        yield
