"""Training images decoded and augmented on the device: loader workers read each file's bytes
and draw its random crop and flip; the training process decodes a window's JPEGs on the GPU
(torchvision's ``decode_jpeg``, nvJPEG), crops, resizes, flips and normalises them there.

Where CPU workers cannot decode as fast as the GPU steps (large JPEGs, few cores), this keeps
the GPU fed. The augmentation is the CPU pipeline's (timm's random resized crop and horizontal
flip), drawn from the same seeded generators in the same order: a sample gets the same crop and
flip either way; only decoding and resampling round-off differ. Files the GPU does not decode
(PNG, a rotated or CMYK photo, a colour JPEG in a greyscale set) are decoded by the worker and
augmented on the device like the others (:class:`DeviceAugment` shows the whole way).
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, default_collate

from bigbatch.images import exif_orientation
from bigbatch.models import MEAN, STD
from bigbatch.train.data import seed_python_from_torch

__all__ = ["DeviceAugment", "EncodedBatch", "EncodedImages", "collate_encoded"]

# A window's JPEGs are decoded in groups of at most this many decoded bytes: a window of large
# photos (128 of 12 megapixels: 4.6 GB) never sits on the device whole.
DECODE_GROUP_BYTES = 256 * 2**20


@dataclass
class EncodedBatch:
    """A window as the workers deliver it: each sample's JPEG bytes (``encoded``) or its pixels
    already decoded (uint8, C x H x W), its stored size, crop box (top, left, height, width) and
    flip, and the targets collated as the CPU pipeline's would be.

    The payloads travel as one flat tensor (``data``, sample ``k`` at ``offsets[k]`` up to
    ``offsets[k + 1]``): a worker hands each tensor of a batch over through shared memory of its
    own, and 128 small ones cost the training process 24 ms of CPU a window to take in, against
    1.9 ms for one (2 cores, JPEGs of 256 px: ``benchmarks/encoded_handover.py``)."""

    data: torch.Tensor  # uint8, every payload's bytes in order
    offsets: list[int]  # n + 1
    encoded: list[bool]
    sizes: torch.Tensor  # (n, 2): height, width
    boxes: torch.Tensor  # (n, 4): top, left, height, width
    flips: torch.Tensor  # (n,) bool
    targets: Any

    def __len__(self) -> int:
        return len(self.encoded)

    def payload(self, k: int) -> torch.Tensor:
        """Sample ``k``'s JPEG bytes, or its decoded pixels as (C, H, W): a view of ``data``."""
        flat = self.data[self.offsets[k] : self.offsets[k + 1]]
        if self.encoded[k]:
            return flat
        height, width = self.sizes[k].tolist()
        return flat.view(-1, height, width)


