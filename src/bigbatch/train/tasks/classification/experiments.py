"""Classification's ensemble of experiments: train each member within the budget, TTA, average
with weights, score on the shared validation set, write the submission (``bigbatch ensemble
EXPERIMENTS.toml``, through :func:`bigbatch.train.ensemble.run_ensemble`, which hands it the
training loop).

The experiments file (TOML) has a ``[common]`` table of training keys shared by every member, an
``[ensemble]`` table (``test`` folder, ``sample_submission`` CSV, ``tta`` passes) and one
``[[member]]`` per run with its ``name``, ``weight`` and its own keys (``arch``, ``size``,
``item_transform``, ...). Members are trained in turn, each planned into the same budget; a
member whose run is finished is not trained again on rerun (one whose keys were edited since is
refused), and one interrupted mid-way resumes, so a crash costs at most the epoch in flight.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bigbatch.io import atomic_write_csv, read_json
from bigbatch.memory.plan import overhead_bytes
from bigbatch.memory.predict import predict_peak
from bigbatch.memory.step import StepSpec
from bigbatch.models import UnknownArchitectureError, resolve_arch
from bigbatch.train.config import ConfigError, TrainConfig, load_config, read_toml
from bigbatch.train.data import DataError, images_to_predict
from bigbatch.train.optim import plan_optimizer
from bigbatch.train.runtime import resolve_device
from bigbatch.train.tasks.classification.data import ImageItems
from bigbatch.train.tasks.classification.metrics import METRICS, ClassificationMetrics
from bigbatch.train.tasks.classification.predict import Predictions, predict_files, save_predictions
from bigbatch.train.tasks.classification.task import build_model, prepare_data
from bigbatch.user_code import UserCodeError, load_callable

__all__ = [
    "EnsembleResult",
    "Member",
    "load_experiments",
    "run_experiments",
    "submission_ids",
    "write_submission",
]


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

    def summary(self, out_dir: Path) -> str:
        """What ``bigbatch ensemble`` prints: each member's and the ensemble's validation
        accuracy, and where the scores, submission and probabilities are."""
        lines = ["validation accuracy"]
        for row in self.scores:
            name, weight = row["member"], row["weight"]
            lines.append(f"  {name:<20} weight {weight:<5g} accuracy {row['accuracy']:.4f}")
        lines.append(f"\nscores: {out_dir / 'scores.csv'}")
        if self.submission:
            lines.append(
                f"submission: {self.submission}\nensemble probabilities: {self.predictions}"
            )
        return "\n".join(lines)


MEMBER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# The keys that decide the validation set: members must share it, or their scores and the
# ensemble's would be measured on different images.
SPLIT_KEYS = ("data", "image_root", "valid", "valid_pct", "seed", "bad_images")


def _split_of(cfg: TrainConfig) -> tuple[Any, ...]:
    """The values of the keys that decide a member's data split (shared or the task's own)."""
    values = cfg.to_dict()
    return tuple(values[k] for k in SPLIT_KEYS)


def load_experiments(
    path: str | Path, overrides: list[str] | None = None
) -> tuple[list[Member], dict[str, Any]]:
    """Members (with validated configs) and the checked ``[ensemble]`` options (``tta`` an int,
    ``test`` a folder of readable images, ``sample_submission`` matching it); errors name the
    member or key. Nothing is trained here: every mistake in the file fails before member 1."""
    path = Path(path)
    spec = read_toml(path, "experiments file")
    unknown = set(spec) - {"common", "ensemble", "member"}
    if unknown:
        raise ConfigError(
            f"{path}: unknown table(s) {sorted(unknown)}; use [common], [ensemble], [[member]]"
        )
    common = {k: _relative(path, k, v) for k, v in spec.get("common", {}).items()}
    options = {k: _relative(path, k, v) for k, v in spec.get("ensemble", {}).items()}
    bad = set(options) - {"test", "sample_submission", "tta"}
    if bad:
        raise ConfigError(
            f"{path}: unknown [ensemble] key(s) {sorted(bad)}; known: test, sample_submission, tta"
        )
    tta = options.get("tta", 2)
    if isinstance(tta, bool) or not isinstance(tta, int) or tta < 1:
        raise ConfigError(
            f"{path}: [ensemble] tta is a number of passes >= 1 (1: no augmentation), got {tta!r}"
        )
    options["tta"] = tta
    raw_members = spec.get("member", [])
    if not raw_members:
        raise ConfigError(f"{path} lists no [[member]]: add at least one with a name and an arch")
    members, names = [], set()
    for i, raw in enumerate(raw_members):
        raw = dict(raw)
        name = str(raw.pop("name", f"member{i}"))
        if not MEMBER_NAME.fullmatch(name):
            raise ConfigError(
                f"{path}: member name {name!r} must be letters, digits, '.', '_' or '-' (it names "
                "the member's run folder inside --out)"
            )
        if name in names:
            raise ConfigError(f"{path}: two members are named {name!r}")
        names.add(name)
        weight = raw.pop("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not weight >= 0:
            raise ConfigError(f"member {name}: weight is a number >= 0, got {weight!r}")
        values = {**common, **{k: _relative(path, k, v) for k, v in raw.items()}}
        try:
            cfg = load_config(
                overrides=[f"{k}={v}" for k, v in values.items()] + list(overrides or [])
            )
            _check_model_name(cfg)
        except ConfigError as exc:
            raise ConfigError(f"member {name}: {exc}") from exc
        members.append(Member(name, float(weight), cfg))
    if sum(m.weight for m in members) <= 0:
        raise ConfigError(f"{path}: the members' weights add up to 0")
    first = members[0]
    for m in members[1:]:
        pairs = zip(SPLIT_KEYS, _split_of(m.config), _split_of(first.config), strict=True)
        differ = [k for k, a, b in pairs if a != b]
        if differ:
            raise ConfigError(
                f"members {first.name} and {m.name} differ in {', '.join(differ)}: their "
                "validation sets would differ, and so would their scores; put these keys in "
                "[common]"
            )
    if not first.config.valid and first.config.valid_pct == 0:
        raise ConfigError(
            f"{path}: valid_pct=0 leaves no validation set to score the members and weigh the "
            "ensemble; set valid_pct > 0 or valid="
        )
    _check_test_options(options)
    return members, options


def _check_model_name(cfg: TrainConfig) -> None:
    """The member's model exists (timm name or module:factory), without building it."""
    if cfg.model:
        try:
            load_callable(cfg.model, "model")
        except UserCodeError as exc:
            raise ConfigError(str(exc)) from exc
        return

    try:
        resolve_arch(cfg.arch)
    except UnknownArchitectureError as exc:
        raise ConfigError(str(exc)) from exc


