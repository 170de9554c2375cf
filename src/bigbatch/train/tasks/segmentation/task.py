"""Segmentation of 2D images and 3D volumes with MONAI: its networks, per-sample losses (exact
under accumulation), per-case metrics and sliding-window inference; bigbatch adds the checks,
the plan and exact accumulation."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from bigbatch.backoff import EvalBackoff, OutOfMemoryAtMinimumError
from bigbatch.device import free_memory
from bigbatch.memory.oom import is_oom
from bigbatch.models import read_weights
from bigbatch.segmentation.decoders import smp_factory
from bigbatch.segmentation.losses import BATCH_LOSSES, batch_loss, per_sample_loss
from bigbatch.segmentation.metrics import CaseScores, parse_regions
from bigbatch.segmentation.networks import MONAI_ARCHS, build_network, size_multiple
from bigbatch.train.config import ConfigError, TrainConfig
from bigbatch.train.data import split_items
from bigbatch.train.optim import head_parameters
from bigbatch.train.tasks.base import Metrics, Task, ValidShape
from bigbatch.train.tasks.segmentation.data import (
    SegDataset,
    SegItems,
    VolumeRecipe,
    case_shape,
    scan_segmentation,
    volume_suffix,
)
from bigbatch.train.tasks.segmentation.options import SegmentationOptions
from bigbatch.train.tasks.user_model import load_user_model

__all__ = [
    "SegmentationTask",
    "SegmentationValidation",
    "build_seg_model",
    "seg_settings",
    "sliding_window_fitting",
]

Log = Callable[[str], None]


@dataclass(frozen=True)
class SegSettings:
    """The segmentation keys of a config, parsed and checked once."""

    widths: tuple[int, ...]
    spacing: tuple[float, ...]
    regions: dict[str, tuple[int, ...]]
    multiple: int  # spatial sizes divide by this


def seg_settings(cfg: TrainConfig, dims: int | None = None) -> SegSettings:
    """Parse ``widths``, ``spacing`` and ``regions``; ConfigError with the fix."""
    try:
        widths = tuple(int(w) for w in cfg.options.widths.replace(" ", "").split(",") if w)
        spacing = tuple(float(s) for s in cfg.options.spacing.replace(" ", "").split(",") if s)
    except ValueError as exc:
        raise ConfigError(
            f"widths={cfg.options.widths!r} / spacing={cfg.options.spacing!r}: give numbers separated by "
            "commas, e.g. widths=16,32,64,128 spacing=1,1,1"
        ) from exc
    if widths and (len(widths) < 2 or min(widths) < 1):
        raise ConfigError(f"widths={cfg.options.widths!r}: two or more positive channel counts")
    if len(spacing) == 1:
        spacing = spacing * 3
    if spacing and (len(spacing) != 3 or min(spacing) <= 0 or not all(map(math.isfinite, spacing))):
        raise ConfigError(f"spacing={cfg.options.spacing!r}: a voxel size in mm, e.g. 1,1,1 (or 1)")
    if spacing and dims == 2:
        raise ConfigError(
            "spacing= resamples volumes (from their NIfTI header); 2D images are resized to size="
        )
    try:
        regions = parse_regions(cfg.options.regions)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    multiple = size_multiple(cfg.arch, widths) if _monai_network(cfg) else 32
    if cfg.model:
        multiple = 1
    return SegSettings(widths, spacing, regions, multiple)


def _monai_network(cfg: TrainConfig) -> bool:
    return cfg.arch in MONAI_ARCHS and not cfg.model and not cfg.options.encoder


def build_seg_model(
    cfg: TrainConfig, in_channels: int, num_classes: int, dims: int
) -> Callable[[], nn.Module]:
    """With ``encoder=``: smp's ``arch`` decoder (unet, unetplusplus, fpn, deeplabv3plus) on
    that timm encoder (2D); arch=unet|segresnet|dynunet|swinunetr|unetr: MONAI's network (2D or
    3D); any other name: smp's U-Net on that timm encoder (2D);
    model=module:factory(in_channels, num_classes) for your own. ``weights=`` loads a local
    weights file into it (an earlier run's, a MONAI bundle's ``model.pt``)."""
    encoder = cfg.options.encoder
    if cfg.model:
        user = load_user_model(cfg.model)
        build: Callable[[], nn.Module] = lambda: user(in_channels, num_classes)  # noqa: E731
    elif dims == 3 and (encoder or cfg.arch not in MONAI_ARCHS):
        raise ConfigError(
            f"{'encoder=' + encoder if encoder else 'arch=' + cfg.arch}: timm encoders are 2D; "
            f"train volumes with one of MONAI's networks ({', '.join(MONAI_ARCHS)}) or "
            "model=module:factory"
        )
    elif encoder or cfg.arch not in MONAI_ARCHS:
        # smp's decoder on a timm encoder; arch=<timm name> is its U-Net on that encoder.
        arch, encoder = (cfg.arch, encoder) if encoder else ("unet", cfg.arch)
        try:
            build = smp_factory(
                arch,
                encoder,
                in_channels=in_channels,
                num_classes=num_classes,
                norm=cfg.options.norm,
                pretrained=cfg.pretrained,
            )
        except ValueError as exc:  # an unknown name, no cached weights, a norm it lacks
            raise ConfigError(str(exc)) from exc
    else:
        if cfg.pretrained:
            raise ConfigError(
                f"arch={cfg.arch} has no pretrained weights to download: give weights=FILE (an "
                "earlier run's best.safetensors, a MONAI bundle's model.pt), or a timm encoder "
                "under a decoder with pretrained=true (arch=unet encoder=resnet34, 2D)"
            )
        widths = seg_settings(cfg, dims).widths

        def build() -> nn.Module:
            return build_network(
                cfg.arch,
                in_channels,
                num_classes,
                dims=dims,
                size=cfg.size,
                widths=widths,
                norm=cfg.options.norm,
            )

    if not cfg.weights:
        return build
    weights = cfg.weights

    def build_with_weights() -> nn.Module:
        model = build()
        if next(iter(model.parameters()), torch.empty(0)).is_meta:
            return model  # the planner's shapes-only copy
        _load_checked(model, weights, cfg)
        return model

    return build_with_weights


def _load_checked(model: nn.Module, weights: str, cfg: TrainConfig) -> None:
    """Load ``weights``; every tensor but the output layer's (another class count) must fit."""
    try:
        state = read_weights(weights)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    own = model.state_dict()
    head = {n for n, p in model.named_parameters() if id(p) in head_parameters(model)}
    usable = {n: t for n, t in state.items() if n in own and own[n].shape == t.shape}
    unmatched = [n for n in own if n not in usable]
    if [n for n in unmatched if n not in head]:
        raise ConfigError(
            f"weights={weights} does not fit this network: {len(unmatched)} of its {len(own)} "
            f"tensors have no match in the file (e.g. {unmatched[0]}). Give weights of the same "
            f"arch= ({cfg.arch}), widths= and norm=, or an earlier run's best.safetensors"
        )
    model.load_state_dict(usable, strict=False)


