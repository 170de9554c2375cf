"""Atomic writes: a failure mid-write (a full disk) leaves the previous file intact."""

import errno
from pathlib import Path

import pytest
import torch

from bigbatch.io import atomic_path, atomic_write_text
from bigbatch.train.checkpoint import host_copy, write_weights


def test_failed_write_keeps_the_previous_file(tmp_path: Path) -> None:
    target = tmp_path / "history.csv"
    atomic_write_text(target, "epoch 1\n")
    with pytest.raises(OSError, match="No space"), atomic_path(target) as tmp:
        tmp.write_text("epoch 1\nepoch 2 (half")
        raise OSError(errno.ENOSPC, "No space left on device")
    assert target.read_text() == "epoch 1\n"
    assert [p.name for p in tmp_path.iterdir()] == ["history.csv"]  # no temporary left behind


def test_checkpoint_survives_a_full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = torch.nn.Linear(4, 2)
    write_weights(host_copy(model.state_dict()), tmp_path / "best.safetensors")
    before = (tmp_path / "best.safetensors").read_bytes()

    def full_disk(tensors: object, filename: str, metadata: object = None) -> None:
        Path(filename).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("safetensors.torch.save_file", full_disk)
    with torch.no_grad():
        model.weight.add_(1.0)
    with pytest.raises(OSError):
        write_weights(host_copy(model.state_dict()), tmp_path / "best.safetensors")
    assert (tmp_path / "best.safetensors").read_bytes() == before


def test_files_get_the_usual_permissions(tmp_path: Path) -> None:
    """mkstemp's 0600 used to leak into every output: the umask decides, as for any file."""
    import os

    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "a.txt", "x")
    finally:
        os.umask(old)
    assert (tmp_path / "a.txt").stat().st_mode & 0o777 == 0o644


def test_a_locked_folder_refuses_a_second_holder(tmp_path: Path) -> None:
    from bigbatch.io import FolderBusyError, lock_folder

    with (
        lock_folder(tmp_path / "run"),
        pytest.raises(FolderBusyError, match=r"in use by pid"),
        lock_folder(tmp_path / "run"),
    ):
        pass
    with lock_folder(tmp_path / "run"):  # released with the first holder
        pass


def test_pickled_objects_are_refused_without_running_them(tmp_path: Path) -> None:
    import pickle

    from bigbatch.io import load_tensors

    ran = tmp_path / "ran"

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str, str]]:
            return (Path.write_text, (ran, "x"))  # type: ignore[return-value]

    for name, data in (("raw.pt", pickle.dumps(Evil())), ("zip.pt", None)):
        path = tmp_path / name
        if data is None:
            torch.save({"x": Evil()}, path)
        else:
            path.write_bytes(data)
        with pytest.raises(ValueError, match="will not unpickle") as info:
            load_tensors(path, "checkpoint")
        assert "weights_only=False" not in str(info.value)
    assert not ran.exists()


def test_tied_weights_are_copied_once_stored_once_and_loaded_back(tmp_path: Path) -> None:
    from bigbatch.train.checkpoint import load_weights_file

    def tied() -> torch.nn.Module:
        model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
        model[1].weight = model[0].weight  # an LM's tied input and output embeddings
        return model

    model = tied()
    copied = host_copy(model.state_dict())
    assert copied["0.weight"] is copied["1.weight"]
    assert copied._metadata == model.state_dict()._metadata  # the modules' versions, for loading
    write_weights(copied, tmp_path / "w.safetensors")
    other = tied()
    load_weights_file(other, tmp_path / "w.safetensors")
    assert torch.equal(other[1].weight, model[0].weight) and other[1].weight is other[0].weight


def test_the_background_writer_keeps_order_and_raises_a_failed_write() -> None:
    import threading

    from bigbatch.io import BackgroundWriter

    done: list[tuple[int, str]] = []
    with BackgroundWriter() as files:
        for i in range(3):
            files.submit(lambda i: done.append((i, threading.current_thread().name)), i)
        files.wait()
        assert [i for i, _ in done] == [0, 1, 2]
        assert all(name.startswith("bigbatch-files") for _, name in done)

    def full(path: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", path)

    with pytest.raises(OSError, match="No space"), BackgroundWriter() as files:
        files.submit(full, "last.pt")  # raised on leaving, where nothing else was
    with BackgroundWriter() as files:
        files.submit(full, "last.pt")
        with pytest.raises(OSError, match="No space"):
            files.wait()
        files.submit(done.append, (3, "after"))  # the writer goes on after a failure was raised
    assert done[-1] == (3, "after")
    # An exception in flight is the one reported; the writer still finishes what it was given.
    gate = threading.Event()

    def full_later(path: str) -> None:
        gate.wait()  # not done before the second job is handed over
        full(path)

    with pytest.raises(KeyboardInterrupt), BackgroundWriter() as files:
        files.submit(full_later, "last.pt")
        files.submit(done.append, (4, "finished"))
        gate.set()
        raise KeyboardInterrupt
    assert done[-1] == (4, "finished")
