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
