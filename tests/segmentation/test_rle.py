"""Kaggle's run-length encoding: exact round trips (the last pixel, an empty mask, the column
order), both CSV layouts told by their header, and every malformed encoding refused in one line
naming the row and the fix."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bigbatch.segmentation.rle import (
    RLEError,
    parse_mask_size,
    read_rle_csv,
    rle_decode,
    rle_encode,
    write_rle_csv,
)


@pytest.mark.parametrize("seed", range(20))
def test_decode_of_encode_is_the_mask(seed: int) -> None:
    rng = np.random.default_rng(seed)
    h, w = (int(v) for v in rng.integers(1, 40, 2))
    mask = rng.random((h, w)) < rng.random()
    assert np.array_equal(rle_decode(rle_encode(mask), (h, w)), mask)


def test_the_edges_and_the_numbering() -> None:
    full = np.ones((3, 4), dtype=bool)
    assert rle_encode(full) == "1 12"  # touches the last pixel
    assert np.array_equal(rle_decode("1 12", (3, 4)), full)
    assert rle_encode(np.zeros((3, 4))) == "" and not rle_decode("", (3, 4)).any()
    last = np.zeros((3, 4), dtype=bool)
    last[-1, -1] = True
    assert rle_encode(last) == "12 1"
    # Numbered from 1, top to bottom, then left to right: pixel 2 is row 1 of column 0.
    second = np.zeros((3, 4), dtype=bool)
    second[1, 0] = True
    assert rle_encode(second) == "2 1"


@pytest.mark.parametrize(
    ("rle", "match"),
    [
        ("1 2 5", "an odd count"),
        ("10 5", "past the image's 12 pixels"),
        ("5 2 1 2", "must be sorted and must not overlap"),
        ("1 4 3 2", "must be sorted and must not overlap"),
        ("0 3", "numbered from 1"),
        ("1 x", "not a run-length encoding"),
    ],
)
def test_malformed_encodings_are_refused(rle: str, match: str) -> None:
    with pytest.raises(RLEError, match=match):
        rle_decode(rle, (3, 4), "row 7")


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_both_layouts_are_read_from_their_header(tmp_path: Path) -> None:
    clouds = read_rle_csv(
        _write(
            tmp_path / "clouds.csv",
            "Image_Label,EncodedPixels\na.jpg_Fish,1 3\na.jpg_Flower,\na.jpg_Sugar,2 2\n"
            "b.jpg_Fish,\nb.jpg_Flower,\nb.jpg_Sugar,\n",
        )
    )
    assert clouds.layout == "image_label" and clouds.classes == ["Fish", "Flower", "Sugar"]
    masks = clouds.decode("a.jpg", (2, 2))
    assert masks.shape == (3, 2, 2) and (masks[0] & masks[2]).any()  # Fish and Sugar overlap
    steel = read_rle_csv(
        _write(tmp_path / "steel.csv", "ImageId,ClassId,EncodedPixels\nx.jpg,3,1 2\ny.jpg,1,4 1\n")
    )
    assert steel.layout == "image_class" and steel.classes == ["1", "3"]
    assert steel.decode("x.jpg", (2, 2))[1].sum() == 2 and not steel.decode("z.jpg", (2, 2)).any()


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("image,mask\na.png,b.png\n", "is not Image_Label,EncodedPixels or ImageId,ClassId"),
        ("Image_Label,EncodedPixels\n", "has a header but no rows"),
        ("Image_Label,EncodedPixels\nFish,1 2\n", "is not image_class"),
        ("ImageId,ClassId,EncodedPixels\na.jpg,1\n", "2 cells, the header has 3"),
        ("ImageId,ClassId,EncodedPixels\na.jpg,1,1 2\na.jpg,1,5 2\n", "a second row for a.jpg 1"),
        # An empty and a filled row for one mask: not merged, since either may be the one meant.
        ("Image_Label,EncodedPixels\na.jpg_Fish,\na.jpg_Fish,1 2\n", "a second row for a.jpg Fish"),
        # Two CSVs joined: the line named, not an image "not in the folder".
        (
            "Image_Label,EncodedPixels\na.jpg_Fish,1 2\nImage_Label,EncodedPixels\nb.jpg_Fish,\n",
            r"line 3 is the header again \(two CSVs joined\?\): delete that line",
        ),
        # Image_Label lists every image and class: a missing row is no empty mask.
        (
            "Image_Label,EncodedPixels\na.jpg_Fish,1 2\na.jpg_Sugar,\nb.jpg_Fish,\n",
            "b.jpg has no row for class Sugar .* add the row `b.jpg_Sugar,` if its mask is empty",
        ),
    ],
)
def test_malformed_csvs_are_refused(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(RLEError, match=match):
        read_rle_csv(_write(tmp_path / "train.csv", text))


@pytest.mark.parametrize("layout", ["image_label", "image_class"])
def test_a_written_submission_reads_back_to_its_masks(tmp_path: Path, layout: str) -> None:
    rng = np.random.default_rng(0)
    masks = {f"{i}.jpg": {c: rng.random((5, 7)) < 0.3 for c in ("a", "b")} for i in range(3)}
    masks["0.jpg"]["b"][:] = False  # an empty mask: an empty cell
    path = tmp_path / "submission.csv"
    assert write_rle_csv(path, layout, ["a", "b"], masks.items()) == 6
    table = read_rle_csv(path)
    assert table.layout == layout and table.classes == ["a", "b"]
    for image, by_class in masks.items():
        decoded = table.decode(image, (5, 7))
        assert all(np.array_equal(decoded[k], by_class[c]) for k, c in enumerate(["a", "b"]))


@pytest.mark.parametrize("text", ["350", "350x", "axb", "0x5", "3x4x5"])
def test_a_mask_size_that_is_not_hxw_is_refused(text: str) -> None:
    with pytest.raises(RLEError, match=r"HEIGHTxWIDTH|at least 1"):
        parse_mask_size(text)


def test_the_listing_and_the_folder_must_agree(tmp_path: Path) -> None:
    from bigbatch.segmentation.rle import RLETable, check_listing

    images = tmp_path / "train_images"
    images.mkdir()
    for name in ("a.jpg", "b.jpg"):
        (images / name).write_bytes(b"")
    clouds = RLETable("image_label", ["Fish"], {"a.jpg": {}, "b.jpg": {}})
    assert [p.name for p in check_listing(clouds, images)] == ["a.jpg", "b.jpg"]
    with pytest.raises(RLEError, match=r"1 image\(s\) listed in the CSV are not in .*, e.g. c.jpg"):
        check_listing(RLETable("image_label", ["Fish"], {"c.jpg": {}, "a.jpg": {}}), images)
    with pytest.raises(RLEError, match=r"have no rows in the CSV, e.g. b.jpg: Image_Label lists"):
        check_listing(RLETable("image_label", ["Fish"], {"a.jpg": {}}), images)
    # Severstal's layout lists non-empty masks only: an unlisted image is all empty.
    assert len(check_listing(RLETable("image_class", ["1"], {"a.jpg": {}}), images)) == 1
    with pytest.raises(RLEError, match="is not a folder"):
        check_listing(clouds, tmp_path / "nowhere")


@pytest.mark.parametrize(
    "raw",
    [
        b"\xef\xbb\xbfImage_Label,EncodedPixels\r\na_1.jpg_Fish,1 3\r\na_1.jpg_Sugar,\r\n",  # Excel
        b'"Image_Label","EncodedPixels"\na_1.jpg_Fish,"1 3"\n"a_1.jpg_Sugar",""\n',  # R, pandas
        b"Image_Label;EncodedPixels\na_1.jpg_Fish;1 3\na_1.jpg_Sugar;\n",  # Excel, comma locales
    ],
    ids=["byte-order-mark-crlf", "quoted", "semicolons"],
)
def test_the_dialects_spreadsheets_write_are_read(tmp_path: Path, raw: bytes) -> None:
    path = tmp_path / "train.csv"
    path.write_bytes(raw)
    table = read_rle_csv(path)
    assert table.layout == "image_label" and table.classes == ["Fish", "Sugar"]
    assert table.masks == {"a_1.jpg": {"Fish": "1 3", "Sugar": ""}}
    from bigbatch.train.tasks.segmentation.rle_data import is_rle_csv

    assert is_rle_csv(path)  # routed to the RLE task, not refused as image,mask


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("ImageId_ClassId,EncodedPixels\na.jpg_1,1 2\n", "Severstal's first layout: split"),
        (",Image_Label,EncodedPixels\n0,a.jpg_Fish,1 2\n", "index column first .*index=False"),
        ("", "the file is empty: an RLE CSV starts with the header Image_Label"),
        ("id,rle\na.jpg,1 2\n", "is not Image_Label,EncodedPixels or ImageId,ClassId,Encoded"),
        # An underscore in the image's name and no class: the row, not a wrong image.
        ("Image_Label,EncodedPixels\ntrain_001.jpg_Fish,1 2\ntrain_002.jpg,1 2\n",
         "line 3: 'train_002.jpg' has no class after the image's name"),
    ],
)  # fmt: skip
def test_a_header_or_cell_that_is_no_layout_says_what_it_is(
    tmp_path: Path, text: str, match: str
) -> None:
    with pytest.raises(RLEError, match=match):
        read_rle_csv(_write(tmp_path / "train.csv", text))


def test_image_names_with_underscores_split_after_their_suffix(tmp_path: Path) -> None:
    table = read_rle_csv(
        _write(tmp_path / "t.csv", "Image_Label,EncodedPixels\nsat_2019_07.png_Gravel_Ice,1 2\n")
    )
    assert table.masks == {"sat_2019_07.png": {"Gravel_Ice": "1 2"}}
