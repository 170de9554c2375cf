"""The training configuration: a TOML file plus ``key=value`` overrides, checked before any work."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from bigbatch.memory.budget import parse_bytes
from bigbatch.memory.cards import card_hint, find_card
from bigbatch.train.registry import DEFAULT_TASK, TaskEntry, task_entry, task_names

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["ConfigError", "TrainConfig", "load_config", "read_toml"]


class ConfigError(ValueError):
    """A configuration problem, with the fix in the message: said in one line by every
    command. A task's options raise a plain ValueError in ``check``; bigbatch makes it this.

    >>> load_config(overrides=["data=x", "epochs=-1"])
    Traceback (most recent call last):
    ...
    bigbatch.train.config.ConfigError: epochs must be >= 1, got -1
    """


CHOICES: dict[str, tuple[str, ...]] = {
    "precision": ("auto", "fp32", "bf16", "fp16"),
    "mode": ("auto", "fine_tune", "fit"),
    "schedule": ("one_cycle", "cosine", "plateau"),
    "optimizer": ("adamw", "sgd"),
    "channels_last": ("auto", "true", "false"),
    "cudnn_benchmark": ("auto", "true", "false"),
    "decode": ("auto", "cpu", "gpu"),
}


@dataclass
class TrainConfig:
    """Everything ``bigbatch train`` needs; every field can be set in the file or as key=value.
    These are the keys every task shares (what each means is in :data:`HELP`); a task's own keys
    are its options dataclass's, in ``options``, set in the same flat file or ``key=value``
    (``bigbatch train --help`` lists both)."""

    task: str = DEFAULT_TASK
    data: str = ""
    image_root: str = ""
    valid: str = ""
    valid_pct: float = 0.2
    arch: str = "resnet18"
    model: str = ""
    weights: str = ""
    pretrained: bool = False
    size: int = 224
    augment: bool = True
    freeze_bn: bool = False
    grad_checkpointing: bool = False
    batch: int = 64
    budget: str = "auto"
    overhead: str = "auto"
    micro_batch: int = 0
    device: str = "auto"
    precision: str = "auto"
    optimizer: str = "adamw"
    mode: str = "auto"
    epochs: int = 5
    freeze_epochs: int = 1
    lr: float = 1e-3
    weight_decay: float = 0.01
    schedule: str = "one_cycle"
    monitor: str = "valid_loss"
    ema: float = 0.0
    seed: int = 42
    num_workers: int = -1
    threads: int = 0
    grow_after: int = 100
    log_every: float = 30.0
    checkpoint_every: str = ""
    channels_last: str = "auto"
    cudnn_benchmark: str = "auto"
    compile: bool = False
    decode: str = "auto"
    log: str = "none"
    log_checkpoint: bool = False
    # The task's own keys: its options dataclass (ClassificationOptions, SegmentationOptions),
    # made for the task when not given.
    options: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.options is None and (self.task in task_names() or ":" in self.task):
            # A task= that does not load is said by validate(), with the fix.
            with contextlib.suppress(KeyError, ValueError):
                self.options = task_entry(self.task).options_class()()

    def with_absolute_paths(self) -> TrainConfig:
        """This config with its paths (``data``, ``image_root``, ``valid``, ``weights``)
        absolute, as the run folder keeps them.

        >>> TrainConfig(data="images").with_absolute_paths().data.startswith("/")
        True
        """
        import copy
        import os

        new = copy.copy(self)
        for key in ("data", "image_root", "valid", "weights"):
            value = getattr(self, key)
            if value and not (
                key == "weights" and ("://" in value or value.startswith(("hf-hub:", "hf_hub:")))
            ):
                setattr(new, key, os.path.abspath(value))
        return new

    def validate(self, *, refuse_unread: bool = True) -> None:
        """Every check that needs no data and no model: before any work starts. With
        ``refuse_unread``, keys set to what the run would not read are refused too (not for a
        resumed run: it goes on as its saved config trained, by an earlier bigbatch too)."""
        if not self.data:
            _check_task(self.task)
            raise ConfigError(f"data is not set: give data= ({_data_help(self.task)})")
        _check_task(self.task)
        for key, allowed in CHOICES.items():
            if getattr(self, key) not in allowed:
                raise ConfigError(
                    f"{key}={getattr(self, key)!r} is not one of {', '.join(allowed)}"
                )
        for key, value in self.to_dict().items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{key} must be a finite number, got {value}")
        for key in ("size", "batch", "epochs"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} must be >= 1, got {getattr(self, key)}")
        if not 0 <= self.valid_pct < 1:
            raise ConfigError(f"valid_pct must be in [0, 1), got {self.valid_pct}")
        if self.num_workers < -1:
            raise ConfigError(f"num_workers must be >= 0, or -1 for auto; got {self.num_workers}")
        for key in ("micro_batch", "freeze_epochs", "threads", "grow_after", "seed"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key} must be >= 0, got {getattr(self, key)}")
        if self.lr <= 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ConfigError(
                f"weight_decay must be >= 0 (0 turns it off), got {self.weight_decay}"
            )
        _check_log(self.log)
        if self.log_every < 0:
            raise ConfigError(f"log_every must be >= 0 seconds (0: never), got {self.log_every}")
        check_device(self.device, "device")
        self.checkpoint_interval()  # raises on a value it cannot read

        _check_sizes(self.budget, self.overhead)
        if self.weights and self.pretrained:
            raise ConfigError("weights= and pretrained=true both give starting weights: choose one")
        if self.pretrained and self.model:
            raise ConfigError(
                "pretrained=true loads timm's weights for arch=; your model= factory loads its own"
            )
        if self.weights and not Path(self.weights).is_file():
            raise ConfigError(
                f"weights={self.weights!r} does not exist (a local safetensors or state-dict "
                "file; nothing is downloaded)"
            )
        metrics = task_entry(self.task).metrics
        if self.monitor != "valid_loss" and self.monitor not in metrics:
            if not metrics:
                raise ConfigError(
                    f"monitor={self.monitor}: task={self.task} declares no metrics (its "
                    "metric_names, or its TaskEntry's metrics, are empty): use "
                    f"monitor=valid_loss, or declare {self.monitor} in the task"
                )
            raise ConfigError(
                f"monitor={self.monitor} is not a {self.task} metric: use valid_loss or "
                + ", ".join(metrics)
            )
        if not 0 <= self.ema < 1:
            raise ConfigError(f"ema is a decay in [0, 1) (0.999 is common; 0: off), got {self.ema}")
        self._check_options()
        if refuse_unread:
            self._check_read()
        if self.micro_batch > self.batch:
            raise ConfigError(
                f"micro_batch={self.micro_batch} is larger than batch={self.batch}: a micro-batch "
                "is a part of the batch; lower it, or raise batch"
            )

    def _check_read(self) -> None:
        """Keys set to what this run would not read are refused, not ignored."""
        try:
            self.options.check_read(self)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        if self.valid and self.valid_pct != TrainConfig.valid_pct:
            raise ConfigError(
                f"valid_pct={self.valid_pct} splits data= when valid= is empty, and "
                f"valid={self.valid} is given: drop one of them"
            )
        folders = [p for p in (self.data, self.valid) if p]
        if self.image_root and all(Path(p).is_dir() for p in folders):
            where = f"data={self.data} is a folder"
            if self.valid:
                where = f"data={self.data} and valid={self.valid} are folders"
            raise ConfigError(
                f"image_root= is where a CSV's files are, and {where}: drop image_root"
            )
        from bigbatch.trackers import parse_trackers  # log= is checked before this

        if self.log_checkpoint and not {"wandb", "mlflow"} & set(parse_trackers(self.log)):
            raise ConfigError(
                f"log_checkpoint=true keeps best.safetensors in W&B or MLflow, and log={self.log} "
                "reports to neither: add log=wandb or log=mlflow, or drop log_checkpoint"
            )
        if self.freeze_epochs > 1 and not self.fine_tunes:
            why = "the head trains alone only when fine-tuning (mode=fine_tune, or auto with "
            why += "weights= or pretrained=true)"
            fix = "set mode=fine_tune, or drop freeze_epochs"
            if not self.options.fine_tunes_head:
                why, fix = f"task={self.task} trains no head alone", "drop freeze_epochs"
            raise ConfigError(
                f"freeze_epochs={self.freeze_epochs}: {why}, and this run trains every layer "
                f"from its first epoch: {fix}"
            )

    def _check_options(self) -> None:
        """The task's own keys: of its options dataclass, each among its choices, and as the
        task's ``check`` wants them."""
        kind = task_entry(self.task).options_class()
        if not isinstance(self.options, kind):
            raise ConfigError(
                f"options are {type(self.options).__name__}, not task={self.task}'s "
                f"{kind.__name__}: build the config with load_config"
            )
        for f in fields(self.options):
            allowed = f.metadata.get("choices", ())
            if allowed and getattr(self.options, f.name) not in allowed:
                raise ConfigError(
                    f"{f.name}={getattr(self.options, f.name)!r} is not one of {', '.join(allowed)}"
                )
        try:
            self.options.check(self)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc

    def checkpoint_interval(self) -> tuple[int, float]:
        """(optimizer steps, seconds) between mid-epoch checkpoints; (0, 0) for none."""
        text = self.checkpoint_every.strip().lower().replace(" ", "")
        if not text:
            return 0, 0.0
        try:
            if text.endswith(("min", "m")):
                minutes = float(text.rstrip("min") or "x")
                if math.isfinite(minutes) and minutes > 0:
                    return 0, 60.0 * minutes
            elif int(text) > 0:
                return int(text), 0.0
        except ValueError:
            pass
        raise ConfigError(
            f"checkpoint_every={self.checkpoint_every!r}: give optimizer steps (e.g. 200) or "
            "minutes (e.g. 10min)"
        )

    @property
    def model_name(self) -> str:
        """What the run trains, for logs and folder names: the factory or the timm name."""
        return self.model or self.arch

    @property
    def fine_tunes(self) -> bool:
        """Whether the head trains alone first: mode=fine_tune, or auto with starting weights
        (random weights have no features worth keeping, so auto trains everything)."""
        if not self.options.fine_tunes_head:
            return False  # a decoder's last layer is no classifier head worth training alone
        return self.mode == "fine_tune" or (
            self.mode == "auto" and (bool(self.weights) or self.pretrained)
        )

    def to_dict(self) -> dict[str, Any]:
        """Every key, flat: the shared ones, then the task's own (as a file sets them)."""
        shared = {f.name: getattr(self, f.name) for f in shared_fields()}
        return shared | dataclasses.asdict(self.options)

    def training_keys(self) -> dict[str, Any]:
        """What decides the trained weights (a resumed run must match these)."""
        ignore = {
            "num_workers",
            "threads",
            "device",
            "budget",
            "overhead",
            "micro_batch",
            "grow_after",
            "bad_images",
            "log_every",
            "checkpoint_every",
            "compile",
            "grad_checkpointing",
            "decode",
            "log",
            "log_checkpoint",
        }
        ignore |= {f.name for f in fields(self.options) if not f.metadata.get("trains", True)}
        return {k: v for k, v in self.to_dict().items() if k not in ignore}


