"""Weighted ensembles of several runs: train each member within the budget, TTA, average, submit.

The experiments file (TOML) has a ``[common]`` table of training keys shared by every member, an
``[ensemble]`` table (``test`` folder, ``sample_submission`` CSV, ``tta`` passes) and one
``[[member]]`` per run with its ``name``, ``weight`` and its own keys (``arch``, ``size``,
``item_transform``, ...). Members are trained in turn, each planned into the same budget; a
member whose run is finished is skipped on rerun, and one interrupted mid-way resumes, so a crash
costs at most the epoch in flight.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bigbatch.io import atomic_write_csv
from bigbatch.train.config import ConfigError, TrainConfig, load_config, read_toml

__all__ = ["EnsembleResult", "Member", "load_experiments", "run_ensemble", "write_submission"]


@dataclass
class Member:
    name: str
    weight: float
    config: TrainConfig


@dataclass
class EnsembleResult:
    scores: list[dict[str, Any]] = field(default_factory=list)  # per member and "ensemble"
    submission: Path | None = None
    predictions: Path | None = None


def load_experiments(
    path: str | Path, overrides: list[str] | None = None
) -> tuple[list[Member], dict[str, Any]]:
    """Members (with validated configs) and the ``[ensemble]`` options; errors name the member."""
    path = Path(path)
    spec = read_toml(path, "experiments file")
    unknown = set(spec) - {"common", "ensemble", "member"}
    if unknown:
        raise ConfigError(
            f"{path}: unknown table(s) {sorted(unknown)}; use [common], [ensemble], [[member]]"
        )
    common = {k: _relative(path, k, v) for k, v in spec.get("common", {}).items()}
    options = {k: _relative(path, k, v) for k, v in spec.get("ensemble", {}).items()}
    bad = set(options) - {"test", "sample_submission", "tta", "image_root"}
    if bad:
        raise ConfigError(
            f"{path}: unknown [ensemble] key(s) {sorted(bad)}; known: test, sample_submission, tta"
        )
    raw_members = spec.get("member", [])
    if not raw_members:
        raise ConfigError(f"{path} lists no [[member]]: add at least one with a name and an arch")
    members, names = [], set()
    for i, raw in enumerate(raw_members):
        raw = dict(raw)
        name = str(raw.pop("name", f"member{i}"))
        if name in names:
            raise ConfigError(f"{path}: two members are named {name!r}")
        names.add(name)
        weight = float(raw.pop("weight", 1.0))
        if weight < 0:
            raise ConfigError(f"member {name}: weight must be >= 0, got {weight}")
        values = {**common, **{k: _relative(path, k, v) for k, v in raw.items()}}
        try:
            cfg = load_config(
                overrides=[f"{k}={v}" for k, v in values.items()] + list(overrides or [])
            )
        except ConfigError as exc:
            raise ConfigError(f"member {name}: {exc}") from exc
        members.append(Member(name, weight, cfg))
    if sum(m.weight for m in members) <= 0:
        raise ConfigError(f"{path}: the members' weights add up to 0")
    return members, options


def _relative(base: Path, key: str, value: Any) -> Any:
    """Paths in the experiments file are relative to the file."""
    if key in ("data", "valid", "image_root", "weights", "test", "sample_submission") and value:
        p = Path(str(value))
        return str(p if p.is_absolute() else base.parent / p)
    return value


def write_submission(
    files: list[str],
    labels: list[str],
    out: str | Path,
    sample_submission: str | Path | None = None,
) -> Path:
    """The submission CSV, in the layout of ``sample_submission`` when given (its first column
    names the images, by file name with or without extension; its second receives the labels)."""
    out = Path(out)
    by_name: dict[str, str] = {}
    for f, label in zip(files, labels, strict=True):
        by_name[Path(f).name] = label
        by_name[Path(f).stem] = label
    if sample_submission:
        with open(sample_submission, newline="") as handle:
            rows = [r for r in csv.reader(handle) if r]
        header, body = rows[0], rows[1:]
        if len(header) < 2:
            raise ConfigError(
                f"{sample_submission} needs at least two columns: an image id and a label"
            )
        missing = [r[0] for r in body if r[0] not in by_name]
        if missing:
            raise ConfigError(
                f"{len(missing)} image(s) in {sample_submission} are not in the test folder, e.g. {missing[0]!r}"
            )
        atomic_write_csv(out, header, ([r[0], by_name[r[0]], *r[2:]] for r in body))
    else:
        atomic_write_csv(
            out,
            ["image", "label"],
            ([Path(f).name, label] for f, label in zip(files, labels, strict=True)),
        )
    return out


def run_ensemble(
    experiments: str | Path,
    out_dir: str | Path,
    *,
    log: Any = print,
    overrides: list[str] | None = None,
) -> EnsembleResult:
    """Train (or skip) every member, predict with TTA, average with weights, write the outputs."""
    from bigbatch.train.data import ImageItems, list_images
    from bigbatch.train.loop import prepare_data, train
    from bigbatch.train.predict import Predictions, predict_files, save_predictions

    members, options = load_experiments(experiments, overrides)
    out_dir = Path(out_dir)
    test = options.get("test")
    test_files = list_images(Path(test)) if test else []
    if test and not test_files:
        raise ConfigError(f"[ensemble] test folder {test} has no images")
    tta = int(options.get("tta", 2))
    result = EnsembleResult()
    valid_probs: list[tuple[float, np.ndarray]] = []
    test_probs: list[tuple[float, Predictions]] = []
    valid_labels: np.ndarray | None = None
    classes: list[str] | None = None
    # Scanning opens every image: do it once per distinct data set, not once per member and
    # again inside train().
    scans: dict[tuple[Any, ...], tuple[ImageItems, ImageItems]] = {}

    def indented(line: str) -> None:
        log(f"   {line}")

    for m in members:
        c = m.config
        key = (c.data, c.image_root, c.valid, c.valid_pct, c.seed, c.bad_images)
        if key not in scans:
            scans[key] = prepare_data(c, log=indented)
        data = scans[key]
        run_dir = out_dir / m.name
        log(
            f"\n== member {m.name}: {m.config.arch} @ {m.config.size} ({m.config.item_transform}), weight {m.weight}"
        )
        if (run_dir / "done.json").exists():
            log(f"   finished earlier in {run_dir}: skipped")
        else:
            train(
                m.config,
                run_dir,
                resume=(run_dir / "last.pt").exists(),
                log=indented,
                data=data,
            )
        valid_items = data[1]
        member_classes = json.loads((run_dir / "classes.json").read_text())
        if classes is None:
            classes = member_classes
        elif member_classes != classes:
            raise ConfigError(f"member {m.name} was trained on other classes than the first member")
        vp = predict_files(run_dir, valid_items.files, tta=tta)
        labels = np.array(valid_items.labels)
        if valid_labels is None:
            valid_labels = labels
        elif not np.array_equal(labels, valid_labels):
            raise ConfigError(
                "members have different validation sets: give them the same data, valid, valid_pct and seed"
            )
        valid_probs.append((m.weight, vp.probs))
        result.scores.append(
            {
                "member": m.name,
                "weight": m.weight,
                "accuracy": float((vp.probs.argmax(1) == labels).mean()),
            }
        )
        if test:
            tp = predict_files(run_dir, test_files, tta=tta)
            save_predictions(tp, out_dir / m.name / "test_predictions")
            test_probs.append((m.weight, tp))
    total = sum(w for w, _ in valid_probs)
    ens_valid = np.sum([w * p for w, p in valid_probs], axis=0) / total
    if valid_labels is None or classes is None:
        raise ConfigError("no member was trained")
    result.scores.append(
        {
            "member": "ensemble",
            "weight": total,
            "accuracy": float((ens_valid.argmax(1) == valid_labels).mean()),
        }
    )
    atomic_write_csv(out_dir / "scores.csv", ["member", "weight", "accuracy"], result.scores)
    if test_probs:
        first = test_probs[0][1]
        probs = np.sum([w * p.probs for w, p in test_probs], axis=0) / total
        ens = Predictions(first.files, probs, classes)
        result.predictions, _ = save_predictions(ens, out_dir / "ensemble_predictions")
        result.submission = write_submission(
            ens.files, ens.labels, out_dir / "submission.csv", options.get("sample_submission")
        )
    return result
