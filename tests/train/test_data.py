from pathlib import Path

import pytest
from conftest import write_images

from bigbatch.train.data import DataError, scan_csv, scan_folder, split_items


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
