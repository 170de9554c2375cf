"""`.ci/check_disk.py`: the venv's install stops up front, with the numbers, when the disk is full."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / ".ci" / "check_disk.py"


def run(need_gib: float, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--need-gib", str(need_gib), "--for", "the venv",
         "--path", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_enough_space_passes_quietly(tmp_path: Path) -> None:
    done = run(0, tmp_path)
    assert done.returncode == 0 and done.stderr == ""


def test_too_little_space_names_the_need_the_free_space_and_the_fix(tmp_path: Path) -> None:
    done = run(10**9, tmp_path)  # an exabyte: no disk here has it
    assert done.returncode == 1
    assert "the venv need about 1e+09 GiB of disk" in done.stderr
    assert "GiB are free under" in done.stderr and "run make again" in done.stderr
