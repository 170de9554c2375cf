"""The image layer every image task shares (classification, regression, 2D tasks of your own):
how a set of images is stored and read (8-bit through PIL, 16-bit, float and DICOM as floats),
the model's own data config and timm's transforms, a dataset over images with any kind of
target, and the timm (or ``model=``) network with as many outputs as the task needs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from bigbatch.backoff import EvalBackoff, infer_fitting
from bigbatch.images import ImageInfo, UnreadableImageError, probe, read_pixels, scale_for
from bigbatch.models import MEAN, STD, UnknownArchitectureError, timm_factory
from bigbatch.train.config import ConfigError, TrainConfig
from bigbatch.train.data import DataError, make_loader, seed_python_from_torch
from bigbatch.train.tasks import planned_eval_batch
from bigbatch.train.tasks.base import inference_placement
from bigbatch.train.tasks.device_images import DeviceAugment, EncodedImages
from bigbatch.train.tasks.user_model import load_user_model

__all__ = [
    "DEFAULT_DATA",
    "ImageDataset",
    "ImageFormat",
    "build_model",
    "build_transforms",
    "check_images",
    "device_images",
    "format_of",
    "parse_window",
    "resolve_data_config",
    "tta_mean",
]


@dataclass(frozen=True)
class ImageFormat:
    """How a set's images become tensors, the same in training and prediction (saved in the
    run): 1 channel when every image is greyscale, else 3; ``wide`` images (16-bit, float,
    DICOM) read as floats (:func:`bigbatch.images.read_pixels`) and divided by ``scale``,
    DICOM through ``window``; 8-bit ones through PIL and timm's transforms.

    >>> fmt = ImageFormat(grey=True)
    >>> fmt.channels, ImageFormat.from_dict(fmt.to_dict()) == fmt
    (1, True)
    """

    grey: bool = False
    wide: bool = False
    scale: float = 0.0
    window: tuple[float, float] | None = None

    @property
    def channels(self) -> int:
        return 1 if self.grey else 3

    def to_dict(self) -> dict[str, Any]:
        return {"grey": self.grey, "wide": self.wide, "scale": self.scale, "window": self.window}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> ImageFormat:
        """A run's saved format (runs from before it was saved: 8-bit RGB)."""
        if not d:
            return cls()
        window = d.get("window")
        centre_width = (float(window[0]), float(window[1])) if window else None
        return cls(bool(d["grey"]), bool(d["wide"]), float(d["scale"]), centre_width)


def check_images(
    files: list[Path], labels: list[int], bad_images: str
) -> tuple[list[Path], list[int], list[tuple[Path, str]], ImageFormat]:
    """Every image probed (its header, not its pixels): ``(kept files, their labels, skipped
    (file, why), the set's format)``. ``bad_images``: ``skip`` an unreadable image (and say
    so), or ``error`` (a DataError naming it). ``labels`` may be indices into any targets.

    >>> import tempfile
    >>> from PIL import Image
    >>> path = Path(tempfile.mkdtemp()) / "a.png"; Image.new("L", (8, 8)).save(path)
    >>> kept, index, skipped, fmt = check_images([path], [0], "error")
    >>> index, skipped, fmt.channels
    ([0], [], 1)
    """
    keep_f, keep_l, skipped, infos = [], [], [], []
    for f, label in zip(files, labels, strict=True):
        try:
            infos.append(probe(f))
        except ModuleNotFoundError:
            raise  # a missing library (Pillow, pydicom), not a bad image: named by the CLI
        except Exception as exc:
            problem = (
                str(exc)
                if isinstance(exc, UnreadableImageError)
                else f"{type(exc).__name__}: {exc}"
            )
            if bad_images == "error":
                raise DataError(
                    f"cannot read image {f}: {problem}; remove it, or set bad_images=skip"
                ) from None
            skipped.append((f, problem))
            continue
        keep_f.append(f)
        keep_l.append(label)
    return keep_f, keep_l, skipped, format_of(infos)


def parse_window(text: str) -> tuple[float, float] | None:
    """``window=40,400``: a DICOM window's centre and width (here CT soft tissue, in HU).

    >>> parse_window("40,400"), parse_window("")
    ((40.0, 400.0), None)
    """
    if not text.strip():
        return None
    try:
        centre, width = (float(v) for v in text.split(","))
    except ValueError:
        centre, width = 0.0, 0.0
    if not width > 0:
        raise DataError(f"window={text!r}: give a centre and a width > 0, e.g. window=40,400")
    return centre, width


