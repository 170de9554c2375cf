"""Kaggle's run-length encoded masks: the codec, the two CSV layouts, and their checks.

A mask's pixels are numbered from 1, top to bottom, then left to right (column by column), and
the encoding lists ``start length`` pairs of the runs of foreground pixels; an empty cell is an
empty mask. Two layouts of a training CSV are in use:

- ``Image_Label,EncodedPixels`` with ``image.jpg_Fish`` (Understanding Clouds): a row for every
  image and class, overlapping classes allowed;
- ``ImageId,ClassId,EncodedPixels`` (Severstal steel defects): rows only for non-empty masks, so
  an image of the folder with no row has empty masks.

Every malformed encoding is refused with the row and the fix: an odd number of values, a run
past the image's end, runs unsorted or overlapping (decoding would silently merge or drop them).
Only numpy is needed here.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bigbatch.io import CSVError, read_csv_rows

__all__ = [
    "LAYOUTS",
    "RLEError",
    "RLETable",
    "check_listing",
    "parse_mask_size",
    "read_rle_csv",
    "rle_decode",
    "rle_encode",
    "rle_runs",
    "runs_overlap",
    "write_rle_csv",
]

# The header of each layout, as the competitions ship them.
LAYOUTS = {
    "image_label": ("Image_Label", "EncodedPixels"),
    "image_class": ("ImageId", "ClassId", "EncodedPixels"),
}


class RLEError(ValueError):
    """A run-length encoding or an RLE CSV that cannot be read faithfully, with the fix."""


def rle_layout(header: Sequence[str]) -> str:
    """The RLE layout whose header this is (``image_label``, ``image_class``), else ''."""
    return next((name for name, cols in LAYOUTS.items() if tuple(header) == cols), "")


def header_problem(header: Sequence[str]) -> str:
    """What is wrong with a header that is no RLE layout, and the fix.

    >>> header_problem(("ImageId_ClassId", "EncodedPixels"))[:60]
    "the header 'ImageId_ClassId,EncodedPixels' is Severstal's fi"
    """
    accepted = " or ".join(",".join(c) for c in LAYOUTS.values())
    shown = ",".join(header)
    if not header or not any(h.strip() for h in header):
        return f"the file is empty: an RLE CSV starts with the header {accepted}"
    if tuple(header) == ("ImageId_ClassId", "EncodedPixels"):
        return (
            f"the header {shown!r} is Severstal's first layout: split its first column at the "
            "last underscore into ImageId,ClassId (the competition's later train.csv has them)"
        )
    if header[0] in ("", "Unnamed: 0") and rle_layout(header[1:]):
        return (
            f"the header {shown!r} has an index column first (pandas' to_csv without "
            "index=False): write it again with index=False, or drop the first column"
        )
    return f"the header {shown!r} is not {accepted} (Kaggle's two RLE layouts)"


def rle_encode(mask: np.ndarray) -> str:
    """The Kaggle encoding of a 2D mask (nonzero is foreground): '' for an empty mask.

    >>> rle_encode(np.array([[0, 1], [1, 1]]))
    '2 3'
    >>> rle_decode("2 3", (2, 2)).astype(int).tolist()
    [[0, 1], [1, 1]]
    """
    if mask.ndim != 2:
        raise ValueError(f"a mask to encode is 2D (height, width), got shape {mask.shape}")
    pixels = np.concatenate([[0], mask.flatten(order="F").astype(bool).view(np.uint8), [0]])
    edges = np.flatnonzero(pixels[1:] != pixels[:-1]) + 1  # 1-based starts and ends
    starts, ends = edges[0::2], edges[1::2]
    return " ".join(f"{s} {e - s}" for s, e in zip(starts.tolist(), ends.tolist(), strict=True))


def rle_runs(rle: str, shape: tuple[int, int], where: str = "the mask") -> np.ndarray:
    """The runs of an encoding as ``(runs, 2)`` int64 of 0-based first and one-past-last pixel
    (column by column), each checked against ``shape`` (height, width); ``where`` names the
    encoding in errors (a CSV row).

    >>> rle_runs("2 3", (2, 2)).tolist()
    [[1, 4]]
    """
    values = rle.split()
    if not values:
        return np.zeros((0, 2), dtype=np.int64)
    try:
        numbers = np.array([int(v) for v in values], dtype=np.int64)
    except ValueError:
        raise RLEError(
            f"{where}: {rle[:60]!r} is not a run-length encoding (whole numbers, start length "
            "pairs)"
        ) from None
    if len(numbers) % 2:
        raise RLEError(
            f"{where}: {len(numbers)} numbers, an odd count: the encoding is start length pairs; "
            "the row is cut short or was joined with another"
        )
    starts, lengths = numbers[0::2], numbers[1::2]
    size = shape[0] * shape[1]
    if (starts < 1).any() or (lengths < 1).any():
        raise RLEError(
            f"{where}: starts are numbered from 1 and lengths are at least 1; a 0 or a negative "
            "number means another convention (0-based?): re-encode it"
        )
    ends = starts + lengths - 1
    if (ends > size).any():
        raise RLEError(
            f"{where}: a run ends at pixel {int(ends.max())}, past the image's {size} pixels "
            f"({shape[0]} x {shape[1]}): the mask belongs to a larger image, or the image was "
            "resized after it was encoded"
        )
    if (starts[1:] <= ends[:-1]).any():
        at = int(np.flatnonzero(starts[1:] <= ends[:-1])[0]) + 1
        raise RLEError(
            f"{where}: run {at + 1} (start {int(starts[at])}) begins before run {at} ends "
            f"({int(ends[at - 1])}): runs must be sorted and must not overlap; re-encode the mask"
        )
    return np.stack([starts - 1, ends], axis=1)


def rle_decode(rle: str, shape: tuple[int, int], where: str = "the mask") -> np.ndarray:
    """The boolean mask of ``shape`` (height, width) an encoding describes; ``where`` names it
    in errors (a CSV row).

    >>> rle_decode("2 3", (2, 3)).astype(int).tolist()  # pixels 2-4, 1-based, down the columns
    [[0, 1, 0], [1, 1, 0]]
    """
    runs = rle_runs(rle, shape, where)
    size = shape[0] * shape[1]
    flat = np.zeros(size + 1, dtype=np.int8)
    np.add.at(flat, runs[:, 0], 1)
    np.add.at(flat, runs[:, 1], -1)
    return np.cumsum(flat[:-1]).astype(bool).reshape(shape, order="F")


def runs_overlap(runs: Sequence[np.ndarray]) -> bool:
    """Whether runs of several masks of one image (:func:`rle_runs`) share a pixel, without
    decoding them.

    >>> runs_overlap([rle_runs("1 3", (2, 2)), rle_runs("3 2", (2, 2))])
    True
    """
    every = np.concatenate([np.zeros((0, 2), dtype=np.int64), *runs])
    if len(every) < 2:
        return False
    every = every[np.argsort(every[:, 0], kind="stable")]
    reach = np.maximum.accumulate(every[:, 1])
    return bool((every[1:, 0] < reach[:-1]).any())


def parse_mask_size(text: str) -> tuple[int, int]:
    """``"350x525"`` -> (350, 525): a submission's mask height and width.

    >>> parse_mask_size("350x525")
    (350, 525)
    """
    parts = text.lower().replace(" ", "").split("x")
    try:
        height, width = (int(p) for p in parts)
    except ValueError:
        raise RLEError(
            f"--mask-size {text!r} is not HEIGHTxWIDTH: give e.g. --mask-size 350x525"
        ) from None
    if height < 1 or width < 1:
        raise RLEError(f"--mask-size {text!r}: height and width are at least 1")
    return height, width


@dataclass
class RLETable:
    """An RLE CSV read: its layout, the class names in the order they first appear, and each
    image's encodings by class (an image-class pair absent from the file is an empty mask)."""

    layout: str
    classes: list[str]
    masks: dict[str, dict[str, str]] = field(default_factory=dict)

    def decode(self, image: str, shape: tuple[int, int]) -> np.ndarray:
        """``image``'s masks, (classes, height, width) bool."""
        own = self.masks.get(image, {})
        return np.stack([rle_decode(own.get(c, ""), shape, f"{image} {c}") for c in self.classes])