def _check_log(log: str) -> None:
    """``log=``'s trackers: known, and their libraries installed (before any work)."""
    from bigbatch.trackers import check_trackers, parse_trackers

    try:
        check_trackers(parse_trackers(log))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


HELP: dict[str, str] = {
    "task": "",  # from the registry: help_for()
    "data": "",
    "image_root": "where the CSV's files are (default: the CSV's folder)",
    "valid": "a validation folder or CSV; empty: a seeded split of data",
    "valid_pct": "the share of data held out for validation; 0: none (best checkpoint by train_loss)",
    "arch": "any timm architecture (random init; weights= for your own starting weights); segmentation: MONAI's unet, segresnet, dynunet, swinunetr or unetr (2D/3D), or a timm encoder name (2D U-Net)",
    "model": "module:factory(num_classes) building your own model, instead of arch",
    "weights": "a local weights file (safetensors or a state dict; never unpickled, never downloaded)",
    "pretrained": "timm's pretrained weights, through the Hugging Face cache (downloaded once, then offline)",
    "size": "input size: images are resized to size x size; volumes are cropped to size^3 patches",
    "augment": "random flips and crops while training",
    "freeze_bn": "BatchNorm uses its running statistics: accumulation becomes exact",
    "grad_checkpointing": "recompute each block's activations in backward instead of keeping them (timm's models, MONAI's networks, smp's decoders and their encoders): less memory, a larger micro-batch, about a third more compute, the same gradients",
    "batch": "the target batch: samples per optimizer step",
    "budget": "memory budget for training (8GB, 16GiB, 512MiB), a GPU's name (t4, p100, l4, a10g, rtx4090, a100-80gb, h100...: that card's memory less its CUDA context; bigbatch plan --list-cards) or auto: the free memory now",
    "overhead": "memory besides the step's tensors: auto (this process / the CUDA context) or a size",
    "micro_batch": "0: the planner chooses under budget; else fixed (checked against an explicit budget)",
    "device": "auto, cpu, cuda, cuda:N or mps",
    "precision": "auto (bf16 or fp16 on CUDA, fp32 elsewhere), fp32, bf16, fp16",
    "optimizer": "adamw (fused on a CUDA card), or sgd (momentum 0.9: one state copy instead of two)",
    "mode": "fine_tune: the head alone for freeze_epochs, then all; fit: all; auto: fine_tune with weights= or pretrained, else fit",
    "epochs": "epochs (after the head-only ones of fine_tune)",
    "freeze_epochs": "head-only epochs of fine_tune",
    "lr": "learning rate (the head-only epochs use twice this)",
    "weight_decay": "decoupled weight decay (AdamW), or L2 (SGD); 0: none",
    "schedule": "one_cycle or cosine in optimizer steps; plateau: halve on a flat valid_loss",
    "monitor": "",
    "ema": "an exponential moving average of the weights with this decay (0.999, 0.9998), updated after every optimizer step, validated and saved as best/last.safetensors; 0: off",
    "seed": "seeds the split, the order, augmentation and initialisation",
    "num_workers": "data-loading processes, kept across epochs (0: in the training process; -1: auto: on a GPU every core but one, at most 16; on a CPU run 0 with 2 cores or fewer)",
    "threads": "torch's CPU threads (0: auto, the cores the data loaders leave); kept on resume",
    "grow_after": "clean windows before the OOM back-off tries a larger micro-batch (0: never)",
    "log_every": "seconds between progress lines when the output is not a terminal (0: never)",
    "checkpoint_every": "also checkpoint mid-epoch: every N optimizer steps (200) or minutes (10min)",
    "channels_last": "NHWC memory format for convolutional models: auto (on CUDA), true, false",
    "cudnn_benchmark": "cuDNN's benchmark mode: each convolution's algorithms timed on its first call, the fastest kept (as timm's train.py and fastai do); the plan predicts its memory: auto (on CUDA), true, false",
    "compile": "torch.compile the model for training (opt-in: the first steps compile)",
    "log": "experiment trackers to report to, comma-separated: tensorboard, wandb, mlflow (offline by default: files in the run folder; WANDB_MODE, MLFLOW_TRACKING_URI for servers), or none",
    "log_checkpoint": "with log=: also keep best.safetensors in the trackers that store files (W&B, MLflow)",
    "decode": "where training JPEGs are decoded and augmented: cpu (loader workers), gpu (nvJPEG, crops and flips on the GPU) or auto: measured in the first epoch, the GPU from the second where it promises to be faster, kept where its epoch was",
}


