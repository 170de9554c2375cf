"""Image regression (the PetFinder-Pawpularity kind of job): a CSV of ``file,target[,target2...]``
with float targets; a timm model with one output per target; MSE, Huber or L1 on targets
standardised with the training split's mean and standard deviation (so that one learning rate
suits any units), each sample's loss a mean over its targets, so accumulation stays exact; MAE,
RMSE and R2 reported in the targets' own units."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from bigbatch.train.config import ConfigError, TrainConfig
from bigbatch.train.data import DataError, read_csv_rows, split_items
from bigbatch.train.tasks.base import Task
from bigbatch.train.tasks.images import (
    ImageDataset,
    ImageFormat,
    build_model,
    build_transforms,
    check_images,
    device_images,
    resolve_data_config,
)
from bigbatch.train.tasks.regression.options import RegressionOptions

__all__ = ["RegressionItems", "RegressionMetrics", "RegressionTask", "read_targets"]

Log = Callable[[str], None]


@dataclass
class RegressionItems:
    """Image files with their targets (one row of floats each) and the targets' names."""

    files: list[Path]
    values: np.ndarray  # [N, targets], float64
    names: list[str]
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    format: ImageFormat = field(default_factory=ImageFormat)

    def __len__(self) -> int:
        return len(self.files)

    def subset(self, index: Sequence[int]) -> RegressionItems:
        idx = list(index)
        return RegressionItems(
            [self.files[i] for i in idx], self.values[idx], self.names, format=self.format
        )


def read_targets(
    path: str | Path, image_root: str = "", columns: str = "", bad_images: str = "skip"
) -> RegressionItems:
    """The CSV's files (relative to ``image_root``, default the CSV's folder) and float targets
    (``columns``, comma-separated; default every column after the file); DataError naming the
    row and the fix where a target is not a finite number or a file is missing."""
    path = Path(path)
    if path.suffix.lower() != ".csv" or not path.is_file():
        raise DataError(
            f"data={path}: task=regression reads a CSV of file,target[,target2...]; give one"
        )
    rows = read_csv_rows(path)
    if len(rows) < 2 or len(rows[0]) < 2:
        raise DataError(f"{path} needs a header and rows of file,target")
    header = [h.strip() for h in rows[0]]
    wanted = [c.strip() for c in columns.split(",") if c.strip()] or header[1:]
    unknown = [c for c in wanted if c not in header[1:]]
    if unknown:
        raise DataError(
            f"targets={columns!r}: {path} has no column {unknown[0]!r}; its columns are "
            f"{', '.join(header[1:])}"
        )
    at = [header.index(c) for c in wanted]
    root = Path(image_root) if image_root else path.parent
    files, values = [], []
    for line, row in enumerate(rows[1:], start=2):
        if not any(cell.strip() for cell in row):
            continue
        cells = row + [""] * (len(header) - len(row))
        try:
            target = [float(cells[i]) for i in at]
        except ValueError:
            raise DataError(
                f"{path} line {line}: a target is not a number ({','.join(row)!r}); every "
                f"row needs file,{','.join(wanted)} with numbers"
            ) from None
        if not all(map(math.isfinite, target)):
            raise DataError(f"{path} line {line}: a target is not finite ({','.join(row)!r})")
        files.append(root / cells[0].strip())
        values.append(target)
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise DataError(
            f"{len(missing)} file(s) named in {path} do not exist under {root}, e.g. "
            f"{missing[0]}; fix the CSV or set image_root"
        )
    kept, index, skipped, fmt = check_images(files, list(range(len(files))), bad_images)
    table = np.asarray(values, dtype=np.float64).reshape(len(values), len(wanted))
    return RegressionItems(kept, table[index], wanted, skipped, fmt)