def format_of(infos: Sequence[ImageInfo], window: tuple[float, float] | None = None) -> ImageFormat:
    """The format a set of images trains in: greyscale only if all are; wide (read as floats)
    if any is; the scale from the widest value of the wide ones."""
    wide = [i for i in infos if i.depth != "8bit"]
    peaks = [i.peak for i in wide if i.depth == "high"]
    return ImageFormat(
        grey=bool(infos) and all(i.grey for i in infos),
        wide=bool(wide),
        scale=scale_for(max(peaks)) if peaks else 0.0,
        window=window,
    )


# The training crop's share of the image's area, the CPU's transforms and the GPU's alike.
TRAIN_CROP_SCALE = (0.75, 1.0)

DEFAULT_DATA: dict[str, Any] = {
    "mean": MEAN,
    "std": STD,
    "interpolation": "bilinear",
    "crop_pct": 0.875,
}


def resolve_data_config(factory: Callable[[], Any], channels: int = 3) -> dict[str, Any]:
    """The model's own input normalisation, interpolation and crop (timm's
    ``resolve_model_data_config``: ViT augreg's 0.5/0.5, CLIP's, inception's ...), built on the
    meta device (no weights, no memory); a model without timm's ``pretrained_cfg`` gets
    ImageNet's. For 1-channel data the means of the three channels' statistics.

    >>> resolve_data_config(lambda: torch.nn.Linear(2, 2), channels=1)["mean"]
    [0.449]
    """
    from timm.data import resolve_model_data_config

    with torch.device("meta"):
        model = factory()
    if getattr(model, "pretrained_cfg", None) is None:
        resolved = dict(DEFAULT_DATA)
    else:
        resolved = resolve_model_data_config(model)
    mean, std = tuple(resolved["mean"]), tuple(resolved["std"])
    if channels == 1 and len(mean) == 3:
        mean, std = (sum(mean) / 3,), (sum(std) / 3,)
    return {
        "mean": [float(m) for m in mean],
        "std": [float(s) for s in std],
        "interpolation": str(resolved.get("interpolation", "bilinear")),
        "crop_pct": float(resolved.get("crop_pct") or 0.875),
    }


def build_transforms(
    size: int,
    item_transform: str,
    *,
    train: bool,
    augment: bool,
    flip: bool = False,
    data: dict[str, Any] | None = None,
    fmt: ImageFormat | None = None,
    auto_augment: str = "",
) -> Callable[[Any], torch.Tensor]:
    """The item transform: timm's ``create_transform`` for 8-bit images (resize by
    ``item_transform``: squish or centre crop; when training, a random resized crop of 75-100 %
    of the image, a horizontal flip and ``auto_augment``, e.g. ``rand-m9-mstd0.5``), the same
    geometry on float tensors for wide images (16-bit, float, DICOM); both normalised with the
    model's ``data`` config. ``flip`` adds a certain horizontal flip (a TTA pass).

    >>> from PIL import Image
    >>> tf = build_transforms(32, "squish", train=True, augment=True)
    >>> tuple(tf(Image.new("RGB", (64, 48))).shape)
    (3, 32, 32)
    """
    data = data or DEFAULT_DATA
    fmt = fmt or ImageFormat()
    if fmt.wide:
        return _tensor_transforms(size, item_transform, train and augment, flip, data)
    from timm.data import create_transform
    from torchvision.transforms import v2 as T

    channels = fmt.channels
    common: dict[str, Any] = {
        "input_size": (channels, size, size),
        "interpolation": data["interpolation"],
        "mean": tuple(data["mean"]),
        "std": tuple(data["std"]),
    }
    if train and augment:
        out = create_transform(
            **common,
            is_training=True,
            scale=TRAIN_CROP_SCALE,
            color_jitter=0.0,
            auto_augment=auto_augment or None,
        )
    else:
        out = create_transform(
            **common,
            is_training=False,
            crop_pct=1.0 if item_transform == "squish" else data["crop_pct"],
            crop_mode="squash" if item_transform == "squish" else "center",
        )
    return T.Compose([T.RandomHorizontalFlip(p=1.0), out]) if flip else out


def _tensor_transforms(
    size: int, item_transform: str, augment: bool, flip: bool, data: dict[str, Any]
) -> Callable[[Any], torch.Tensor]:
    from torchvision.transforms import v2 as T

    mode = (
        T.InterpolationMode.BICUBIC
        if data["interpolation"] == "bicubic"
        else T.InterpolationMode.BILINEAR
    )
    if augment:
        steps: list[Any] = [
            T.RandomResizedCrop(size, scale=TRAIN_CROP_SCALE, interpolation=mode, antialias=True),
            T.RandomHorizontalFlip(),
        ]
    elif item_transform == "squish":
        steps = [T.Resize((size, size), interpolation=mode, antialias=True)]
    else:
        steps = [
            T.Resize(int(size / data["crop_pct"]), interpolation=mode, antialias=True),
            T.CenterCrop(size),
        ]
    if flip:
        steps.append(T.RandomHorizontalFlip(p=1.0))
    steps.append(T.Normalize(data["mean"], data["std"]))
    return T.Compose(steps)