def shared_fields() -> list[dataclasses.Field[Any]]:
    """TrainConfig's keys every task shares (its fields less ``options``)."""
    return [f for f in fields(TrainConfig) if f.name != "options"]


def keys_help() -> str:
    """Every config key with its default and meaning: the epilog of ``bigbatch train --help``,
    the shared keys, then each task's own."""
    defaults = TrainConfig()
    lines = ["config keys (in the TOML file, or key=value):"]
    for f in shared_fields():
        lines.append(_key_line(f.name, getattr(defaults, f.name), help_for(f.name)))
    for task in task_names():
        entry = _entry_or_none(task)
        own = fields(entry.options_class()) if entry else ()
        if own:
            lines.append(f"task={task}'s own keys:")
        for f in own:
            lines.append(_key_line(f.name, f.default, f.metadata["help"]))
    return "\n".join(lines)


def help_for(key: str) -> str:
    """A shared key's meaning; ``task``, ``data`` and ``monitor`` from the registered tasks.

    >>> help_for("task").startswith("classification (image -> class)")
    True
    """
    entries = [(n, _entry_or_none(n)) for n in task_names()]
    if key == "task":
        said = [
            f"{n} ({e.summary})"
            if e and e.summary
            else n
            if e
            else f"{n} (not usable here: `bigbatch train task={n}` says why)"
            for n, e in entries
        ]
        return ", ".join(said) + "; an installed plug-in's name, or module:Class (a Task subclass)"
    if key == "data":
        return "; ".join(f"{n}: {_data_help(n)}" for n, _ in entries) + " (required)"
    if key == "monitor":
        chosen = "; ".join(f"{n}: {', '.join(e.metrics)}" for n, e in entries if e)
        return f"what picks best.safetensors: valid_loss; {chosen}"
    return HELP[key]


