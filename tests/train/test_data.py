from pathlib import Path
from typing import Any

import pytest
import torch

from bigbatch.train.data import DataError, make_loader, split_items, windows_per_epoch
from bigbatch.train.tasks.classification.data import (
    DuplicateRowsWarning,
    ImageDataset,
    scan_csv,
    scan_folder,
)
from tiny_runs import write_images


def test_folder_of_classes(image_folder: Path) -> None:
    items = scan_folder(image_folder)
    assert items.classes == ["blue", "green", "red"] and len(items) == 30


def test_corrupt_images_are_skipped_and_counted_or_stop(image_folder: Path) -> None:
    (image_folder / "red" / "broken.png").write_bytes(b"not a png")
    (image_folder / "red" / "notes.txt").write_text("ignored: not an image suffix")
    items = scan_folder(image_folder)
    assert len(items) == 30 and [p.name for p, _ in items.skipped] == ["broken.png"]
    with pytest.raises(DataError, match=r"cannot read image .*broken.png.*bad_images=skip"):
        scan_folder(image_folder, bad_images="error")


def test_empty_class_folder(image_folder: Path) -> None:
    (image_folder / "purple").mkdir()
    with pytest.raises(DataError, match=r"class folder .*purple has no images"):
        scan_folder(image_folder)


def test_csv_rows(tmp_path: Path) -> None:
    write_images(tmp_path / "imgs")
    rows = ["file,label"] + [f"{c}/{c}_{i}.png,{c}" for c in ("red", "blue") for i in range(3)]
    (tmp_path / "train.csv").write_text("\n".join(rows))
    items = scan_csv(tmp_path / "train.csv", image_root=tmp_path / "imgs")
    assert items.classes == ["blue", "red"] and len(items) == 6
    (tmp_path / "bad.csv").write_text("file,label\nred/nope.png,red\n")
    with pytest.raises(DataError, match=r"do not exist under .*'red/nope.png'"):
        scan_csv(tmp_path / "bad.csv", image_root=tmp_path / "imgs")
    (tmp_path / "valid.csv").write_text("file,label\ngreen/green_0.png,green\n")
    with pytest.raises(DataError, match="labels the training data does not: green"):
        scan_csv(tmp_path / "valid.csv", image_root=tmp_path / "imgs", classes=items.classes)


def test_seeded_split_is_reproducible(image_folder: Path) -> None:
    items = scan_folder(image_folder)
    a = split_items(items, 0.2, seed=1)[1].files
    assert a == split_items(items, 0.2, seed=1)[1].files
    assert a != split_items(items, 0.2, seed=2)[1].files
    assert len(a) == 6


# ------------------------------------------------------------- silent data problems (issue 8)


def _write_csv(path: Path, rows: list[str]) -> Path:
    path.write_text("\n".join(["file,label", *rows]) + "\n")
    return path


def test_labels_with_stray_spaces_are_one_class(tmp_path: Path) -> None:
    write_images(tmp_path / "imgs")
    rows = ["red/red_0.png,red", "red/red_1.png,red ", "blue/blue_0.png, blue"]
    items = scan_csv(_write_csv(tmp_path / "t.csv", rows), image_root=tmp_path / "imgs")
    assert items.classes == ["blue", "red"]


def test_duplicate_csv_rows_are_used_once_and_cannot_leak_across_the_split(
    tmp_path: Path,
) -> None:
    write_images(tmp_path / "imgs")
    rows = [f"red/red_{i}.png,red" for i in range(10)] + [
        f"blue/blue_{i}.png,blue" for i in range(10)
    ]
    path = _write_csv(tmp_path / "t.csv", rows + rows[:5])
    with pytest.warns(DuplicateRowsWarning, match="5 file"):
        items = scan_csv(path, image_root=tmp_path / "imgs")
    assert len(items) == 20
    train, valid = split_items(items, 0.5, seed=0)
    assert not set(train.files) & set(valid.files)
    with pytest.raises(DataError, match=r"labels 'red/red_0\.png' twice"):
        scan_csv(
            _write_csv(tmp_path / "c.csv", [*rows, "red/red_0.png,blue"]),
            image_root=tmp_path / "imgs",
        )