@dataclass
class SegmentationValidation:
    """valid_loss (per-sample mean, weighted by samples) and the per-case scores."""

    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    scores: CaseScores
    loss_sum: float = 0.0
    count: int = 0
    names: list[str] = field(default_factory=list)

    def update(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        logits = logits.float()
        self.loss_sum += float(self.loss_fn(logits, targets)) * len(targets)
        self.count += len(targets)
        self.scores.update(logits, targets)

    def as_dict(self) -> dict[str, float]:
        loss = self.loss_sum / self.count if self.count else float("nan")
        return {"valid_loss": loss} | self.scores.compute()


def _silent(_: str) -> None:
    pass


class SegmentationTask(Task):
    name = "segmentation"

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.options = cast(SegmentationOptions, cfg.options)  # its own keys
        self.classes: list[str] = []
        self.num_classes = 1
        self.dims = 2
        self.channels = 3
        self.void: int | None = None
        self.binary_255 = False
        self.settings = seg_settings(cfg)
        self.log: Log = _silent
        self.window_batch = 1  # patches per forward pass in sliding-window validation (planned)
        self.window_backoff = EvalBackoff()

    def prepare(self, log: Log, data: Any = None) -> tuple[Any, Any]:
        cfg = self.cfg
        self.log = log
        if data is not None:
            train_items, valid_items = data
        else:
            void, palette = cfg.options.ignore_index, cfg.options.palette
            items = scan_segmentation(
                cfg.data,
                cfg.image_root,
                cfg.options.num_classes,
                ignore_index=void,
                palette=palette,
            )
            if cfg.valid:
                valid_items = scan_segmentation(
                    cfg.valid,
                    cfg.image_root,
                    items.num_classes,
                    ignore_index=void,
                    palette=palette,
                    like=items,
                )
                train_items = items
            else:
                train_items, valid_items = split_items(items, cfg.valid_pct, cfg.seed)
        self.num_classes, self.dims = train_items.num_classes, train_items.dims
        self.channels, self.classes = train_items.channels, train_items.classes
        self.void, self.binary_255 = train_items.void, train_items.binary_255
        self.settings = seg_settings(cfg, self.dims)
        self._check_settings(train_items)
        kind = "binary" if self.num_classes == 1 else f"{self.num_classes} classes"
        void_note = f", void label {self.void}" if self.void is not None else ""
        what = "images" if self.dims == 2 else "volumes"
        shape = "x".join([str(cfg.size)] * self.dims)
        log(
            f"data: {len(train_items)} training and {len(valid_items)} validation {what} "
            f"({self.channels} channel(s), {kind}{void_note}), trained at {shape}"
        )
        return train_items, valid_items

    def _check_settings(self, items: SegItems) -> None:
        cfg, s = self.cfg, self.settings
        # MONAI's networks normalise each sample at the bottom too: it needs 2 voxels there.
        least = 2 * s.multiple if _monai_network(cfg) else s.multiple
        if cfg.size % s.multiple or cfg.size < least:
            fit = max(least, cfg.size // s.multiple * s.multiple)
            raise ConfigError(
                f"size={cfg.size}: arch={cfg.arch} halves it down to 1/{s.multiple}, so it must "
                f"be a multiple of {s.multiple}, at least {least}; use size={fit}"
            )
        if self.dims == 2 and cfg.options.changed("pos_neg"):
            raise ConfigError(
                f"pos_neg={cfg.options.pos_neg} sets the odds of a volume's patches; 2D images "
                "are resized whole to size=: drop it"
            )
        if s.spacing and any(volume_suffix(f[0]) == ".npy" for f in items.images):
            raise ConfigError(
                "spacing= resamples by the voxel size in each NIfTI header; .npy volumes have "
                "none: resample them beforehand, or store them as NIfTI"
            )
        top = max((max(r) for r in s.regions.values()), default=0)
        if top >= max(self.num_classes, 2):
            raise ConfigError(
                f"regions={cfg.options.regions!r} names label {top}, but the masks have "
                f"{self.num_classes} classes (0..{max(self.num_classes, 2) - 1})"
            )

    def model_factory(self) -> Callable[[], nn.Module]:
        return build_seg_model(self.cfg, self.channels, self.num_classes, self.dims)

    def input_shape(self) -> tuple[int, ...]:
        return (self.channels, *[self.cfg.size] * self.dims)

    def recipe(self) -> VolumeRecipe:
        return VolumeRecipe(
            self.cfg.size, self.settings.spacing, self.options.pos_neg, self.settings.multiple
        )

    def datasets(self, train_items: Any, valid_items: Any) -> tuple[Any, Any]:
        size, augment, recipe = self.cfg.size, self.cfg.augment, self.recipe()
        sets = (
            SegDataset(train_items, size, train=True, augment=augment, recipe=recipe),
            SegDataset(valid_items, size, train=False, augment=False, recipe=recipe),
        )
        return self._cached(*sets)

    def _cached(self, train_set: SegDataset, valid_set: SegDataset) -> tuple[Any, Any]:
        """Each set's cases kept after preprocessing, as many as ``cache=`` allows (training's
        first), through MONAI's CacheDataset."""
        from bigbatch.train.tasks.segmentation.cache import CachedCases, cache_budget, case_bytes

        budget = cache_budget(self.options.cache, max(self.cfg.num_workers, 0))
        if not budget or not len(train_set):
            return train_set, valid_set
        per_case = case_bytes(train_set)
        threads = min(4, os.cpu_count() or 1)
        counts = []
        for dataset in (train_set, valid_set):
            counts.append(min(len(dataset), budget // per_case))
            budget -= counts[-1] * per_case
        self.log(
            f"cache: {counts[0]} of {len(train_set)} training and {counts[1]} of "
            f"{len(valid_set)} validation cases kept after preprocessing ({per_case / 2**20:.1f} "
            "MiB each; MONAI's CacheDataset; cache=none reads them every epoch)"
        )
        return tuple(  # type: ignore[return-value]
            CachedCases(d, n, threads) if n else d
            for d, n in zip((train_set, valid_set), counts, strict=True)
        )

    def valid_shape(self, valid_items: Any) -> ValidShape:
        """2D: images resized to the training size. 3D: the sliding window's patches of the
        training size, beside the largest volume (padded to the network's multiple; its
        resampled size under ``spacing``) held on the device as input, logits and MONAI's
        count map, and its logits again in the metrics."""
        if self.dims == 2 or not len(valid_items):
            return ValidShape(self.input_shape())
        spatial = self._largest_volume(valid_items)
        voxels = math.prod(spatial)
        outputs = max(self.num_classes, 2)
        held = 4 * voxels * (self.channels + 2 * outputs + 1)  # float32 throughout
        return ValidShape(
            self.input_shape(),
            held,
            f"{self.cfg.size}^3 patches of volumes up to {'x'.join(map(str, spatial))}",
        )

    def _largest_volume(self, items: SegItems) -> tuple[int, ...]:
        """The largest validation volume's grid, dimension by dimension, from the headers."""
        multiple = self.settings.multiple
        largest = [0, 0, 0]
        for files in items.images:
            spatial = case_shape(files)[1:]
            zooms = _voxel_size(files[0]) if self.settings.spacing else None
            if zooms is not None:  # resampled to the training spacing first
                spatial = tuple(
                    math.ceil(n * z / s)
                    for n, z, s in zip(spatial, zooms, self.settings.spacing, strict=True)
                )
            largest = [max(a, n + -n % multiple) for a, n in zip(largest, spatial, strict=True)]
        return tuple(largest)

    def use_valid_batch(self, planned: int) -> int:
        if self.dims == 2:
            return planned
        self.window_batch = planned  # whole volumes differ in size: one a batch, its patches
        return 1

    def infer(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Validation's forward: whole 2D images at once; volumes in overlapping patches of the
        training size (MONAI's sliding-window inference, Gaussian-weighted), as many a forward
        pass as planned, fewer after an OOM."""
        if self.dims == 2:
            return model(x)
        roi = (self.cfg.size,) * 3
        return sliding_window_fitting(model, x, roi, self.window_batch, self.window_backoff)

    @property
    def couples_samples(self) -> bool:
        """A batch loss: the loop runs it through gradient caching (``run_coupled_window``)."""
        return self.options.loss in BATCH_LOSSES

    @property
    def loss_name(self) -> str:
        return self.options.loss

    def window_cache_bytes(self, window: int, precision: str) -> int:
        """What gradient caching holds for a window of ``window`` patches besides each
        micro-batch's step (:func:`bigbatch.memory.window_cache.window_cache_bytes`)."""
        from bigbatch.memory.window_cache import window_cache_bytes

        spatial = (self.cfg.size,) * self.dims
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
        targets = torch.zeros((window, *spatial), dtype=torch.long)
        return window_cache_bytes(
            self.loss, (max(self.num_classes, 1), *spatial), targets, dtype=dtype
        )

    def _loss_fn(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        name = self.options.loss
        make = batch_loss if name in BATCH_LOSSES else per_sample_loss
        return make(name, num_classes=self.num_classes, ignore_index=self.void)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "_loss"):
            self._loss = self._loss_fn()
        # Half-precision logits (autocast) in float32; float64 stays float64.
        return self._loss(logits.to(torch.promote_types(logits.dtype, torch.float32)), targets)

    def metrics(self) -> Metrics:
        scores = CaseScores(
            self.num_classes,
            names=self.classes,
            regions=self.settings.regions,
            void=self.void,
            spacing=self.settings.spacing,
        )
        return SegmentationValidation(self._loss_fn(), scores, names=self.classes)

    def scores(self, row: dict[str, Any]) -> str:
        text = f"valid loss {row['valid_loss']:.4f}  dice {row['dice']:.4f}  "
        if self.settings.regions:
            text += " ".join(f"{n} {row[f'dice_{n}']:.3f}" for n in self.settings.regions) + "  "
        if "hd95" in row:
            text += f"hd95 {row['hd95']:.1f}  "
        return text

    def run_info(self) -> dict[str, Any]:
        return {
            "task": self.name,
            "classes": self.classes,
            "num_classes": self.num_classes,
            "dims": self.dims,
            "channels": self.channels,
            "void": self.void,
            "binary_255": self.binary_255,
            "multiple": self.settings.multiple,
        }


def _voxel_size(path: Any) -> tuple[float, ...] | None:
    """A NIfTI volume's voxel size in mm, from its header (None for .npy: no header)."""
    if volume_suffix(path) == ".npy":
        return None
    import nibabel

    header: Any = nibabel.load(str(path)).header
    return tuple(float(z) for z in header.get_zooms()[:3])


def sliding_window_fitting(
    model: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    roi: tuple[int, ...],
    window_batch: int,
    backoff: EvalBackoff,
    *,
    overlap: float = 0.25,
    gather: torch.device | None = None,
) -> torch.Tensor:
    """MONAI's Gaussian-weighted sliding-window inference over ``x`` with ``window_batch``
    patches a forward pass (``backoff.chunk`` once an OOM has halved it), the output gathered
    on ``gather`` (default: ``x``'s device); an OOM at one patch gathers it on the CPU instead
    (the patches still run on the device, and the result is on the CPU). Each patch's output
    is its own whatever the batch (up to the kernels' round-off at another batch size): so is
    the result.

    >>> net = torch.nn.Conv3d(1, 2, 3, padding=1)
    >>> sliding_window_fitting(net, torch.zeros(1, 1, 8, 8, 8), (4, 4, 4), 2, EvalBackoff()).shape
    torch.Size([1, 2, 8, 8, 8])
    """
    from monai.inferers import sliding_window_inference

    gather = gather or x.device
    while True:
        size = min(backoff.chunk or window_batch, window_batch)
        failure = ""
        try:
            out = sliding_window_inference(
                x, roi, size, model, overlap=overlap, mode="gaussian", device=gather
            )
            return torch.as_tensor(out)
        except Exception as exc:
            if not is_oom(exc):
                raise
            failure = f"{type(exc).__name__}: {str(exc)[:200]}"
        free_memory(False)  # the exception and the failed pass's tensors are gone by now
        if size > 1:
            backoff.chunk = size // 2
        elif gather.type != "cpu":
            gather = torch.device("cpu")  # the whole volume's output off the device
        else:
            raise OutOfMemoryAtMinimumError(
                f"out of memory in sliding-window validation at one patch of "
                f"{'x'.join(map(str, roi))} ({failure}): give the run a larger budget or a "
                "smaller size="
            )
