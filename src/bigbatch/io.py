"""Atomic file writes: a crash or a full disk never leaves a half-written file behind; CSVs read
in the dialects spreadsheets write.

Each write goes to a temporary file in the same folder, is flushed to disk, then renamed over
the target in one step; on any error the temporary file is removed and the previous version of
the target stays as it was.
"""

from __future__ import annotations

import contextlib
import csv
import io
import itertools
import os
import secrets
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import IO, Any

__all__ = [
    "BackgroundWriter",
    "CSVError",
    "DamagedFileError",
    "FolderBusyError",
    "atomic_path",
    "atomic_write_bytes",
    "atomic_write_csv",
    "atomic_write_figure",
    "atomic_write_text",
    "check_writable",
    "load_tensors",
    "lock_folder",
    "read_csv_rows",
    "read_json",
]


class FolderBusyError(RuntimeError):
    """Another process holds the folder's lock."""


class DamagedFileError(ValueError):
    """A file bigbatch wrote that no longer reads as what it was, with the fix."""


def read_json(path: str | Path, fix: str) -> Any:
    """The JSON in ``path`` (a file a run folder holds); :class:`DamagedFileError` naming the
    file, what is wrong and ``fix`` where it is not JSON.

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "postprocess.json"
    >>> _ = p.write_text('{"classes": ')
    >>> read_json(p, "delete it")
    Traceback (most recent call last):
    ...
    bigbatch.io.DamagedFileError: ...postprocess.json is damaged (not JSON: Expecting value: line 1 column 13 (char 12)): delete it
    """
    import json

    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DamagedFileError(f"{path} is damaged (not JSON: {str(exc)[:80]}): {fix}") from None


class CSVError(ValueError):
    """A CSV that cannot be read as text, with the fix."""


def read_csv_rows(path: str | Path, *, max_rows: int | None = None) -> list[list[str]]:
    """Every row of a CSV as spreadsheets write them: UTF-8 with or without Excel's byte-order
    mark, quoted or not, CRLF or LF line ends, separated by commas, or by semicolons or tabs
    where the header has no comma (Excel in locales whose decimal mark is a comma). ``max_rows``:
    the first rows only (the header: ``max_rows=1``), the rest not read.

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "t.csv"
    >>> _ = p.write_bytes(b'\\xef\\xbb\\xbf"file";"label"\\r\\na.png;cat\\r\\n')
    >>> read_csv_rows(p)
    [['file', 'label'], ['a.png', 'cat']]
    """
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:  # -sig: Excel's byte-order mark
            first = f.readline()
            f.seek(0)
            delimiter = next((d for d in ",;\t" if d in first), ",")
            return list(itertools.islice(csv.reader(f, delimiter=delimiter), max_rows))
    except UnicodeDecodeError as exc:
        raise CSVError(
            f"{path} is not UTF-8 text (byte {exc.start}): save it as UTF-8 (in Excel: CSV UTF-8)"
        ) from None
    except csv.Error as exc:
        raise CSVError(f"{path} is not a readable CSV: {exc}") from None


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
    # Not mkstemp, which creates 0600: the umask decides, as for any file the user writes.
    tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        # A writer that replaces the file itself (safetensors does) leaves it 0600.
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.filename is None:  # a write that failed through a file object: name the target
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _umask() -> int:
    """The process's umask (read without changing it where Linux shows it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


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
    """A matplotlib figure as a PNG file; a pyplot figure is closed (a bare ``Figure``, which
    a thread may draw, has nothing to close)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    if getattr(fig.canvas, "manager", None) is not None:
        import matplotlib.pyplot as plt

        plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def check_writable(path: str | Path, what: str) -> None:
    """Raise ``PermissionError``/``NotADirectoryError`` with the fix unless a file can be
    written at ``path`` (its folder is created): checked before long work, not after it.

    >>> import tempfile
    >>> check_writable(Path(tempfile.mkdtemp()) / "out" / "submission.csv", "--out")
    """
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{what} {path} is a folder; give a file name")
    folder = path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as exc:
        raise NotADirectoryError(
            f"cannot write {what} {path}: part of {folder} is a file, not a folder"
        ) from exc
    except PermissionError as exc:
        raise PermissionError(
            f"cannot create the folder for {what} {path}: permission denied"
        ) from exc
    # A real file, not os.access: root passes every access check, and a read-only or special
    # file system (or a full disk) refuses only the write itself.
    probe = folder / f".{path.name}.{secrets.token_hex(4)}.probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    except OSError as exc:
        raise PermissionError(
            f"cannot write {what} {path}: {folder} is not writable ({exc.strerror}); choose "
            "another place"
        ) from exc
    probe.unlink(missing_ok=True)