class ImageDataset(Dataset[tuple[torch.Tensor, int]]):
    """(image tensor, label): 8-bit images through PIL (greyscale or RGB by ``fmt``), wide
    ones read as floats in [0, 1] (:func:`bigbatch.images.read_pixels`), then ``transform``.
    A label may be any target (a class index, a row of tags, values).

    >>> import tempfile
    >>> from PIL import Image
    >>> path = Path(tempfile.mkdtemp()) / "a.png"; Image.new("RGB", (40, 30)).save(path)
    >>> tf = build_transforms(32, "squish", train=False, augment=False)
    >>> x, y = ImageDataset([path], [torch.tensor([1.0, 0.0])], tf)[0]
    >>> tuple(x.shape), y.tolist()
    ((3, 32, 32), [1.0, 0.0])
    """

    def __init__(
        self,
        files: Sequence[Path],
        labels: Sequence[int] | None,
        transform: Callable[[Any], torch.Tensor],
        fmt: ImageFormat | None = None,
    ) -> None:
        self.files = list(files)
        self.labels = list(labels) if labels is not None else [-1] * len(self.files)
        self.transform = transform
        self.fmt = fmt or ImageFormat()

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        fmt = self.fmt
        if fmt.wide:
            pixels = read_pixels(self.files[i], scale=fmt.scale, grey=fmt.grey, window=fmt.window)
            return self.transform(torch.from_numpy(pixels)), self.labels[i]
        from PIL import Image, ImageOps

        with Image.open(self.files[i]) as im:
            # Cameras store the orientation in EXIF: a photo taken upright must train upright.
            image = ImageOps.exif_transpose(im).convert("L" if fmt.grey else "RGB")
        seed_python_from_torch()
        return self.transform(image), self.labels[i]


def device_images(
    dataset: Any, cfg: TrainConfig, data: dict[str, Any], auto_augment: str = ""
) -> tuple[EncodedImages, DeviceAugment] | str:
    """The training set of an :class:`ImageDataset` read as files for decoding and augmenting
    on the device (:mod:`bigbatch.train.tasks.device_images`: the same crops and flips), or why
    it cannot be (the fix for ``decode=gpu``): what a task's ``Task.device_images`` returns.

    >>> device_images([], None, {})  # not an ImageDataset
    "its samples are not images read by bigbatch's image layer"
    """
    if not isinstance(dataset, ImageDataset):
        return "its samples are not images read by bigbatch's image layer"
    if dataset.fmt.wide:
        return "16-bit, float and DICOM images are read as floats on the CPU"
    if not cfg.augment:
        return "augment=false resizes without random crops; decode=gpu augments"
    if auto_augment:
        return f"auto_augment={auto_augment} runs PIL's operations on the CPU"
    if data["interpolation"] not in ("bilinear", "bicubic"):
        return f"the model's interpolation {data['interpolation']!r} is PIL's alone"
    encoded = EncodedImages(
        dataset.files, dataset.labels, grey=dataset.fmt.grey, scale=TRAIN_CROP_SCALE
    )
    augment = DeviceAugment(
        cfg.size,
        dataset.fmt.channels,
        data["interpolation"],
        tuple(data["mean"]),
        tuple(data["std"]),
    )
    return encoded, augment


def build_model(cfg: TrainConfig, num_classes: int, in_chans: int = 3) -> Callable[[], nn.Module]:
    """A zero-argument factory for the configured model (timm by name, or module:factory);
    ``in_chans`` 1 for greyscale data (timm adapts a pretrained stem).

    >>> from bigbatch.train.config import load_config
    >>> factory = build_model(load_config(overrides=["data=x", "arch=test_resnet"]), 4)
    >>> factory().eval()(torch.zeros(1, 3, 32, 32)).shape
    torch.Size([1, 4])
    """
    if cfg.model:
        user = load_user_model(cfg.model)

        def build_user() -> nn.Module:
            return user(num_classes)

        return build_user

    try:
        return timm_factory(
            cfg.arch,
            num_classes=num_classes,
            img_size=cfg.size,
            in_chans=in_chans,
            weights=cfg.weights or None,
            pretrained=cfg.pretrained,
        )
    except (UnknownArchitectureError, ValueError) as exc:  # an unknown name, unreadable weights
        raise ConfigError(str(exc)) from exc