def _check_test_options(options: dict[str, Any]) -> None:
    """The test folder's images are readable and the sample submission names each of them
    unambiguously; sets ``options["test_files"]`` and ``options["test_ids"]``."""

    test, sample = options.get("test"), options.get("sample_submission")
    if sample and not test:
        raise ConfigError("[ensemble] sample_submission needs test = the folder of test images")
    if not test:
        return
    folder = Path(test)
    try:
        files = images_to_predict(folder)
    except DataError as exc:
        raise ConfigError(f"[ensemble] {exc}") from exc
    options["test_files"] = files
    options["test_ids"] = submission_ids(files, folder, sample)


def submission_ids(files: list[Path], folder: Path, sample: str | Path | None) -> list[str]:
    """The id each test image gets in the submission: the sample's ids (matched by file name
    with or without extension), or the file name; an id two images could take is an error."""
    rel = [f.relative_to(folder) for f in files]
    names = [r.name for r in rel]
    if not sample:
        if len(set(names)) == len(names):
            return names
        return [r.as_posix() for r in rel]  # sub-folders share names: the paths are the ids
    sample = Path(sample)
    if not sample.is_file():
        raise ConfigError(f"[ensemble] sample_submission {sample} does not exist")
    try:
        with open(sample, newline="", encoding="utf-8-sig") as handle:
            rows = [r for r in csv.reader(handle) if r]
    except (UnicodeDecodeError, csv.Error) as exc:
        raise ConfigError(
            f"[ensemble] sample_submission {sample} is not a UTF-8 CSV: {exc}"
        ) from exc
    if not rows:
        raise ConfigError(f"[ensemble] sample_submission {sample} is empty")
    if len(rows[0]) < 2:
        raise ConfigError(f"{sample} needs at least two columns: an image id and a label")
    if len(rows) < 2:
        raise ConfigError(f"{sample} has a header but no rows: one row per test image")
    candidates: dict[str, list[int]] = {}
    for i, (r, name) in enumerate(zip(rel, names, strict=True)):
        for key in {name, Path(name).stem, r.as_posix(), r.with_suffix("").as_posix()}:
            candidates.setdefault(key, []).append(i)
    ids: list[str | None] = [None] * len(files)
    for row in rows[1:]:
        hits = candidates.get(row[0].strip(), [])
        if not hits:
            raise ConfigError(
                f"{sample} names {row[0]!r}, which is not an image in the test folder {folder}"
            )
        if len(hits) > 1:
            raise ConfigError(
                f"{sample} id {row[0]!r} matches {len(hits)} test images ("
                + ", ".join(str(rel[h]) for h in hits[:3])
                + "): rename them so each id names one image"
            )
        ids[hits[0]] = row[0]
    missing = [str(rel[i]) for i, v in enumerate(ids) if v is None]
    if missing:
        raise ConfigError(
            f"{len(missing)} test image(s) have no row in {sample}, e.g. {missing[0]!r}: the "
            "submission would leave them out"
        )
    return [v for v in ids if v is not None]


