"""task=segmentation from a Kaggle RLE CSV: the checks before training, the samples, the
per-class competition Dice, exact accumulation through the task's own step, and the trained
run's submission (alone and as an ensemble), which decodes to the masks it predicted."""

from __future__ import annotations

import csv
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("monai")
pytest.importorskip("albumentations")
pytest.importorskip("segmentation_models_pytorch")

from bigbatch.cli.main import main
from bigbatch.segmentation.postprocess import (
    apply_rules,
    competition_dice,
    resize_probabilities,
    tune_rules,
)
from bigbatch.segmentation.rle import read_rle_csv, rle_encode, rle_runs, runs_overlap
from bigbatch.segmentation.synthetic import CLOUD_CLASSES, write_clouds_like
from bigbatch.train.config import ConfigError, load_config
from bigbatch.train.data import DataError, split_items
from bigbatch.train.loop import train
from bigbatch.train.tasks import Placement, task_for
from bigbatch.train.tasks.segmentation.kaggle import (
    CompetitionScores,
    KaggleSegmentationTask,
    padded_forward,
)
from bigbatch.train.tasks.segmentation.rle_data import (
    RLEDataset,
    is_rle_csv,
    scan_rle,
)
from bigbatch.train.tasks.segmentation.submit import (
    _probabilities,
    load_submission_run,
)
from helpers import window_gradients

H, W = 32, 48


def write_csv(path: Path, rows: list[tuple[str, ...]], header: tuple[str, ...]) -> Path:
    with path.open("w", newline="") as f:
        csv.writer(f).writerows([header, *rows])
    return path


def competition(tmp_path: Path, masks: dict[str, dict[str, np.ndarray]]) -> Path:
    """Images of H x W under tmp_path/images and their masks in an Image_Label CSV."""
    from PIL import Image

    (tmp_path / "images").mkdir(exist_ok=True)
    rows = []
    for name, by_class in masks.items():
        Image.fromarray(np.full((H, W, 3), 90, np.uint8)).save(tmp_path / "images" / name)
        rows += [(f"{name}_{c}", rle_encode(m)) for c, m in by_class.items()]
    return write_csv(tmp_path / "train.csv", rows, ("Image_Label", "EncodedPixels"))


def copy_run(run: Path, to: Path) -> Path:
    """The run folder's files (not its masks) in ``to``, to damage or move without touching it."""
    shutil.copytree(
        run, to, ignore=lambda folder, names: [n for n in names if (Path(folder) / n).is_dir()]
    )
    return to


def box(top: int, left: int, h: int = 8, w: int = 8) -> np.ndarray:
    m = np.zeros((H, W), dtype=bool)
    m[top : top + h, left : left + w] = True
    return m


# -- the checks, from the CSV and the headers ------------------------------------------------


def test_overlapping_classes_read_as_multilabel_and_disjoint_as_exclusive(tmp_path: Path) -> None:
    overlapping = competition(tmp_path, {"a.png": {"Fish": box(0, 0), "Sugar": box(4, 4)}})
    assert is_rle_csv(overlapping)
    items = scan_rle(overlapping, str(tmp_path / "images"))
    assert items.multilabel and items.num_classes == 2 and items.shapes == [(H, W)]
    with pytest.raises(DataError, match=r"a.png: two classes share pixels.*labels=multilabel"):
        scan_rle(overlapping, str(tmp_path / "images"), labels="exclusive")
    disjoint = competition(tmp_path, {"a.png": {"Fish": box(0, 0), "Sugar": box(20, 20)}})
    items = scan_rle(disjoint, str(tmp_path / "images"))
    assert not items.multilabel and items.num_classes == 3  # background + 2
    assert scan_rle(disjoint, str(tmp_path / "images"), labels="multilabel").multilabel


def test_runs_overlap_without_decoding() -> None:
    shape = (4, 4)
    assert not runs_overlap([rle_runs("1 2", shape), rle_runs("3 2", shape)])
    assert runs_overlap([rle_runs("1 3", shape), rle_runs("3 2", shape)])
    assert runs_overlap([rle_runs("1 10", shape), rle_runs("2 1", shape), rle_runs("", shape)])
    assert not runs_overlap([rle_runs("", shape)])


