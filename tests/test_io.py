"""Atomic writes: a failure mid-write (a full disk) leaves the previous file intact."""

import errno
from pathlib import Path

import pytest
import torch

from bigbatch.io import atomic_path, atomic_write_text
from bigbatch.train.checkpoint import save_weights


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
    save_weights(model, tmp_path / "best.safetensors")
    before = (tmp_path / "best.safetensors").read_bytes()

    def full_disk(model: torch.nn.Module, filename: str) -> None:
        Path(filename).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("safetensors.torch.save_model", full_disk)
    with torch.no_grad():
        model.weight.add_(1.0)
    with pytest.raises(OSError):
        save_weights(model, tmp_path / "best.safetensors")
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
