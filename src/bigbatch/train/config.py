"""The training configuration: a TOML file plus ``key=value`` overrides, checked before any work."""

from __future__ import annotations

import dataclasses
import difflib
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["ConfigError", "TrainConfig", "load_config", "read_toml"]


class ConfigError(ValueError):
    """A configuration problem, with the fix in the message."""


CHOICES: dict[str, tuple[str, ...]] = {
    "item_transform": ("squish", "crop"),
    "precision": ("auto", "fp32", "bf16", "fp16"),
    "mode": ("fine_tune", "fit"),
    "schedule": ("one_cycle", "cosine", "plateau"),
    "monitor": ("valid_loss", "accuracy", "error_rate"),
    "bad_images": ("skip", "error"),
    "optimizer": ("adamw",),
}


@dataclass
class TrainConfig:
    """Everything ``bigbatch train`` needs; every field can be set in the file or as key=value."""

    data: str = ""  # a folder with one sub-folder per class, or a CSV of file,label
    image_root: str = ""  # where the CSV's files are (default: the CSV's folder)
    valid: str = ""  # a validation folder or CSV; empty: a seeded split of `data`
    valid_pct: float = 0.2
    arch: str = "resnet18"  # any timm architecture
    model: str = ""  # module:factory(num_classes) for your own model (instead of arch)
    weights: str = ""  # a local weights file (safetensors or a state dict); never downloaded
    size: int = 224
    item_transform: str = "squish"  # squish: resize to size x size; crop: resize, centre crop
    augment: bool = True  # random flips and crops while training
    freeze_bn: bool = False  # BatchNorm uses its running statistics: accumulation becomes exact
    batch: int = 64  # target batch: samples per optimizer step
    budget: str = "auto"  # memory budget: 8GB, 16GiB, auto
    # Memory besides the step's tensors: auto (this process / the CUDA context) or a size.
    overhead: str = "auto"
    micro_batch: int = 0  # 0: the planner chooses
    device: str = "auto"  # auto, cpu, cuda, cuda:1, mps
    precision: str = "auto"
    optimizer: str = "adamw"
    mode: str = "fine_tune"  # fine_tune: head only for freeze_epochs, then all; fit: all
    epochs: int = 5
    freeze_epochs: int = 1
    lr: float = 1e-3
    weight_decay: float = 0.01
    schedule: str = "one_cycle"  # in optimizer steps; plateau: ReduceLROnPlateau per epoch
    monitor: str = "valid_loss"  # picks the best checkpoint
    seed: int = 42
    num_workers: int = 2
    bad_images: str = "skip"  # skip (and count) or error on unreadable images
    grow_after: int = 100  # clean windows before the OOM back-off tries a larger micro-batch

    def validate(self) -> None:
        if not self.data:
            raise ConfigError(
                "data is not set: give data=path/to/folder (one sub-folder per class) or a CSV"
            )
        for key, allowed in CHOICES.items():
            if getattr(self, key) not in allowed:
                raise ConfigError(
                    f"{key}={getattr(self, key)!r} is not one of {', '.join(allowed)}"
                )
        for key in ("size", "batch", "epochs"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} must be >= 1, got {getattr(self, key)}")
        if not 0 <= self.valid_pct < 1:
            raise ConfigError(f"valid_pct must be in [0, 1), got {self.valid_pct}")
        if self.micro_batch < 0 or self.freeze_epochs < 0 or self.num_workers < 0:
            raise ConfigError("micro_batch, freeze_epochs and num_workers must be >= 0")
        if self.lr <= 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def training_keys(self) -> dict[str, Any]:
        """What decides the trained weights (a resumed run must match these)."""
        ignore = {
            "num_workers",
            "device",
            "budget",
            "overhead",
            "micro_batch",
            "grow_after",
            "bad_images",
        }
        return {k: v for k, v in self.to_dict().items() if k not in ignore}


def _coerce(name: str, raw: Any, annotation: Any) -> Any:
    kind = {"str": str, "int": int, "float": float, "bool": bool}.get(str(annotation), annotation)
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{name} takes true or false, got {raw!r}")
    try:
        if kind is int and isinstance(raw, float) and not raw.is_integer():
            raise ValueError
        return kind(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name} takes a {kind.__name__}, got {raw!r}") from exc


def _apply(cfg: TrainConfig, values: dict[str, Any], where: str) -> None:
    known = {f.name: f for f in fields(TrainConfig)}
    for key, raw in values.items():
        if key not in known:
            close = difflib.get_close_matches(key, known, n=3)
            hint = (
                f"; did you mean {', '.join(close)}?"
                if close
                else f"; known keys: {', '.join(known)}"
            )
            raise ConfigError(f"unknown key {key!r} in {where}{hint}")
        setattr(cfg, key, _coerce(key, raw, known[key].type))


def read_toml(path: str | Path, what: str) -> dict[str, Any]:
    """A TOML file's tables; a missing or malformed file is a ConfigError naming it."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} {p} does not exist")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p} is not valid TOML: {exc}") from exc


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Defaults, then the TOML file (if any), then ``key=value`` overrides; validated.

    >>> load_config(overrides=["data=images", "epochs=3", "augment=false"]).epochs
    3
    """
    cfg = TrainConfig()
    if path is not None:
        _apply(cfg, read_toml(path, "config file"), str(path))
    pairs = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"overrides look like key=value, got {item!r}")
        pairs[key.strip()] = value.strip()
    _apply(cfg, pairs, "the overrides")
    cfg.validate()
    return cfg


def config_from_json(text: str) -> TrainConfig:
    cfg = TrainConfig()
    _apply(cfg, json.loads(text), "the saved config")
    return cfg