# An Image_Label cell is the image's file name, an underscore, the class: the name may hold
# underscores itself (train_0001.jpg_Fish), so the split is after its image suffix.
_IMAGE_THEN_CLASS = re.compile(r"^(.+\.(?:jpe?g|png|tiff?|bmp|webp|gif))_(.+)$", re.IGNORECASE)
_IMAGE_ALONE = re.compile(r"\.(?:jpe?g|png|tiff?|bmp|webp|gif)$", re.IGNORECASE)


def _image_and_class(row: Sequence[str], layout: str, line: int, path: Path) -> tuple[str, str]:
    if layout == "image_class":
        return row[0].strip(), row[1].strip()
    cell = row[0].strip()
    match = _IMAGE_THEN_CLASS.match(cell)
    if match:
        return match.group(1), match.group(2)
    if _IMAGE_ALONE.search(cell):
        raise RLEError(
            f"{path} line {line}: {cell!r} has no class after the image's name: an Image_Label "
            "cell is the image's file name, an underscore and the class (e.g. 0011165.jpg_Fish)"
        )
    image, sep, name = cell.rpartition("_")
    if not sep or not image or not name:
        raise RLEError(
            f"{path} line {line}: {cell!r} is not image_class (e.g. 0011165.jpg_Fish): the "
            "Image_Label column joins the image's file name and the class with an underscore"
        )
    return image, name


