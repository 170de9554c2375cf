"""Sliding-window volume prediction: every window lands where it came from, the blend is a
weighted mean, and a whole volume that runs out of memory is predicted in windows instead."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from bigbatch.train.tasks.segmentation.predict import _volume_probs, sliding_window


@pytest.mark.parametrize("overlap", [0.0, 0.25, 0.5])
def test_every_window_lands_where_it_came_from(overlap: float) -> None:
    # A pointwise "model" (the identity) must give back its input exactly, whatever the
    # overlap, and at sizes that are not multiples of the step (the last window is shifted in).
    x = torch.rand(1, 3, 21, 16, 9, dtype=torch.float64)
    seen: list[tuple[int, ...]] = []

    def identity(w: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(w.shape[2:]))
        return w

    out = sliding_window(identity, x, 8, overlap=overlap)
    assert torch.allclose(out, x, rtol=0, atol=1e-12)
    assert set(seen) == {(8, 8, 8)}  # every window the patch size (each axis >= the patch)
    # Tiles at no overlap (the last one on each axis shifted in), more windows with overlap.
    assert len(seen) == 3 * 2 * 2 if overlap == 0 else len(seen) > 3 * 2 * 2


def test_an_axis_shorter_than_the_patch_is_taken_whole() -> None:
    x = torch.rand(1, 1, 4, 40, 16)
    shapes: set[tuple[int, ...]] = set()

    def record(w: torch.Tensor) -> torch.Tensor:
        shapes.add(tuple(w.shape[2:]))
        return w.sigmoid()

    assert torch.allclose(sliding_window(record, x, 16), x.sigmoid(), atol=1e-6)
    assert shapes == {(4, 16, 16)}


def test_whole_volume_oom_falls_back_to_windows_of_the_training_size(
    caplog: pytest.LogCaptureFixture,
) -> None:
    x = torch.rand(1, 2, 32, 24, 16)
    calls: list[tuple[int, ...]] = []

    def small_memory(w: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(w.shape[2:]))
        if w[0, 0].numel() > 16**3:  # as a GPU would: only a window fits
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return w.softmax(1)

    with caplog.at_level(logging.WARNING, logger="bigbatch"):
        probs = _volume_probs(small_memory, x, 2, 0, 16, Path("case.nii.gz"))
    assert calls[0] == (32, 24, 16) and set(calls[1:]) == {(16, 16, 16)}
    assert torch.allclose(probs, x.softmax(1), atol=1e-6)
    assert "case.nii.gz" in caplog.text and "--patch" in caplog.text


def test_an_error_that_is_not_an_oom_is_not_retried() -> None:
    def broken(w: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("Given groups=1, weight of size [8, 3, 3, 3, 3], expected 3 channels")

    with pytest.raises(RuntimeError, match="expected 3 channels"):
        _volume_probs(broken, torch.rand(1, 2, 16, 16, 16), 1, 0, 8, Path("a.npy"))