def tta_mean(
    forward: Callable[[torch.Tensor], np.ndarray],
    files: Sequence[Path],
    *,
    tta: int,
    size: int,
    item_transform: str,
    data: dict[str, Any] | None,
    fmt: ImageFormat,
    batch_size: int,
    seed: int = 0,
) -> np.ndarray:
    """The mean over ``tta`` test-time passes of ``forward(batch)`` (one row per image) over
    ``files``: pass 0 the validation transform, pass 1 its horizontal flip, further passes the
    training augmentation, each seeded (``seed + pass``), so a prediction is repeatable."""
    if not files:
        raise DataError("no images to predict: give a folder (or list) that holds some")
    total: np.ndarray | float = 0.0
    for k in range(tta):
        transform = build_transforms(
            size, item_transform, train=k >= 2, augment=k >= 2, flip=k == 1, data=data, fmt=fmt
        )
        torch.manual_seed(seed + k)
        loader = make_loader(
            ImageDataset(files, None, transform, fmt),
            batch_size,
            shuffle=False,
            seed=seed,
            num_workers=0,
        )
        with torch.no_grad():
            rows = [forward(x) for x, _ in loader]
        total = total + (np.concatenate(rows) if rows else 0.0)
    return np.asarray(total, dtype=np.float64) / tta


def predict_batch(
    factory: Callable[[], nn.Module],
    shape: tuple[int, ...],
    device: torch.device,
    budget: str,
    *,
    precision: str = "fp32",
    largest: int = 512,
) -> int:
    """``bigbatch predict --budget``: the most images one forward pass may take under
    ``budget`` on ``device``, from a prediction of the no-grad step (the weights alone: no
    optimizer state at prediction) at the input ``shape``; 1 where even one is over (the OOM
    back-off then guards it)."""
    from bigbatch.memory.evaluate import plan_evaluation_batch, predict_evaluation_peak
    from bigbatch.memory.plan import default_overhead, resolve_budget, usable_bytes
    from bigbatch.memory.step import StepSpec

    try:
        usable = usable_bytes(
            resolve_budget(budget, device), default_overhead(budget, device), device
        )
    except ValueError as exc:
        raise ConfigError(f"--budget {budget}: {exc}") from None

    def peak(b: int) -> int:
        spec = StepSpec(factory, shape, b, "sgd", cast(Any, precision), device.type)
        return predict_evaluation_peak(spec, state_copies=0).planning_bytes

    return plan_evaluation_batch(peak, largest, usable, shape).batch


def predict_images(
    run: Any,
    outputs: int,
    files: Sequence[Path],
    head: Callable[[torch.Tensor], np.ndarray],
    *,
    tta: int,
    device: torch.device,
    item_transform: str = "squish",
    batch_size: int | None = None,
    budget: str = "",
    seed: int = 0,
) -> np.ndarray:
    """A finished image run's predictions of ``files``, one row each: ``head`` of the model's
    ``outputs`` for a batch (probabilities, values in the targets' units), averaged over
    ``tta`` passes (:func:`tta_mean`). ``run`` is a :class:`~bigbatch.train.trained_run.TrainedRun`;
    ``batch_size`` images a forward pass (None: planned under ``budget`` when one is given,
    else the run's planned validation batch on this kind of device, else 64); an OOM runs a
    batch again in smaller pieces.

    >>> probabilities = lambda logits: torch.sigmoid(logits.float()).cpu().numpy()
    >>> # rows = predict_images(TrainedRun.open("runs/a"), 4, files, probabilities, tta=2,
    >>> #                       device=torch.device("cpu"))  # [len(files), 4]
    """
    cfg, info = run.config, run.info
    fmt = ImageFormat.from_dict(info.get("format"))
    factory = build_model(cfg, outputs, fmt.channels)
    model, where = inference_placement(run.load_into(factory()), cfg, device)
    if budget and not batch_size:
        shape = (fmt.channels, cfg.size, cfg.size)
        batch_size = predict_batch(factory, shape, device, budget, precision=where.precision)
    batch_size = batch_size or planned_eval_batch(run.run_dir, device)
    backoff = EvalBackoff()  # kept across the passes: a size that ran out once is not retried

    def forward(x: torch.Tensor) -> torch.Tensor:
        with where.autocast():
            return model(x)

    def rows(x: torch.Tensor) -> np.ndarray:
        return head(infer_fitting(forward, where.inputs(x), backoff))

    mean = tta_mean(
        rows,
        files,
        tta=tta,
        size=cfg.size,
        item_transform=item_transform,
        data=info.get("data"),
        fmt=fmt,
        batch_size=batch_size,
        seed=seed,
    )
    return mean.reshape(len(files), -1)