def read_rle_csv(path: str | Path) -> RLETable:
    """Read a Kaggle RLE CSV in either layout (told by its header); each encoding is checked
    when its image's size is known (:meth:`RLETable.decode`).

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "train.csv"
    >>> _ = p.write_text("Image_Label,EncodedPixels\\na.jpg_Fish,1 3\\na.jpg_Sugar,\\n")
    >>> t = read_rle_csv(p); (t.layout, t.classes, t.masks["a.jpg"]["Fish"])
    ('image_label', ['Fish', 'Sugar'], '1 3')
    """
    path = Path(path)
    try:
        rows = read_csv_rows(path)  # Excel's byte-order mark, quotes, CRLF, semicolons
    except CSVError as exc:
        raise RLEError(str(exc)) from None
    header = tuple(h.strip() for h in rows[0]) if rows else ()
    layout = rle_layout(header)
    if not layout:
        raise RLEError(f"{path}: {header_problem(header)}")
    table = RLETable(layout, [])
    width = len(LAYOUTS[layout])
    for line, row in enumerate(rows[1:], start=2):
        if not row:
            continue
        if tuple(cell.strip() for cell in row) == header:
            raise RLEError(
                f"{path} line {line} is the header again (two CSVs joined?): delete that line, "
                "and check the rows after it belong to this file"
            )
        if len(row) != width:
            raise RLEError(f"{path} line {line}: {len(row)} cells, the header has {width}")
        image, name = _image_and_class(row, layout, line, path)
        if name not in table.classes:
            table.classes.append(name)
        own = table.masks.setdefault(image, {})
        if name in own:  # an empty and a filled row for one mask too: which one is meant?
            raise RLEError(f"{path} line {line}: a second row for {image} {name}: keep one")
        own[name] = row[-1].strip()
    if not table.masks:
        raise RLEError(f"{path} has a header but no rows")
    if layout == "image_label":  # every image has a row for every class there
        for image, own in table.masks.items():
            absent = [c for c in table.classes if c not in own]
            if absent:
                raise RLEError(
                    f"{path}: {image} has no row for class {absent[0]} (Image_Label lists every "
                    f"image and class, an empty cell for an empty mask): add the row "
                    f"`{image}_{absent[0]},` if its mask is empty, or check the file is whole"
                )
    if layout == "image_class":  # Severstal's class ids, in their numeric order
        table.classes.sort(key=lambda c: (not c.isdigit(), int(c) if c.isdigit() else 0, c))
    return table


def check_listing(table: RLETable, image_root: str | Path, csv_name: str = "the CSV") -> list[Path]:
    """The image files of ``table``, under ``image_root``; RLEError, before any training, for an
    image listed but missing, or (``Image_Label``, which lists every image) an image of the
    folder with no row. An ``ImageId,ClassId`` CSV lists only non-empty masks, so a folder's
    image without a row is all empty there.

    >>> import tempfile, pathlib
    >>> root = pathlib.Path(tempfile.mkdtemp()); _ = (root / "a.jpg").write_bytes(b"")
    >>> [p.name for p in check_listing(RLETable("image_label", ["Fish"], {"a.jpg": {}}), root)]
    ['a.jpg']
    """
    root = Path(image_root)
    if not root.is_dir():
        raise RLEError(f"image_root={root} is not a folder: give the folder of {csv_name}'s images")
    missing = [name for name in table.masks if not (root / name).is_file()]
    if missing:
        raise RLEError(
            f"{len(missing)} image(s) listed in {csv_name} are not in {root}, e.g. {missing[0]}: "
            "point image_root= at the images' folder, or remove their rows"
        )
    if table.layout == "image_label":
        on_disk = {p.name for p in root.iterdir() if p.is_file() and not p.name.startswith(".")}
        unlisted = sorted(on_disk - set(table.masks))
        if unlisted:
            raise RLEError(
                f"{len(unlisted)} image(s) in {root} have no rows in {csv_name}, e.g. "
                f"{unlisted[0]}: Image_Label lists every image (empty cells for empty masks); "
                "move other images (a test set?) out of the folder, or add their rows"
            )
    return [root / name for name in table.masks]


def write_rle_csv(
    path: str | Path,
    layout: str,
    classes: Sequence[str],
    masks: Iterable[tuple[str, Mapping[str, np.ndarray]]],
) -> int:
    """Write a submission in ``layout``: a row for every image and class (an empty cell for an
    empty mask), in the order given. Returns the number of rows. The caller writes atomically.

    >>> import tempfile
    >>> path = Path(tempfile.mkdtemp()) / "submission.csv"
    >>> fish = rle_decode("2 3", (2, 3))
    >>> write_rle_csv(path, "image_label", ["Fish", "Sugar"],
    ...               [("a.jpg", {"Fish": fish, "Sugar": np.zeros_like(fish)})])
    2
    >>> path.read_text().splitlines()
    ['Image_Label,EncodedPixels', 'a.jpg_Fish,2 3', 'a.jpg_Sugar,']
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout is one of {', '.join(LAYOUTS)}, got {layout!r}")
    rows = 0
    with Path(path).open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(LAYOUTS[layout])
        for image, by_class in masks:
            for name in classes:
                rle = rle_encode(by_class[name])
                cells = [f"{image}_{name}", rle] if layout == "image_label" else [image, name, rle]
                writer.writerow(cells)
                rows += 1
    return rows