class EncodedImages(Dataset[tuple[Any, ...]]):
    """The training images as :class:`EncodedBatch` samples: the bytes of each JPEG the GPU can
    decode as it is, or the worker's decoded pixels otherwise, with the random resized crop
    (timm's ``RandomResizedCropAndInterpolation`` parameters over ``scale`` and ``ratio``) and
    the horizontal flip drawn as :class:`~bigbatch.train.tasks.images.ImageDataset` draws them.

    >>> import tempfile
    >>> from PIL import Image
    >>> png = Path(tempfile.mkdtemp()) / "b.png"
    >>> Image.fromarray(np.zeros((40, 60, 3), np.uint8)).save(png)
    >>> collate_encoded([EncodedImages([png], [3])[0]]).encoded  # a PNG: the worker decodes it
    [False]
    """

    def __init__(
        self,
        files: Sequence[Path],
        targets: Sequence[Any],
        *,
        grey: bool = False,
        scale: tuple[float, float] = (0.75, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        hflip: float = 0.5,
    ) -> None:
        self.files, self.targets = list(files), list(targets)
        self.grey, self.scale, self.ratio, self.hflip = grey, scale, ratio, hflip

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        from PIL import Image, ImageOps
        from timm.data.transforms import RandomResizedCropAndInterpolation

        data = self.files[i].read_bytes()
        mode = "L" if self.grey else "RGB"
        with Image.open(io.BytesIO(data)) as im:
            encoded = im.format == "JPEG" and im.mode == mode and exif_orientation(im) == 1
            if encoded:
                width, height = im.size
                payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            else:
                pixels = np.asarray(ImageOps.exif_transpose(im).convert(mode))
                height, width = pixels.shape[:2]
                payload = torch.from_numpy(pixels.reshape(height, width, -1).copy())
                payload = payload.permute(2, 0, 1)
        # The draws of ImageDataset + timm's train transform, in their order: Python's
        # generator seeded from torch's, the crop from Python's, the flip from torch's.
        seed_python_from_torch()
        shape_only = torch.zeros(1).expand(1, height, width)  # the crop reads the size alone
        box = RandomResizedCropAndInterpolation.get_params(shape_only, self.scale, self.ratio)
        flip = bool(torch.rand(1) < self.hflip)
        return payload, encoded, (height, width), box, flip, self.targets[i]


def collate_encoded(samples: list[tuple[Any, ...]]) -> EncodedBatch:
    """Samples of :class:`EncodedImages` as one :class:`EncodedBatch` (a loader's
    ``collate_fn``)."""
    payloads, encoded, sizes, boxes, flips, targets = zip(*samples, strict=True)
    offsets = [0]
    for payload in payloads:
        offsets.append(offsets[-1] + payload.numel())
    return EncodedBatch(
        torch.cat([payload.reshape(-1) for payload in payloads]),
        offsets,
        list(encoded),
        torch.tensor(sizes, dtype=torch.int64),
        torch.tensor(boxes, dtype=torch.int64),
        torch.tensor(flips, dtype=torch.bool),
        default_collate(list(targets)),
    )


@dataclass(frozen=True)
class DeviceAugment:
    """Decodes an :class:`EncodedBatch` on a device and augments it there: each crop resized to
    ``size`` (``interpolation`` bilinear or bicubic, antialiased, rounded to 8 bits as PIL's
    resize is), flipped, divided by 255 and normalised by ``mean`` and ``std``. Call
    :meth:`on` for the function that maps a batch to ``(inputs, targets)``.

    >>> import tempfile, numpy as np
    >>> from PIL import Image
    >>> path = Path(tempfile.mkdtemp()) / "a.jpg"
    >>> Image.fromarray(np.zeros((40, 60, 3), np.uint8)).save(path)
    >>> images = EncodedImages([path], [0])
    >>> batch = collate_encoded([images[0]])
    >>> x, y = DeviceAugment(32).on(torch.device("cpu"))(batch)
    >>> tuple(x.shape), y.tolist()
    ((1, 3, 32, 32), [0])
    """

    size: int
    channels: int = 3
    interpolation: str = "bilinear"
    mean: tuple[float, ...] = MEAN
    std: tuple[float, ...] = STD

    def on(self, device: torch.device) -> Callable[[EncodedBatch], tuple[torch.Tensor, Any]]:
        def augment(batch: EncodedBatch) -> tuple[torch.Tensor, Any]:
            return self.inputs(batch, device), batch.targets

        return augment

    def inputs(self, batch: EncodedBatch, device: torch.device) -> torch.Tensor:
        """The batch's normalised inputs, ``(n, C, size, size)`` float32 on ``device``; each
        group of decoded images is cropped and let go before the next is decoded."""
        mode = "bicubic" if self.interpolation == "bicubic" else "bilinear"
        boxes, flips = batch.boxes.tolist(), batch.flips.tolist()
        out: list[Any] = [None] * len(batch)
        for k, image in decode_on(batch, device, self.channels):
            top, left, height, width = boxes[k]
            crop = image[:, top : top + height, left : left + width].unsqueeze(0).float()
            resized = F.interpolate(
                crop, size=(self.size, self.size), mode=mode, antialias=True, align_corners=False
            )
            out[k] = resized.flip(-1) if flips[k] else resized
        x = torch.cat(out).clamp_(0, 255).round_().div_(255)
        mean = torch.tensor(self.mean, device=device).view(1, -1, 1, 1)
        std = torch.tensor(self.std, device=device).view(1, -1, 1, 1)
        return x.sub_(mean).div_(std)


def decode_on(
    batch: EncodedBatch, device: torch.device, channels: int = 3
) -> Iterator[tuple[int, torch.Tensor]]:
    """Each sample's index and uint8 pixels on ``device``: the worker-decoded ones copied, then
    the JPEGs decoded there in groups of at most :data:`DECODE_GROUP_BYTES` decoded bytes."""
    sizes = batch.sizes.tolist()
    for k, encoded in enumerate(batch.encoded):
        if not encoded:
            yield k, batch.payload(k).to(device, non_blocking=True)
    jpegs = [k for k, encoded in enumerate(batch.encoded) if encoded]
    group: list[int] = []
    group_bytes = 0
    for position, k in enumerate(jpegs):
        height, width = sizes[k]
        group.append(k)
        group_bytes += height * width * channels
        if group_bytes >= DECODE_GROUP_BYTES or position == len(jpegs) - 1:
            decoded = _decode_jpegs([batch.payload(j) for j in group], channels, device)
            yield from zip(group, decoded, strict=True)
            del decoded  # before the next group is decoded
            group, group_bytes = [], 0


def _decode_jpegs(
    data: list[torch.Tensor], channels: int, device: torch.device
) -> list[torch.Tensor]:
    """JPEG bytes decoded on ``device`` in one batched call; where that call fails (a JPEG
    variant the device's decoder lacks), each on the CPU and copied."""
    from torchvision.io import ImageReadMode, decode_jpeg

    from bigbatch.memory.oom import is_oom

    mode = ImageReadMode.GRAY if channels == 1 else ImageReadMode.RGB
    with warnings.catch_warnings():
        # torchvision 0.29 says its image codecs move to TorchCodec; they decode the same.
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            return list(decode_jpeg(data, mode=mode, device=device))
        except RuntimeError as exc:
            if is_oom(exc):
                raise
        return [decode_jpeg(one, mode=mode).to(device, non_blocking=True) for one in data]