@pytest.mark.parametrize(
    ("cell", "message"),
    [
        (f"{H * W - 1} 5", "past the image's"),
        ("1 2 3", "odd count"),
        ("5 3 1 2", "sorted and must not overlap"),
    ],
)
def test_a_bad_encoding_is_refused_before_training(tmp_path: Path, cell: str, message: str) -> None:
    competition(tmp_path, {"a.png": {"Fish": box(0, 0)}})
    data = write_csv(tmp_path / "bad.csv", [("a.png_Fish", cell)], ("Image_Label", "EncodedPixels"))
    with pytest.raises(DataError, match=message):
        scan_rle(data, str(tmp_path / "images"))


def test_images_missing_or_unlisted_are_refused(tmp_path: Path) -> None:
    data = competition(tmp_path, {"a.png": {"Fish": box(0, 0)}})
    (tmp_path / "images" / "extra.png").write_bytes((tmp_path / "images" / "a.png").read_bytes())
    with pytest.raises(DataError, match=r"extra\.png: Image_Label lists every image"):
        scan_rle(data, str(tmp_path / "images"))
    (tmp_path / "images" / "extra.png").unlink()
    (tmp_path / "images" / "a.png").unlink()
    with pytest.raises(DataError, match=r"not in .*a.png: point image_root="):
        scan_rle(data, str(tmp_path / "images"))


def test_image_class_layout_gives_unlisted_images_empty_masks(tmp_path: Path) -> None:
    competition(tmp_path, {"a.png": {"1": box(0, 0)}, "b.png": {"1": box(0, 0)}})
    data = write_csv(
        tmp_path / "steel.csv",
        [("a.png", "3", rle_encode(box(2, 2)))],
        ("ImageId", "ClassId", "EncodedPixels"),
    )
    items = scan_rle(data, str(tmp_path / "images"))
    assert [p.name for p in items.images] == ["a.png", "b.png"]
    assert not items.masks(1).any() and items.masks(0).sum() == 64


# -- the samples and the scores -----------------------------------------------------------------


def test_samples_are_whole_images_or_crops_with_masks_alike(tmp_path: Path) -> None:
    data = competition(tmp_path, {"a.png": {"Fish": box(0, 0), "Sugar": box(4, 4)}})
    items = scan_rle(data, str(tmp_path / "images"))
    x, y = RLEDataset(items, train=False, augment=False)[0]
    assert x.shape == (3, H, W) and y.shape == (2, H, W) and y.dtype == torch.uint8
    assert torch.equal(y.bool(), torch.from_numpy(items.masks(0)))
    torch.manual_seed(0)
    x, y = RLEDataset(items, train=True, augment=True, crop=(16, 16))[0]
    assert x.shape == (3, 16, 16) and y.shape == (2, 16, 16)
    torch.manual_seed(0)  # a seed replays the random transforms
    assert torch.equal(RLEDataset(items, train=True, augment=True, crop=(16, 16))[0][1], y)
    exclusive = scan_rle(data, str(tmp_path / "images"), labels="multilabel")
    exclusive.multilabel = False
    _, labels = RLEDataset(exclusive, train=False, augment=False, image_size=(16, 24))[0]
    assert labels.shape == (16, 24) and set(labels.unique().tolist()) <= {0, 1, 2}


def test_competition_dice_per_class_does_not_depend_on_the_batches() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 3, 8, 8, generator=g)
    masks = (torch.rand(6, 3, 8, 8, generator=g) > 0.7).to(torch.uint8)
    masks[2] = 0  # empty masks count: empty vs empty scores 1
    whole = competition_dice((torch.sigmoid(logits) > 0.5).numpy(), masks.bool().numpy())
    scores = CompetitionScores(lambda lg, t: lg.sum() * 0, ["a", "b", "c"], multilabel=True)
    for part in ([0, 1, 2], [3], [4, 5]):
        scores.update(logits[part], masks[part])
    row = scores.as_dict()
    assert [row[f"dice_{c}"] for c in "abc"] == pytest.approx(whole.tolist(), abs=1e-12)
    assert row["dice"] == pytest.approx(float(whole.mean()), abs=1e-12)


def test_padding_to_the_encoders_stride_is_cropped_back() -> None:
    conv = torch.nn.Conv2d(3, 2, 3, padding=1)
    x = torch.randn(1, 3, 40, 50)
    assert torch.equal(padded_forward(conv, x)[..., :30, :30], conv(x)[..., :30, :30])