def _relative(base: Path, key: str, value: Any) -> Any:
    """Paths in the experiments file are relative to the file."""
    if key in ("data", "valid", "image_root", "weights", "test", "sample_submission") and value:
        p = Path(str(value))
        return str(p if p.is_absolute() else base.parent / p)
    return value


def write_submission(
    ids: list[str],
    labels: list[str],
    out: str | Path,
    sample_submission: str | Path | None = None,
) -> Path:
    """The submission CSV: the sample's layout and row order when given (its first column names
    the images, its second receives the labels), else ``image,label``. ``ids`` are
    :func:`submission_ids`, one per prediction."""
    out = Path(out)
    if len(ids) != len(labels):
        raise ValueError(f"{len(ids)} ids but {len(labels)} labels: give one label per id")
    by_id = dict(zip(ids, labels, strict=True))
    if len(by_id) != len(ids):
        twice = sorted({i for i in ids if ids.count(i) > 1})
        raise ValueError(
            f"two predictions share the id {twice[0]!r} ({len(twice)} such ids): test images in "
            "different folders with one name? Make the ids with submission_ids(files, folder, "
            "sample_submission), which uses the relative paths where names repeat"
        )
    if sample_submission:
        with open(sample_submission, newline="", encoding="utf-8-sig") as handle:
            rows = [r for r in csv.reader(handle) if r]
        missing = [r[0] for r in rows[1:] if r[0] not in by_id]
        if missing:
            raise ValueError(
                f"{len(missing)} id(s) of {sample_submission} have no prediction (first: "
                f"{missing[0]!r}): predict every test image the sample lists, with ids from "
                "submission_ids(files, folder, sample_submission)"
            )
        atomic_write_csv(out, rows[0], ([r[0], by_id[r[0]], *r[2:]] for r in rows[1:]))
    else:
        atomic_write_csv(out, ["image", "label"], zip(ids, labels, strict=True))
    return out


def _scan_and_check(
    members: list[Member], log: Any
) -> dict[tuple[Any, ...], tuple[ImageItems, ImageItems]]:
    """Every member's data set, scanned once per distinct split (scanning opens every image),
    and every member's model built and run on the input size (one step on fake tensors)."""
    scans: dict[tuple[Any, ...], tuple[ImageItems, ImageItems]] = {}
    for m in members:
        key = _split_of(m.config)
        if key not in scans:
            scans[key] = prepare_data(m.config, log=log)
        c = m.config
        try:
            chans = scans[key][0].format.channels
            factory = build_model(c, len(scans[key][0].classes), chans)
            predict_peak(
                StepSpec(factory, (chans, c.size, c.size), 2, plan_optimizer(c.optimizer, "cpu"))
            )
        except (RuntimeError, TypeError, ValueError) as exc:
            raise ConfigError(
                f"member {m.name}: {c.model_name} cannot train at size {c.size}: "
                f"{type(exc).__name__}: {str(exc)[:300]}"
            ) from exc
    return scans