@contextlib.contextmanager
def lock_folder(folder: str | Path, what: str = "folder") -> Iterator[Path]:
    """Create ``folder`` (if needed) and hold an exclusive lock on it while the block runs.

    A second process that tries the same folder gets :class:`FolderBusyError` at once; the lock
    goes with the process, so a killed run leaves nothing to clean up. A folder that cannot be
    created or written raises here, before any work.

    >>> import tempfile
    >>> with lock_folder(tempfile.mkdtemp()) as folder:
    ...     (folder / ".lock").exists()
    True
    """
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"{what} {folder} is a file; give a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle = open(folder / ".lock", "a+")  # noqa: SIM115 - held for the whole block
    except (FileExistsError, NotADirectoryError) as exc:
        raise NotADirectoryError(f"cannot create {what} {folder}: a part of it is a file") from exc
    except PermissionError as exc:
        raise PermissionError(
            f"cannot write to {what} {folder}: permission denied; choose another folder"
        ) from exc
    try:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows: no lock, as before
            fcntl = None  # type: ignore[assignment]
        if fcntl is not None:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip() or "another process"
                raise FolderBusyError(
                    f"{what} {folder} is in use by {holder}: wait for it to finish, or choose "
                    "another folder"
                ) from None
            handle.seek(0)
            handle.truncate()
            handle.write(f"pid {os.getpid()}")
            handle.flush()
        yield folder
    finally:
        handle.close()  # releases the lock


def load_tensors(path: str | Path, what: str) -> Any:
    """``torch.load(path, weights_only=True)`` (or safetensors by suffix), with one-line errors:
    a missing, damaged or truncated file, or one holding pickled objects, raises ``ValueError``
    naming the file and what to do. Nothing is ever unpickled.

    >>> import tempfile, torch, pathlib
    >>> f = pathlib.Path(tempfile.mkdtemp()) / "w.pt"
    >>> torch.save({"w": torch.ones(2)}, f)
    >>> load_tensors(f, "weights")["w"].tolist()
    [1.0, 1.0]
    """
    import pickle

    import torch

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what} {path} does not exist")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        with open(path, "rb") as f:
            head = f.read(2)
        # A torch zip archive or a raw pickle (both refused by weights_only) holds objects; any
        # other bytes are not a torch file at all.
        if head in (b"PK", b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05"):
            # torch's own message suggests weights_only=False: never do that with a file you
            # were handed (it runs arbitrary code). Say which object it is, not that.
            found = next((line.strip() for line in str(exc).splitlines() if "GLOBAL" in line), "")
            raise ValueError(
                f"{what} {path} holds pickled Python objects besides tensors"
                + (f" ({found[:160]})" if found else "")
                + "; bigbatch loads tensors only and will not unpickle it: save a plain state "
                "dict (torch.save(model.state_dict(), path)) or a .safetensors file"
            ) from None
        raise ValueError(
            f"cannot read {what} {path}: it is damaged or truncated, or not a torch/safetensors "
            f"file (UnpicklingError: {str(exc).strip()[:120]})"
        ) from None
    except Exception as exc:
        raise ValueError(
            f"cannot read {what} {path}: it is damaged or truncated, or not a torch/safetensors "
            f"file ({type(exc).__name__}: {str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ''})"
        ) from None


class BackgroundWriter:
    """Files written on one thread of their own, in the order they were handed over, while the
    training thread goes on: an epoch's checkpoints (0.7 s for a ResNet-50 and its AdamW state
    on the development machine, fsync included: ``benchmarks/checkpoint_stall.py``) and its plot. What a job writes must be the caller's own copy,
    taken when it is handed over (the training thread changes the live tensors next). A job that
    failed raises at the next :meth:`submit`, at :meth:`wait`, or on leaving the ``with``; leaving
    it waits for every job, so that an interrupted run still finishes the file it was writing.

    >>> import tempfile, pathlib
    >>> out = pathlib.Path(tempfile.mkdtemp()) / "note.txt"
    >>> with BackgroundWriter() as files:
    ...     files.submit(atomic_write_text, out, "epoch 1")
    >>> out.read_text()
    'epoch 1'
    """

    def __init__(self, name: str = "bigbatch-files") -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._jobs: list[Future[Any]] = []

    def submit(self, write: Callable[..., Any], *args: Any) -> None:
        """Run ``write(*args)`` on the writer's thread after the jobs handed over before it."""
        self._raise_failed()
        self._jobs = [job for job in self._jobs if not job.done()]
        self._jobs.append(self._pool.submit(write, *args))

    def wait(self) -> None:
        """Until every job handed over is written; the first that failed raises."""
        jobs, self._jobs = self._jobs, []
        for job in jobs:
            job.result()

    def _raise_failed(self) -> None:
        for job in self._jobs:
            if job.done() and job.exception() is not None:
                self._jobs.remove(job)
                job.result()  # the job's own exception, with its traceback

    def __enter__(self) -> BackgroundWriter:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._pool.shutdown(wait=True)
        if kind is None:  # else the exception in flight is the one to report
            self.wait()