# -- exactness through the task's own step --------------------------------------------------


def test_the_tasks_step_accumulates_exactly_and_loss_over_n_does_not(tmp_path: Path) -> None:
    write_clouds_like(tmp_path, n=7, height=H, width=W, n_test=0)
    cfg = load_config(
        overrides=[
            f"data={tmp_path / 'train.csv'}",
            f"image_root={tmp_path / 'train_images'}",
            "task=segmentation",
            "valid_pct=0",
        ]
    )
    task = task_for(cfg)
    assert isinstance(task, KaggleSegmentationTask)
    items, _ = task.prepare(lambda _: None)
    assert task.multilabel
    ds, _ = task.datasets(items, items)
    window = torch.utils.data.default_collate([ds[i] for i in range(len(ds))])
    window = (window[0].double(), window[1])
    where = Placement(torch.device("cpu"))

    def grads(micro_batch: int | None, equal_weights: bool = False) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Conv2d(3, len(CLOUD_CLASSES), 3, padding=1).double()
        if micro_batch is None:  # the big batch, at once
            task.step(model, window, where)[0].backward()
            return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
        return window_gradients(
            model,
            window,
            lambda m: task.step(model, m, where),
            micro_batch,
            split=task.split,
            equal_weights=equal_weights,
        )

    def error(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
        return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))

    big = grads(None)
    for micro in (1, 2, 3):
        assert error(grads(micro), big) < 1e-12
    assert (
        error(grads(3, equal_weights=True), big) > 1e-6
    )  # micro-batches of 3, 2 and 2 weighed alike


# -- training, the submission, the ensemble ---------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("clouds")
    data = write_clouds_like(root / "data", n=24, height=H, width=W, n_test=4)
    cfg = load_config(
        overrides=[
            f"data={data / 'train.csv'}",
            f"image_root={data / 'train_images'}",
            "task=segmentation",
            "arch=unet",
            "encoder=resnet10t",
            "batch=8",
            "micro_batch=3",
            "epochs=2",
            "lr=3e-3",
            "valid_pct=0.25",
            "mask_size=16x24",
        ]
    )
    train(cfg, root / "run", log=lambda _: None, progress=False)
    return root / "run", data


def test_a_run_from_an_rle_csv_scores_each_class_and_tunes_its_rules(
    trained: tuple[Path, Path],
) -> None:
    run, _ = trained
    with (run / "history.csv").open(newline="") as f:
        header = next(csv.reader(f))
    assert {"dice", *(f"dice_{c}" for c in CLOUD_CLASSES)} <= set(header)
    rules = json.loads((run / "postprocess.json").read_text())
    assert rules["mask_size"] == [16, 24] and list(rules["classes"]) == list(CLOUD_CLASSES)
    info = json.loads((run / "task.json").read_text())
    assert info["rle"]["layout"] == "image_label" and info["rle"]["multilabel"]


def test_the_submission_decodes_to_the_predicted_masks(trained: tuple[Path, Path]) -> None:
    run, data = trained
    out = run.parent / "submission.csv"
    assert main(["predict", str(run), str(data / "test_images"), "--out", str(out)]) == 0
    table = read_rle_csv(out)
    assert table.layout == "image_label" and table.classes == list(CLOUD_CLASSES)
    loaded = load_submission_run(run)
    assert loaded.rules is not None
    for image in sorted((data / "test_images").iterdir()):
        probs = _probabilities(loaded, image, 2, torch.device("cpu"))
        at_size = resize_probabilities(probs[None], (16, 24))[0].numpy()
        expected = apply_rules(at_size, loaded.rules)
        assert np.array_equal(table.decode(image.name, (16, 24)), expected)
    assert oct(out.stat().st_mode & 0o777) == "0o644"