def run_experiments(
    experiments: str | Path,
    out_dir: str | Path,
    *,
    train: Callable[..., Any],
    log: Any = print,
    overrides: list[str] | None = None,
) -> EnsembleResult:
    """Train (or skip) every member with ``train`` (:func:`bigbatch.train.loop.train`), predict
    with TTA, average with weights, write the outputs.

    Everything that can fail without training fails first: the experiments file, every
    member's config and model, the data sets, the test images and the sample submission.

    >>> import tempfile
    >>> from bigbatch.train.loop import train
    >>> folder = Path(tempfile.mkdtemp())
    >>> _ = (folder / "experiments.toml").write_text('data = "train"')
    >>> run_experiments(folder / "experiments.toml", folder / "out", train=train)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    bigbatch.train.config.ConfigError: ...: unknown table(s) ['data']; use [common], ...
    """

    members, options = load_experiments(experiments, overrides)
    out_dir = Path(out_dir)
    test_files: list[Path] = options.get("test_files", [])
    tta = options["tta"]
    # One overhead for every member, read now: after member 1 has trained this process is
    # larger, and later members would be planned into less memory than the first.
    overhead = overhead_bytes(resolve_device(members[0].config.device))
    for m in members:
        if m.config.overhead == "auto":
            m.config.overhead = str(overhead)

    def indented(line: str) -> None:
        log(f"   {line}")

    scans = _scan_and_check(members, indented)
    result = EnsembleResult()
    valid_probs: list[tuple[float, np.ndarray]] = []
    test_probs: list[tuple[float, Predictions]] = []
    classes: list[str] | None = None
    for m in members:
        c = m.config
        data = scans[_split_of(c)]
        run_dir = out_dir / m.name
        log(
            f"\n== member {m.name}: {c.model_name} @ {c.size} ({c.options.item_transform}), weight {m.weight}"
        )
        # A finished member says so and trains no more, once its config is checked: an edited
        # member is refused, not its earlier run's predictions used.
        train(c, run_dir, resume=(run_dir / "config.json").exists(), log=indented, data=data)
        member_classes = read_json(
            run_dir / "classes.json",
            f"train the member again: delete {run_dir}/done.json and run the ensemble again",
        )
        if classes is None:
            classes = member_classes
        elif member_classes != classes:
            raise ConfigError(f"member {m.name} was trained on other classes than the first member")
        valid_items = data[1]
        device = c.device  # where it trained (auto: a GPU where there is one)
        vp = predict_files(run_dir, valid_items.files, tta=tta, device=device)
        labels = np.array(valid_items.labels)
        valid_probs.append((m.weight, vp.probs))
        result.scores.append({"member": m.name, "weight": m.weight} | _scores(vp.probs, labels))
        if test_files:
            tp = predict_files(run_dir, test_files, tta=tta, device=device)
            save_predictions(tp, out_dir / m.name / "test_predictions")
            test_probs.append((m.weight, tp))
    if classes is None:
        raise ConfigError("no member was trained")
    valid_labels = np.array(scans[_split_of(members[0].config)][1].labels)
    _write_ensemble(result, valid_probs, valid_labels, test_probs, classes, options, out_dir)
    return result


def _scores(probs: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """Validation scores of class probabilities: accuracy and the Kaggle metrics (macro F1,
    AUROC, quadratic kappa ...) as ``bigbatch train`` reports them."""
    metrics = ClassificationMetrics(probs.shape[1])
    log_probs = torch.from_numpy(np.log(np.clip(probs, 1e-12, None)))
    metrics.update(log_probs, torch.from_numpy(labels).long())
    row = metrics.as_dict()
    return {k: v for k, v in row.items() if k in METRICS and k != "error_rate"}


def _write_ensemble(
    result: EnsembleResult,
    valid_probs: list[tuple[float, np.ndarray]],
    valid_labels: np.ndarray,
    test_probs: list[tuple[float, Predictions]],
    classes: list[str],
    options: dict[str, Any],
    out_dir: Path,
) -> None:
    """The weighted average: its validation score beside the members', its test predictions
    and the submission."""
    total = sum(w for w, _ in valid_probs)
    ens_valid = np.sum([w * p for w, p in valid_probs], axis=0) / total
    result.scores.append({"member": "ensemble", "weight": total} | _scores(ens_valid, valid_labels))
    columns = ["member", "weight", *[k for k in result.scores[-1] if k not in ("member", "weight")]]
    atomic_write_csv(out_dir / "scores.csv", columns, result.scores)
    if test_probs:
        first = test_probs[0][1]
        probs = np.sum([w * p.probs for w, p in test_probs], axis=0) / total
        ens = Predictions(first.files, probs, classes)
        result.predictions, _ = save_predictions(ens, out_dir / "ensemble_predictions")
        result.submission = write_submission(
            options["test_ids"],
            ens.labels,
            out_dir / "submission.csv",
            options.get("sample_submission"),
        )