def test_a_class_of_only_unreadable_images_is_an_error(image_folder: Path) -> None:
    (image_folder / "purple").mkdir()
    (image_folder / "purple" / "a.png").write_bytes(b"not a png")
    with pytest.raises(DataError, match=r"class 'purple' .* has no readable image"):
        scan_folder(image_folder)


def test_no_readable_image_at_all_names_the_files_not_valid_pct(tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "x.png").write_bytes(b"")
    with pytest.raises(DataError, match=r"none of the 2 image\(s\) .* can be read, e.g."):
        scan_folder(tmp_path)


def test_exif_orientation_is_applied(tmp_path: Path) -> None:
    """A portrait photo stored landscape with EXIF orientation 6 must train upright."""
    from PIL import Image

    path = tmp_path / "photo.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    Image.new("RGB", (16, 8)).save(path, exif=exif)
    ds = ImageDataset([path], [0], transform=lambda im: torch.tensor(im.size))
    assert ds[0][0].tolist() == [8, 16]  # shown as 8 wide, 16 high


def test_merged_last_window_for_batchnorm() -> None:
    """33 samples in windows of 16: 16, 16, 1 by default; with min_last=2 (BatchNorm models)
    the lone sample joins the window before: 16, 17. Every sample is used once."""
    loader = make_loader(
        torch.utils.data.TensorDataset(torch.arange(33)), 16, shuffle=True, seed=0, num_workers=0
    )
    assert [len(b[0]) for b in loader] == [16, 16, 1]
    merged = make_loader(
        torch.utils.data.TensorDataset(torch.arange(33)),
        16,
        shuffle=True,
        seed=0,
        num_workers=0,
        min_last=2,
    )
    sizes = [len(b[0]) for b in merged]
    assert sizes == [16, 17] and len(merged) == 2 == windows_per_epoch(33, 16, min_last=2)
    assert sorted(torch.cat([b[0] for b in merged]).tolist()) == list(range(33))


class _Noisy(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """A sample and the augmentation noise drawn for it from torch's and Python's generators."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        import random

        return torch.tensor([float(i), float(torch.rand(())), random.random()])


def _epochs(loader: Any, seeds: list[int]) -> list[torch.Tensor]:
    out = []
    for seed in seeds:
        loader.batch_sampler.set_epoch(seed)
        out.append(torch.cat(list(loader)))
    return out


@pytest.mark.slow
def test_workers_persist_across_epochs_and_augmentation_follows_the_seed_alone() -> None:
    """One loader for the run: its workers are not started again each epoch, each epoch's
    order follows its seed, and a sample's augmentation depends on (seed, index) only: the
    same with one worker or two, and in a run resumed mid-epoch (skip)."""
    two = make_loader(_Noisy(), 4, shuffle=True, seed=0, num_workers=2, pin_memory=False)
    one = make_loader(_Noisy(), 4, shuffle=True, seed=0, num_workers=1)
    assert two.persistent_workers and two.num_workers == 2
    a, b = _epochs(two, [7, 8]), _epochs(one, [7, 8])
    assert two._iterator is not None  # the workers of the first epoch served the second
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
    assert not torch.equal(a[0][:, 0], a[1][:, 0])  # another epoch, another order
    two.batch_sampler.set_epoch(7, skip=1)  # resumed after one window of epoch 7
    assert torch.equal(torch.cat(list(two)), a[0][4:])
    in_process = make_loader(_Noisy(), 4, shuffle=True, seed=7, num_workers=0)
    assert not in_process.persistent_workers
    assert torch.equal(torch.cat(list(in_process))[:, 0], a[0][:, 0])  # the same order


def test_epoch_batches_fold_a_lone_sample_and_skip() -> None:
    from bigbatch.train.data import EpochBatches

    batches = EpochBatches(9, 4, shuffle=False, min_last=2)
    batches.set_epoch(0, skip=1)
    assert list(batches) == [[4, 5, 6, 7, 8]] and len(batches) == 1
    seeded = EpochBatches(3, 2, shuffle=False, seeded=True)
    seeded.set_epoch(5)
    keys = [key for batch in seeded for key in batch]
    assert [i for _, i in keys] == [0, 1, 2] and len({s for s, _ in keys}) == 3
