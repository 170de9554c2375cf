"""Atomic file writes: a crash or a full disk never leaves a half-written file behind.

Each write goes to a temporary file in the same folder, is flushed to disk, then renamed over
the target in one step; on any error the temporary file is removed and the previous version of
the target stays as it was.
"""

from __future__ import annotations

import contextlib
import csv
import io
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

__all__ = [
    "atomic_path",
    "atomic_write_bytes",
    "atomic_write_csv",
    "atomic_write_figure",
    "atomic_write_text",
]


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path`` atomically.

    >>> import tempfile, pathlib
    >>> target = pathlib.Path(tempfile.mkdtemp()) / "x.txt"
    >>> with atomic_path(target) as tmp:
    ...     _ = tmp.write_text("done")
    >>> target.read_text()
    'done'
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write(path: str | Path, mode: str, writer: Callable[[IO[Any]], Any]) -> None:
    with atomic_path(path) as tmp, open(tmp, mode) as f:
        writer(f)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    _write(path, "wb", lambda f: f.write(data))


def atomic_write_text(path: str | Path, text: str) -> None:
    _write(path, "w", lambda f: f.write(text))


def atomic_write_csv(
    path: str | Path, header: Sequence[str], rows: Iterable[Sequence[Any] | Mapping[str, Any]]
) -> None:
    """A CSV file: the header, then the rows (a mapping row is read by the header's names;
    missing names are left empty, other keys ignored).

    >>> import tempfile, pathlib
    >>> target = pathlib.Path(tempfile.mkdtemp()) / "t.csv"
    >>> atomic_write_csv(target, ["a", "b"], [[1, 2], {"b": 4, "c": 5}])
    >>> target.read_text().splitlines()
    ['a,b', '1,2', ',4']
    """
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(header)
    for row in rows:
        writer.writerow([row.get(name) for name in header] if isinstance(row, Mapping) else row)
    atomic_write_text(path, buf.getvalue())


def atomic_write_figure(fig: Any, path: str | Path, *, dpi: int = 100) -> None:
    """A matplotlib figure as a PNG file; the figure is closed."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