class RegressionMetrics:
    """MAE, RMSE and R2 in the targets' units (averaged over the targets), summed over samples
    in float64 (never a mean of batch means); ``valid_loss`` the training loss's mean."""

    def __init__(self, loss: Callable[..., torch.Tensor], mean: torch.Tensor, std: torch.Tensor):
        self.loss_fn, self.mean, self.std = loss, mean.double(), std.double()
        self.loss_sum, self.count = 0.0, 0
        self.sums: dict[str, torch.Tensor] = {}

    def update(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.loss_sum += float(self.loss_fn(outputs, targets)) * len(targets)
        self.count += len(targets)
        pred = outputs.detach().double().cpu() * self.std + self.mean  # the targets' units
        true = targets.detach().double().cpu() * self.std + self.mean
        parts = {
            "abs": (pred - true).abs().sum(0),
            "sq": (pred - true).pow(2).sum(0),
            "y": true.sum(0),
            "y2": true.pow(2).sum(0),
        }
        for k, v in parts.items():
            self.sums[k] = self.sums.get(k, torch.zeros_like(v)) + v

    def as_dict(self) -> dict[str, float]:
        n = max(self.count, 1)
        if not self.sums:
            return {"valid_loss": math.nan, "mae": math.nan, "rmse": math.nan, "r2": math.nan}
        s = self.sums
        total = s["y2"] - s["y"].pow(2) / n  # each target's sum of squares about its mean
        r2 = torch.where(total > 0, 1 - s["sq"] / total.clamp(min=1e-300), torch.zeros_like(total))
        return {
            "valid_loss": self.loss_sum / n,
            "mae": float((s["abs"] / n).mean()),
            "rmse": float((s["sq"] / n).sqrt().mean()),
            "r2": float(r2.mean()),
        }


class RegressionTask(Task):
    name = "regression"

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.options = cast(RegressionOptions, cfg.options)
        self.targets: list[str] = []
        self.mean = torch.zeros(1)
        self.std = torch.ones(1)
        self.format = ImageFormat()
        self.data: dict[str, Any] = {}
        self._factory: Callable[[], nn.Module] | None = None

    def prepare(self, log: Log, data: Any = None) -> tuple[RegressionItems, RegressionItems]:
        cfg, opts = self.cfg, self.options
        if data is not None:
            train_items, valid_items = data
        else:
            items = read_targets(cfg.data, cfg.image_root, opts.targets, "skip")
            if cfg.valid:
                valid_items = read_targets(cfg.valid, cfg.image_root, opts.targets, "skip")
                train_items = items
            else:
                train_items, valid_items = split_items(items, cfg.valid_pct, cfg.seed)
            if items.skipped:
                first = items.skipped[0]
                log(f"skipped {len(items.skipped)} unreadable image(s), e.g. {first[0]}")
        if len(train_items) < 2:
            raise ConfigError("task=regression needs 2 or more training images")
        self.targets, self.format = train_items.names, train_items.format
        valid_items.format = self.format
        values = torch.from_numpy(train_items.values)
        # Standardised with the training split's statistics (a constant target: unit scale).
        self.mean = values.mean(0).float()
        self.std = torch.where(values.std(0) > 0, values.std(0), torch.ones(1)).float()
        self.data = resolve_data_config(self.model_factory(), self.format.channels)
        shown = ", ".join(
            f"{n} mean {m:.4g} sd {s:.4g}"
            for n, m, s in zip(self.targets, self.mean.tolist(), self.std.tolist(), strict=True)
        )
        log(
            f"data: {len(train_items)} training and {len(valid_items)} validation images, "
            f"{len(self.targets)} target(s): {shown[:200]}"
        )
        return train_items, valid_items

    def model_factory(self) -> Callable[[], nn.Module]:
        if self._factory is None:
            outputs = max(len(self.targets), 1)
            self._factory = build_model(self.cfg, outputs, self.format.channels)
        return self._factory

    def input_shape(self) -> tuple[int, ...]:
        return (self.format.channels, self.cfg.size, self.cfg.size)

    def _standardised(self, items: RegressionItems) -> list[torch.Tensor]:
        values = (torch.from_numpy(items.values).float() - self.mean) / self.std
        return list(values)

    def datasets(self, train_items: Any, valid_items: Any) -> tuple[Any, Any]:
        cfg, fmt = self.cfg, self.format
        common: dict[str, Any] = {"data": self.data, "fmt": fmt}
        train_tf = build_transforms(cfg.size, "squish", train=True, augment=cfg.augment, **common)
        valid_tf = build_transforms(cfg.size, "squish", train=False, augment=False, **common)
        targets = cast(Any, self._standardised(train_items))
        valid_targets = cast(Any, self._standardised(valid_items))
        return (
            ImageDataset(train_items.files, targets, train_tf, fmt),
            ImageDataset(valid_items.files, valid_targets, valid_tf, fmt),
        )

    def device_images(self, train_ds: Any) -> Any:
        return device_images(train_ds, self.cfg, self.data)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The chosen loss on standardised targets: each sample's a mean over its targets, the
        batch's a plain mean over samples (every sample has as many targets: exact)."""
        # float32 at least (a 16-bit forward's outputs), float64 where the model is.
        dtype = torch.promote_types(outputs.dtype, torch.float32)
        out, y = outputs.to(dtype), targets.to(dtype)
        if self.options.loss == "huber":
            return F.huber_loss(out, y, delta=self.options.huber_delta)
        if self.options.loss == "l1":
            return F.l1_loss(out, y)
        return F.mse_loss(out, y)

    def metrics(self) -> RegressionMetrics:
        return RegressionMetrics(self.loss, self.mean, self.std)

    def scores(self, row: dict[str, Any]) -> str:
        return (
            f"valid loss {row['valid_loss']:.4f}  MAE {row['mae']:.4g}  RMSE {row['rmse']:.4g}  "
            f"R2 {row['r2']:.3f}  "
        )

    def run_info(self) -> dict[str, Any]:
        return {
            "task": self.name,
            "classes": [],
            "targets": self.targets,
            "mean": self.mean.tolist(),
            "std": self.std.tolist(),
            "format": self.format.to_dict(),
            "data": self.data,
        }