def _entry_or_none(task: str) -> TaskEntry | None:
    """The task's entry; None where its plug-in does not load (said when it is chosen)."""
    try:
        return task_entry(task)
    except (KeyError, ValueError):
        return None


def _data_help(task: str) -> str:
    entry = _entry_or_none(task)
    return (entry.data_help if entry else "") or "the data its task reads"


def _key_line(name: str, default: Any, meaning: str) -> str:
    shown = json.dumps(default) if isinstance(default, str) else str(default).lower()
    return f"  {name} = {shown}\n      {meaning}"


def check_device(name: str, what: str, *, here: bool = True) -> None:
    """A device name torch knows and (with ``here``) this machine has; ``auto`` always passes.
    ``here=False`` only checks the name: a plan for a GPU needs no GPU."""
    if name == "auto":
        return
    import torch

    from bigbatch.device import DEVICE_KINDS, unavailable_reason

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(
            f"{what}={name!r} is not a device: use auto, cpu, cuda, cuda:N or mps"
        ) from exc
    if device.type not in DEVICE_KINDS:
        raise ConfigError(f"{what}={name!r}: bigbatch trains on {', '.join(DEVICE_KINDS)}")
    if here and (why := unavailable_reason(device)):
        raise ConfigError(f"{what}={name} but {why}")


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
        noun = {"int": "an integer", "float": "a number", "str": "a string"}[kind.__name__]
        raise ConfigError(f"{name} takes {noun}, got {raw!r}") from exc


