"""A failing GPU test's report goes to the log as it fails, not at the session's end:
`make gpu-evidence` runs these tests in a time box, and a box that ends the session keeps only
what was printed."""

from __future__ import annotations

from typing import Any


def pytest_runtest_logreport(report: Any) -> None:
    if report.failed:
        print(f"\n[gpu test failed] {report.nodeid} ({report.when}):\n{report.longreprtext}",
              flush=True)  # fmt: skip