def test_an_ensemble_averages_runs_and_tunes_its_own_rules(
    trained: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, data = trained
    args = ["ensemble", str(run), str(run), "--images", str(data / "test_images")]
    assert main([*args, "--out", str(tmp_path), "--mask-size", "16x24"]) == 0
    assert "tuned on the 6 validation images' averaged probabilities" in capsys.readouterr().out
    # Two copies of one run average to that run: its validation probabilities, tuned.
    loaded = load_submission_run(run)
    data_csv, image_root, valid_pct, seed = loaded.split
    _, valid = split_items(scan_rle(data_csv, image_root), valid_pct, seed)
    probs = [_probabilities(loaded, path, 2, torch.device("cpu")) for path in valid.images]
    at_size = resize_probabilities(torch.stack(probs), (16, 24)).numpy()
    truth = np.stack(
        [
            F.interpolate(torch.from_numpy(valid.masks(i)).float()[None], size=(16, 24))[0] > 0.5
            for i in range(len(valid))
        ]
    )
    rules, _ = tune_rules(at_size, truth)
    saved = json.loads((tmp_path / "postprocess.json").read_text())["classes"]
    assert [(r["threshold"], r["min_size"]) for r in saved.values()] == [
        (r.threshold, r.min_size) for r in rules
    ]
    table = read_rle_csv(tmp_path / "submission.csv")
    for image in sorted((data / "test_images").iterdir()):
        p = _probabilities(loaded, image, 2, torch.device("cpu"))
        expected = apply_rules(resize_probabilities(p[None], (16, 24))[0].numpy(), rules)
        assert np.array_equal(table.decode(image.name, (16, 24)), expected)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--mask-size", "16by24"], "not HEIGHTxWIDTH"),
        (["--patch", "64"], "--patch is not an option"),
    ],
)
def test_predict_refuses_bad_options(
    trained: tuple[Path, Path], extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run, data = trained
    assert main(["predict", str(run), str(data / "test_images"), *extra]) == 2
    assert message in capsys.readouterr().err


def test_a_class_not_seen_in_training_is_refused(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    run, _ = trained
    copy = copy_run(run, tmp_path / "run")
    info = json.loads((copy / "task.json").read_text())
    info["classes"] = [*CLOUD_CLASSES[:3], "Ice"]
    (copy / "task.json").write_text(json.dumps(info))
    with pytest.raises(ConfigError, match="class 'Ice' was not seen in training"):
        load_submission_run(copy)


def test_options_that_need_rle_data_are_checked(tmp_path: Path) -> None:
    write_clouds_like(tmp_path, n=4, height=H, width=W, n_test=0)
    base = [f"data={tmp_path / 'train.csv'}", f"image_root={tmp_path / 'train_images'}"]
    with pytest.raises(ConfigError, match="crop='32by32' is not HEIGHTxWIDTH"):
        task_for(load_config(overrides=[*base, "task=segmentation", "crop=32by32"]))
    task = task_for(load_config(overrides=[*base, "task=segmentation", "crop=64x64"]))
    with pytest.raises(ConfigError, match="larger than the images"):
        task.prepare(lambda _: None)
    task = task_for(load_config(overrides=[*base, "task=segmentation", "loss=dice_batch"]))
    with pytest.raises(ConfigError, match="couples the samples"):
        task.prepare(lambda _: None)
    task = task_for(load_config(overrides=[*base, "task=segmentation", "cache=2GB"]))
    with pytest.raises(ConfigError, match="RLE data is decoded and augmented per sample"):
        task.prepare(lambda _: None)


@pytest.mark.slow
def test_exclusive_classes_in_the_severstal_layout_train_and_submit(tmp_path: Path) -> None:
    """ImageId,ClassId rows for non-empty masks only; classes that never share a pixel train as
    a softmax with the background, and the submission keeps the layout."""
    from PIL import Image

    rng = np.random.default_rng(0)
    (tmp_path / "images").mkdir()
    rows = []
    for i in range(10):
        image = rng.integers(0, 60, (H, W, 3)).astype(np.uint8)
        for c, left in (("1", 2), ("3", 26)):
            if rng.random() < 0.7:
                image[4:20, left : left + 12] = 200 if c == "1" else 120
                rows.append((f"s{i}.png", c, rle_encode(box(4, left, 16, 12))))
        Image.fromarray(image).save(tmp_path / "images" / f"s{i}.png")
    data = write_csv(tmp_path / "train.csv", rows, ("ImageId", "ClassId", "EncodedPixels"))
    cfg = load_config(
        overrides=[
            f"data={data}",
            f"image_root={tmp_path / 'images'}",
            "task=segmentation",
            "arch=unet",
            "encoder=resnet10t",
            "batch=4",
            "epochs=1",
            "valid_pct=0.3",
        ]
    )
    lines: list[str] = []
    train(cfg, tmp_path / "run", log=lines.append, progress=False)
    assert any("exclusive classes" in line for line in lines)
    info = json.loads((tmp_path / "run" / "task.json").read_text())
    assert info["num_classes"] == 3 and not info["rle"]["multilabel"]
    out = tmp_path / "submission.csv"
    assert (
        main(["predict", str(tmp_path / "run"), str(tmp_path / "images"), "--out", str(out)]) == 0
    )
    table = read_rle_csv(out)
    assert table.layout == "image_class" and table.classes == ["1", "3"]
    assert len(table.masks) == 10


# -- what first users met (issue 43) ------------------------------------------------------------


@pytest.fixture(scope="module")
def small_run(
    trained: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    """A second run of the same data, at half the resolution, trained from the data's folder
    with relative paths (as a user types them)."""
    _, data = trained
    out = tmp_path_factory.mktemp("small") / "run"
    here = Path.cwd()
    os.chdir(data)
    try:
        cfg = load_config(
            overrides=[
                "data=train.csv", "image_root=train_images", "task=segmentation", "arch=unet",
                "encoder=resnet10t", "batch=8", "micro_batch=4", "epochs=1", "valid_pct=0.25",
                "mask_size=16x24", "image_size=16x24",
            ]
        )  # fmt: skip
        train(cfg, out, log=lambda _: None, progress=False)
    finally:
        os.chdir(here)
    return out, data


def test_a_run_keeps_its_data_paths_absolute(small_run: tuple[Path, Path]) -> None:
    run, data = small_run
    saved = json.loads((run / "config.json").read_text())
    assert saved["data"] == str(data / "train.csv")
    assert saved["image_root"] == str(data / "train_images")


def test_runs_at_different_sizes_ensemble_from_another_folder(
    trained: tuple[Path, Path],
    small_run: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (run, data), (small, _) = trained, small_run
    monkeypatch.chdir(tmp_path)  # neither the runs' nor the data's folder
    args = ["ensemble", str(run), str(small), "--images", str(data / "test_images")]
    assert main([*args, "--out", str(tmp_path / "ens"), "--mask-size", "16x24"]) == 0
    assert "averaged probabilities" in capsys.readouterr().out
    table = read_rle_csv(tmp_path / "ens" / "submission.csv")
    # The mean of each run's probabilities brought to the mask size first.
    a, b = load_submission_run(run), load_submission_run(small)
    rules = [
        (r["threshold"], r["min_size"])
        for r in json.loads((tmp_path / "ens" / "postprocess.json").read_text())["classes"].values()
    ]
    from bigbatch.segmentation.postprocess import ClassRule

    for image in sorted((data / "test_images").iterdir()):
        mean = sum(
            resize_probabilities(_probabilities(r, image, 2, torch.device("cpu"))[None], (16, 24))[0]
            for r in (a, b)
        ) / 2  # fmt: skip
        expected = apply_rules(mean.numpy(), [ClassRule(t, m) for t, m in rules])
        assert np.array_equal(table.decode(image.name, (16, 24)), expected)


def test_an_ensemble_whose_training_data_moved_says_so_and_keeps_the_runs_rules(
    trained: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, data = trained
    moved = copy_run(run, tmp_path / "run")
    saved = json.loads((moved / "config.json").read_text())
    saved["data"] = str(tmp_path / "gone" / "train.csv")
    (moved / "config.json").write_text(json.dumps(saved))
    args = ["ensemble", str(moved), str(moved), "--images", str(data / "test_images")]
    assert main([*args, "--out", str(tmp_path / "ens"), "--mask-size", "16x24"]) == 0
    out = capsys.readouterr().out
    assert "not tuned again: the runs' training data" in out and "is not there" in out
    assert (tmp_path / "ens" / "submission.csv").is_file()


def test_predict_into_an_existing_folder_writes_the_submission_there(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    run, data = trained
    assert main(["predict", str(run), str(data / "test_images"), "--out", str(tmp_path)]) == 0
    assert read_rle_csv(tmp_path / "submission.csv").classes == list(CLOUD_CLASSES)


def test_tta_passes_are_distinct_flips_and_too_many_are_refused_first(
    trained: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from bigbatch.train.tasks.segmentation.tta import tta_flips

    assert tta_flips(2, 4) == [[], [3], [2], [3, 2]]  # was [], [3], [2], [3]: a repeat
    assert len({tuple(f) for f in tta_flips(3, 8)}) == 8
    run, data = trained
    out = tmp_path / "s.csv"
    assert main(["predict", str(run), str(data / "test_images"), "--tta", "5", "--out", str(out)]) == 2  # fmt: skip
    assert "give 1 to 4" in capsys.readouterr().err and not out.exists()


def test_a_damaged_postprocess_json_names_the_file_and_the_fix(
    trained: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, data = trained
    copy = copy_run(run, tmp_path / "run")
    (copy / "postprocess.json").write_text('{"classes": {"Fish": ')
    assert main(["predict", str(copy), str(data / "test_images")]) == 2
    err = capsys.readouterr().err
    assert f"{copy / 'postprocess.json'} is damaged" in err and "delete it" in err


def test_an_image_with_an_exif_orientation_is_refused_before_training(tmp_path: Path) -> None:
    """Its runs count the stored pixels; a viewer shows it rotated (seen: a crash after 37 s of
    planning, in the augmentation library)."""
    from PIL import Image

    data = competition(tmp_path, {"a.jpg": {"Fish": box(2, 2)}, "b.jpg": {"Fish": box(9, 9)}})
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees
    Image.fromarray(np.full((H, W, 3), 90, np.uint8)).save(tmp_path / "images" / "b.jpg", exif=exif)
    with pytest.raises(DataError, match=r"b.jpg carries an EXIF orientation \(6"):
        scan_rle(data, tmp_path / "images")


def test_the_run_records_which_images_were_held_out(trained: tuple[Path, Path]) -> None:
    run, _ = trained
    loaded = load_submission_run(run)
    data_csv, image_root, valid_pct, seed = loaded.split
    train_items, valid = split_items(scan_rle(data_csv, image_root), valid_pct, seed)
    split = json.loads((run / "split.json").read_text())
    assert split["valid"] == [str(p) for p in valid.images]
    assert split["train"] == [str(p) for p in train_items.images]
    assert not set(split["train"]) & set(split["valid"])


def test_conversions_and_other_sizes_are_said(
    trained: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Greyscale and RGBA images were read as RGB, and test images of another size resized,
    without a word."""
    from PIL import Image

    from bigbatch.train.tasks.segmentation.rle_data import conversion_note

    data = competition(tmp_path, {"a.png": {"Fish": box(2, 2)}, "b.png": {"Fish": box(9, 9)}})
    Image.fromarray(np.full((H, W), 90, np.uint8)).save(tmp_path / "images" / "a.png")
    Image.fromarray(np.full((H, W, 4), 90, np.uint8)).save(tmp_path / "images" / "b.png")
    modes = scan_rle(data, tmp_path / "images").modes
    assert conversion_note(modes) == (
        "1 greyscale image(s) read as RGB (the grey repeated); 1 with transparency read as RGB "
        "(the alpha dropped)"
    )
    run, clouds = trained
    test = tmp_path / "test"
    test.mkdir()
    for image in sorted((clouds / "test_images").iterdir())[:2]:
        Image.open(image).transpose(Image.Transpose.TRANSPOSE).save(test / image.name)
    assert main(["predict", str(run), str(test), "--out", str(tmp_path / "s.csv")]) == 0
    out = capsys.readouterr().out
    assert f"2 test image(s) are not {H}x{W} like the training images" in out
    assert f"2 of them transposed ({W}x{H})" in out


def test_a_mask_size_with_height_and_width_swapped_is_refused(
    trained: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Seen: --mask-size 24x16 for landscape images wrote a valid-looking submission at the
    wrong orientation (Dice 0.661 instead of 0.940 read at the true size)."""
    run, data = trained
    out = tmp_path / "s.csv"
    argv = ["predict", str(run), str(data / "test_images"), "--out", str(out)]
    assert main([*argv, "--mask-size", "24x16"]) == 2
    err = capsys.readouterr().err
    assert "--mask-size 24x16 is HEIGHTxWIDTH, portrait, but the test images are landscape" in err
    assert "the run's rules were tuned at 16x24: give --mask-size 16x24" in err
    assert not out.exists()
    assert main([*argv, "--mask-size", "32x48"]) == 0  # the same orientation: resized, as asked


def test_predicting_an_unfinished_run_says_so_and_how_to_go_on(
    trained: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Seen: a run stopped after its first epoch wrote a threshold-0.5 submission "(the run
    had no validation set)", though it had one."""
    run, data = trained
    copy = copy_run(run, tmp_path / "run")
    (copy / "done.json").unlink()
    (copy / "postprocess.json").unlink()  # tuned when a run finishes
    argv = ["predict", str(copy), str(data / "test_images"), "--out", str(tmp_path / "s.csv")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{copy} is an unfinished run (it stopped after epoch 2)" in err
    assert f"`bigbatch train --resume {copy}` finishes it; or add --unfinished" in err
    assert main([*argv, "--unfinished"]) == 0
    out = capsys.readouterr().out
    assert "threshold 0.5, no components dropped (the run is unfinished: its rules are" in out
    assert "had no validation set" not in out


def test_hidden_files_in_the_test_folder_are_no_submission_rows(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    run, data = trained
    images = tmp_path / "test"
    shutil.copytree(data / "test_images", images)
    first = sorted(images.iterdir())[0]
    shutil.copy(first, images / f"._{first.name}")  # macOS's resource-fork copy
    (images / ".ipynb_checkpoints").mkdir()
    shutil.copy(first, images / ".ipynb_checkpoints" / first.name)
    out = tmp_path / "s.csv"
    assert main(["predict", str(run), str(images), "--out", str(out)]) == 0
    assert sorted(read_rle_csv(out).masks) == sorted(
        p.name for p in (data / "test_images").iterdir()
    )


@pytest.mark.parametrize(
    ("rule", "said"),
    [
        ({"threshold": 1.5, "min_size": 0}, "threshold 1.5"),
        ({"threshold": 0.5, "min_size": -3}, "min_size -3"),
    ],
)
def test_a_hand_edited_rule_out_of_range_is_refused(
    trained: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    rule: dict[str, float],
    said: str,
) -> None:
    run, data = trained
    copy = copy_run(run, tmp_path / "run")
    rules = json.loads((copy / "postprocess.json").read_text())
    rules["classes"][CLOUD_CLASSES[0]] |= rule
    (copy / "postprocess.json").write_text(json.dumps(rules))
    assert main(["predict", str(copy), str(data / "test_images")]) == 2
    err = capsys.readouterr().err
    assert f"class {CLOUD_CLASSES[0]!r} has" in err and said in err and "a threshold is a" in err


def test_a_second_ensemble_into_a_busy_folder_is_refused(
    trained: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from bigbatch.io import lock_folder

    run, data = trained
    args = ["ensemble", str(run), str(run), "--images", str(data / "test_images")]
    with lock_folder(tmp_path / "ens", "--out"):  # another ensemble writing there
        assert main([*args, "--out", str(tmp_path / "ens")]) == 2
    assert "is in use by" in capsys.readouterr().err
    assert not (tmp_path / "ens" / "submission.csv").exists()


def test_a_class_only_in_validation_and_a_gap_in_class_ids_are_said() -> None:
    from bigbatch.segmentation.rle import RLETable
    from bigbatch.train.tasks.segmentation.kaggle import class_notes
    from bigbatch.train.tasks.segmentation.rle_data import RLEItems

    masks = {"a.png": {"1": "1 2", "4": ""}, "b.png": {"2": "3 1"}, "c.png": {"4": "1 1"}}
    table = RLETable("image_class", ["1", "2", "4"], masks)

    def items(*names: str) -> RLEItems:
        return RLEItems(table, [Path(n) for n in names], [(4, 4)] * len(names), True)

    notes = class_notes(items("a.png", "b.png"), items("c.png"))
    assert notes[0].startswith("class 4 has masks only in the validation images")
    assert (
        notes[1]
        == "class id(s) 3 have no mask in the CSV: the run learns and submits classes 1, 2, 4 only"
    )
    assert class_notes(items("a.png", "b.png", "c.png"), items()) == [notes[1]]