def _check_task(task: str) -> None:
    try:
        task_entry(task)
    except KeyError as exc:
        raise ConfigError(str(exc.args[0])) from None
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _owner(key: str) -> str:
    """The registered tasks whose own key ``key`` is (``"a or b"``; '' when none)."""
    owners = [task for task in task_names() if key in _own_keys(task)]
    return " or task=".join(owners)


def _own_keys(task: str) -> set[str]:
    entry = _entry_or_none(task)
    return {f.name for f in fields(entry.options_class())} if entry else set()


def _apply(
    cfg: TrainConfig, values: dict[str, Any], where: str | dict[str, str], *, lenient: bool = False
) -> None:
    """Set ``values`` on ``cfg``: ``task`` first (it decides which keys are the task's own),
    then each key on the config or its options. A key of another task is refused with the task
    that reads it (``lenient``: skipped, for a config.json an older bigbatch wrote with every
    task's keys). ``where`` names the source, or each key's."""

    def source(key: str) -> str:
        return where if isinstance(where, str) else where[key]

    if "task" in values:
        cfg.task = _coerce("task", values["task"], "str")
        _check_task(cfg.task)
        kind = task_entry(cfg.task).options_class()
        if not isinstance(cfg.options, kind):
            cfg.options = kind()
    shared = {f.name: f for f in shared_fields()}
    own = {f.name: f for f in fields(cfg.options)}
    for key, raw in values.items():
        if key in shared:
            setattr(cfg, key, _coerce(key, raw, shared[key].type))
        elif key in own:
            setattr(cfg.options, key, _coerce(key, raw, own[key].type))
        elif owner := _owner(key):
            if not lenient:
                raise ConfigError(
                    f"{key} (in {source(key)}) is a key of task={owner}, and this run is "
                    f"task={cfg.task}, which does not read it: drop it, or set task={owner}"
                )
        else:
            known = [*shared, *own]
            close = difflib.get_close_matches(key, known, n=3)
            hint = (
                f"; did you mean {', '.join(close)}?"
                if close
                else f"; known keys: {', '.join(known)}"
            )
            raise ConfigError(f"unknown key {key!r} in {source(key)}{hint}")


def _check_sizes(budget: str, overhead: str) -> None:
    """budget=: a size, auto or a card's name (bigbatch.memory.cards); overhead=: a size or auto."""
    if unknown := card_hint(budget):
        raise ConfigError(f"budget={unknown}")
    for key, value, allow_zero in (("budget", budget, False), ("overhead", overhead, True)):
        if value.strip().lower() != "auto" and not (key == "budget" and find_card(value)):
            try:
                parse_bytes(value, allow_zero=allow_zero)
            except ValueError as exc:
                raise ConfigError(f"{key}={value!r}: {exc}") from exc


def read_toml(path: str | Path, what: str) -> dict[str, Any]:
    """A TOML file's tables; a missing or malformed file is a ConfigError naming it."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} {p} does not exist")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p} is not valid TOML: {exc}") from exc


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    base: TrainConfig | None = None,
) -> TrainConfig:
    """Defaults (or ``base``: a run's own config, for ``--resume RUN key=value``), then the
    TOML file (if any), then ``key=value`` overrides; validated.

    >>> load_config(overrides=["data=images", "epochs=3", "augment=false"]).epochs
    3
    """
    cfg = copy.deepcopy(base) if base is not None else TrainConfig()
    # One pass over the file's keys and the overrides (which win): task= in either decides
    # which keys are the task's own.
    values = read_toml(path, "config file") if path is not None else {}
    sources = dict.fromkeys(values, str(path))
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"overrides look like key=value, got {item!r}")
        values[key.strip()] = value.strip()
        sources[key.strip()] = "the overrides"
    _apply(cfg, values, sources)
    cfg.validate(refuse_unread=base is None)
    return cfg


def config_from_json(text: str, where: str = "the saved config") -> TrainConfig:
    """A run folder's ``config.json``; anything else is a ConfigError naming it."""
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{where} is not a bigbatch config (not JSON: {exc}); restore it, or start a new run "
            "in another folder"
        ) from exc
    if not isinstance(values, dict):
        raise ConfigError(f"{where} is not a bigbatch config (a JSON {type(values).__name__})")
    cfg = TrainConfig()
    _apply(cfg, values, where, lenient=True)
    return cfg
