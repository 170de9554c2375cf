"""Segmentation data that cannot fail silently: every defect a new user met, refused (or read
right) before training or before the first mask is written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from bigbatch.cli.main import main
from bigbatch.segmentation.synthetic import write_blobs_3d
from bigbatch.train.config import ConfigError, load_config
from bigbatch.train.data import DataError
from bigbatch.train.tasks.segmentation.data import scan_segmentation
from bigbatch.train.tasks.segmentation.task import SegmentationTask, build_seg_model

pytest.importorskip("monai")
COMMON = [
    "task=segmentation",
    "arch=unet",
    "num_workers=0",
    "threads=1",
    "device=cpu",
    "widths=4,8",
]


def pair(root: Path, name: str, image: np.ndarray, mask: np.ndarray, mask_name: str = "") -> None:
    from PIL import Image

    (root / "images").mkdir(parents=True, exist_ok=True)
    (root / "masks").mkdir(parents=True, exist_ok=True)
    Image.fromarray(image).save(root / "images" / name)
    Image.fromarray(mask).save(root / "masks" / (mask_name or name))


def shapes(root: Path, n: int = 4, values: tuple[int, ...] = (0, 1, 2)) -> Path:
    rng = np.random.default_rng(0)
    for i in range(n):
        mask = rng.choice(values, size=(16, 16)).astype(np.uint8)
        pair(root, f"c{i}.png", rng.integers(0, 255, (16, 16, 3), dtype=np.uint8), mask)
    return root


def test_255_is_the_void_label_not_a_256th_class(tmp_path: Path) -> None:
    items = scan_segmentation(shapes(tmp_path / "d", values=(0, 1, 2, 255)))
    assert (items.num_classes, items.void) == (3, 255)
    binary = scan_segmentation(shapes(tmp_path / "b", values=(0, 255)))
    assert (binary.num_classes, binary.void, binary.binary_255) == (1, None, True)
    off = scan_segmentation(shapes(tmp_path / "o", values=(0, 1, 7)), ignore_index=-1)
    assert off.num_classes == 8


def test_lossy_masks_are_refused(tmp_path: Path) -> None:
    image = np.zeros((16, 16, 3), dtype=np.uint8)
    mask = np.zeros((16, 16), dtype=np.uint8)
    mask[4:8, 4:8] = 255
    pair(tmp_path, "a.png", image, mask, "a.jpg")
    with pytest.raises(DataError, match=r"a\.jpg is a JPEG.*Save masks losslessly"):
        scan_segmentation(tmp_path)


def test_colour_coded_masks_need_a_palette(tmp_path: Path) -> None:
    image = np.zeros((16, 16, 3), dtype=np.uint8)
    mask = np.zeros((16, 16, 3), dtype=np.uint8)
    mask[:8, :, 0] = 255  # red: class 1
    mask[8:, :8, 1] = 255  # green: class 2 (the red channel alone would call it background)
    pair(tmp_path, "a.png", image, mask)
    with pytest.raises(DataError, match=r"colour-coded.*palette="):
        scan_segmentation(tmp_path)
    items = scan_segmentation(tmp_path, palette="0,0,0;255,0,0;0,255,0")
    assert items.num_classes == 3
    assert set(np.unique(items.labels(0))) == {0, 1, 2}
    with pytest.raises(DataError, match="0,255,0, which palette= does not list"):
        scan_segmentation(tmp_path, palette="0,0,0;255,0,0")


def test_all_background_masks_are_refused(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"every mask .* is background"):
        scan_segmentation(shapes(tmp_path, values=(0,)))


def test_a_2d_csv_row_with_two_images_is_refused(tmp_path: Path) -> None:
    shapes(tmp_path)
    (tmp_path / "data.csv").write_text("image,mask\nimages/c0.png;images/c1.png,masks/c0.png\n")
    with pytest.raises(DataError, match="a 2D row has one image"):
        scan_segmentation(tmp_path / "data.csv")


def test_csv_with_a_byte_order_mark_reads_and_latin1_is_refused_with_the_fix(
    tmp_path: Path,
) -> None:
    shapes(tmp_path)
    (tmp_path / "bom.csv").write_bytes("\ufeffimage,mask\nimages/c0.png,masks/c0.png\n".encode())
    assert len(scan_segmentation(tmp_path / "bom.csv")) == 1
    (tmp_path / "latin.csv").write_bytes(
        "image,mask,note\nimages/c0.png,masks/c0.png,caf\xe9\n".encode("latin-1")
    )
    with pytest.raises(DataError, match=r"not UTF-8 .* save it as UTF-8"):
        scan_segmentation(tmp_path / "latin.csv")


def test_non_finite_training_volumes_are_named(tmp_path: Path) -> None:
    data = write_blobs_3d(tmp_path / "blobs", n=3, size=8, channels=1)
    bad = sorted((data / "images").iterdir())[1]
    volume = np.load(bad)
    volume.flat[0] = np.nan
    np.save(bad, volume)
    with pytest.raises(DataError, match=rf"{bad.name} holds 1 NaN or infinite voxel"):
        scan_segmentation(data)


def test_a_validation_set_unlike_the_training_set_is_refused_before_training(
    tmp_path: Path,
) -> None:
    train = write_blobs_3d(tmp_path / "t", n=3, size=8, channels=2)
    other = write_blobs_3d(tmp_path / "v", n=2, size=8, channels=1)
    cfg = load_config(overrides=[f"data={train}", f"valid={other}", *COMMON, "size=8"])
    with pytest.raises(DataError, match=r"1 channel.*the training data 2"):
        SegmentationTask(cfg).prepare(lambda _: None)
    images = shapes(tmp_path / "flat")
    cfg = load_config(overrides=[f"data={train}", f"valid={images}", *COMMON, "size=8"])
    with pytest.raises(DataError, match="holds 2D data but training is 3D"):
        SegmentationTask(cfg).prepare(lambda _: None)


def test_weights_load_for_segmentation_and_misfits_are_refused(tmp_path: Path) -> None:
    data = shapes(tmp_path / "d")
    cfg = load_config(overrides=[f"data={data}", *COMMON, "arch=unet", "size=16"])
    source = build_seg_model(cfg, 3, 3, 2)()
    weights = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(weights))
    cfg.weights = str(weights)
    loaded = build_seg_model(cfg, 3, 3, 2)()
    for name, t in source.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    assert cfg.fine_tunes is False  # every layer trains from the weights, not a random decoder
    from bigbatch.train.optim import mode_line

    assert mode_line(cfg) == f"mode: fit (every layer trains, starting from weights={weights})"
    cfg.options.widths = "8,16"
    with pytest.raises(ConfigError, match="does not fit this network"):
        build_seg_model(cfg, 3, 3, 2)()


def test_pretrained_without_pretrained_weights_and_fine_tune_mode_are_refused(
    tmp_path: Path,
) -> None:
    data = shapes(tmp_path / "d")
    cfg = load_config(overrides=[f"data={data}", *COMMON, "arch=unet", "pretrained=true"])
    with pytest.raises(ConfigError, match="arch=unet has no pretrained weights"):
        build_seg_model(cfg, 3, 3, 2)
    with pytest.raises(ConfigError, match="mode=fine_tune trains a classifier's head"):
        load_config(overrides=[f"data={data}", *COMMON, "mode=fine_tune"])


def test_the_keys_of_an_rle_csv_are_refused_for_files_of_images_and_masks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """crop=, image_size=, labels=, mask_size= are read for a Kaggle RLE CSV alone, pos_neg=
    for volumes: given for a folder of 2D images and masks, which trains at size=, they are
    refused before the run starts, not ignored."""
    data = shapes(tmp_path / "d")
    out = tmp_path / "run"
    for keys, said in [
        (["crop=16x16"], "crop=16x16: for a Kaggle RLE CSV"),
        (["labels=exclusive", "mask_size=32x48"], "labels=exclusive, mask_size=32x48: for a "),
    ]:  # fmt: skip
        assert main(["train", "--out", str(out), f"data={data}", *COMMON, "size=16", *keys]) == 2
        err = capsys.readouterr().err
        assert said in err and "trained at size=16: drop" in err
        assert not (out / "config.json").exists()  # before the run starts
    # The volumes' patch odds, for 2D images (resized whole): refused too.
    cfg = load_config(overrides=[f"data={data}", *COMMON, "size=16", "pos_neg=2"])
    with pytest.raises(ConfigError, match=r"pos_neg=2\.0 sets the odds of a volume's patches; 2D"):
        SegmentationTask(cfg).prepare(lambda _: None)
    build_seg_model(cfg, 3, 2, 2)  # at training alone: predict builds a run's network as it was


@pytest.fixture
def trained_2d(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("run2d")
    data = shapes(root / "d", n=6)
    args = [f"data={data}", *COMMON, "size=16", "batch=4", "epochs=1", "valid_pct=0.34"]
    assert main(["train", "--out", str(root / "run"), *args]) == 0
    return root / "run"


@pytest.mark.slow
def test_predict_refuses_colliding_outputs_and_bad_inputs_before_writing_any_mask(
    trained_2d: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from PIL import Image

    test = tmp_path / "test"
    test.mkdir()
    Image.fromarray(np.zeros((16, 16, 3), dtype=np.uint8)).save(test / "a.png")
    Image.fromarray(np.zeros((16, 16, 3), dtype=np.uint8)).save(test / "a.jpg")
    out = tmp_path / "masks"
    assert main(["predict", str(trained_2d), str(test), "--out", str(out)]) == 2
    assert "a.jpg and a.png would both write" in capsys.readouterr().err
    assert not out.exists() or not list(out.iterdir())
    (test / "a.jpg").unlink()
    (test / "z.png").write_bytes(b"not a png")  # sorted after a.png: would fail after it
    assert main(["predict", str(trained_2d), str(test), "--out", str(out)]) == 2
    assert "z.png" in capsys.readouterr().err
    assert not out.exists() or not list(out.iterdir())


@pytest.mark.slow
def test_a_damaged_task_file_is_named(trained_2d: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (trained_2d / "task.json").write_text('{"task": "segmen')
    assert main(["predict", str(trained_2d), str(trained_2d)]) == 2
    err = capsys.readouterr().err
    assert "task.json is damaged" in err and "unknown architecture" not in err


@pytest.mark.slow
def test_a_nan_volume_is_refused_by_predict_before_any_mask(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = write_blobs_3d(tmp_path / "blobs", n=4, size=16, channels=1)
    args = [f"data={data}", *COMMON, "size=16", "batch=2", "epochs=1", "valid_pct=0.25"]
    assert main(["train", "--out", str(tmp_path / "run"), *args]) == 0
    test = tmp_path / "test"
    test.mkdir()
    volume = np.random.default_rng(0).normal(size=(16, 16, 16)).astype(np.float32)
    np.save(test / "a.npy", volume)
    volume[3, 3, 3] = np.nan
    np.save(test / "b.npy", volume)
    assert main(["predict", str(tmp_path / "run"), str(test), "--out", str(tmp_path / "m")]) == 2
    assert "b.npy holds 1 NaN" in capsys.readouterr().err
    assert not (tmp_path / "m" / "a.npy").exists()


@pytest.mark.slow
def test_nifti_resampled_to_spacing_predicts_in_the_inputs_geometry(tmp_path: Path) -> None:
    import nibabel as nib

    data = tmp_path / "nifti"
    (data / "images").mkdir(parents=True)
    (data / "masks").mkdir()
    rng = np.random.default_rng(0)
    affine = np.diag([1.0, 1.0, 2.0, 1.0])  # anisotropic: 2 mm slices
    for i in range(4):
        mask = np.zeros((16, 16, 8), dtype=np.uint8)
        mask[4:10, 5:11, 2:5] = 1
        image = rng.normal(size=mask.shape).astype(np.float32) + 3 * mask
        nib.save(nib.Nifti1Image(image, affine), str(data / "images" / f"c{i}.nii.gz"))
        nib.save(nib.Nifti1Image(mask, affine), str(data / "masks" / f"c{i}.nii.gz"))
    args = [f"data={data}", *COMMON, "size=16", "batch=2", "epochs=1", "valid_pct=0.25",
            "spacing=1,1,1"]  # fmt: skip
    assert main(["train", "--out", str(tmp_path / "run"), *args]) == 0
    out = tmp_path / "masks"
    assert main(["predict", str(tmp_path / "run"), str(data / "images"), "--out", str(out)]) == 0
    written = nib.load(str(out / "c0.nii.gz"))
    assert written.shape == (16, 16, 8)
    assert np.allclose(written.affine, affine) and written.header.get_zooms()[:3] == (1, 1, 2)
    history = (tmp_path / "run" / "history.csv").read_text().splitlines()[0].split(",")
    assert {"dice", "jaccard", "hd95"} <= set(history)
    info = json.loads((tmp_path / "run" / "task.json").read_text())
    assert info["dims"] == 3


@pytest.mark.slow
def test_a_batch_loss_trains_through_gradient_caching(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bigbatch.train.loop import train

    data = shapes(tmp_path / "d", n=6)
    common = [f"data={data}", *COMMON, "size=16", "batch=4", "epochs=1", "valid_pct=0.34",
              "loss=dice_batch", "optimizer=sgd", "schedule=cosine"]  # fmt: skip

    def run(name: str, micro: int) -> dict[str, torch.Tensor]:
        cfg = load_config(overrides=[*common, f"micro_batch={micro}"])
        train(cfg, tmp_path / name, progress=False, log=lambda _: None)
        return load_file(tmp_path / name / "last.safetensors")

    def diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
        return max(float((a[n] - b[n]).abs().max()) for n in a)

    big, cached = run("big", 4), run("cached", 1)
    # The negative control: the same batch loss per micro-batch (no gradient caching).
    monkeypatch.setattr(SegmentationTask, "couples_samples", property(lambda self: False))
    naive = run("naive", 1)
    # float32 round-off (another summation order) against another objective: far apart.
    assert diff(cached, big) * 100 < diff(naive, big)


def test_large_sets_are_checked_from_headers_and_each_volume_when_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import bigbatch.train.tasks.segmentation.data as segdata
    from bigbatch.segmentation.synthetic import write_brats_like

    csv_path = write_brats_like(tmp_path, n=2, shape=(8, 8, 4))
    full = scan_segmentation(csv_path)
    case = full.images[0]
    assert segdata.case_shape(case) == segdata.read_case(case, 3).array.shape == (4, 8, 8, 4)
    t1 = case[0]
    import nibabel as nib

    image = nib.load(str(t1))
    volume = np.asarray(image.dataobj).copy()
    volume[0, 0, 0] = np.nan
    nib.save(nib.Nifti1Image(volume, image.affine), str(t1))
    monkeypatch.setattr(segdata, "FULL_CHECK_BYTES", 0)  # as if the set were large
    items = scan_segmentation(csv_path)  # shapes from the headers: the NaN is not read yet
    with pytest.raises(DataError, match=rf"{t1.name} holds 1 NaN"):
        segdata.SegDataset(items, 8, train=True, augment=False)[0]


def test_npy_headers_are_parsed_one_thread_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MONAI's CacheDataset reads cases from a thread pool; numpy parses each .npy header with
    ast.literal_eval, and CPython 3.11's AST constructor fails ("SystemError: AST constructor
    recursion depth mismatch") when two threads build ASTs at once. Parses must not overlap."""
    import ast
    import threading
    import time

    import bigbatch.train.tasks.segmentation.data as segdata

    files = []
    for i in range(4):
        files.append(tmp_path / f"v{i}.npy")
        np.save(files[-1], np.full((2, 3, 4), i, np.float32))
    inside, most = [0], [0]
    guard = threading.Lock()
    literal_eval = ast.literal_eval

    def slow_parse(text: str) -> object:
        with guard:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.02)  # a parse long enough for the others to arrive: they must wait
        with guard:
            inside[0] -= 1
        return literal_eval(text)

    monkeypatch.setattr(ast, "literal_eval", slow_parse)
    start = threading.Barrier(len(files))
    arrays: dict[int, np.ndarray] = {}
    shapes: dict[int, tuple[int, ...]] = {}

    def read(i: int) -> None:
        start.wait()
        arrays[i] = segdata.read_volume(files[i]).array
        shapes[i] = segdata.case_shape([files[i]])

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(files))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 1
    for i in range(len(files)):
        assert type(arrays[i]) is np.ndarray and arrays[i].shape == (2, 3, 4)
        assert (arrays[i] == i).all() and shapes[i] == (1, 2, 3, 4)


def test_volumes_are_z_scored_over_the_foreground_and_patches_favour_the_labels(
    tmp_path: Path,
) -> None:
    from bigbatch.train.tasks.segmentation.data import SegDataset, VolumeRecipe, standardise

    head = torch.zeros(1, 8, 8, 8)
    head[0, 2:6, 2:6, 2:6] = torch.arange(64, dtype=torch.float32).view(4, 4, 4) + 100
    z = standardise(head)
    inside = z[0, 2:6, 2:6, 2:6]
    assert abs(float(inside.mean())) < 1e-5 and abs(float(inside.std(unbiased=False)) - 1) < 1e-4
    assert float(z[0, 0].abs().max()) == 0.0  # the air around the head stays 0, unscaled

    data = tmp_path / "lesion"
    (data / "images").mkdir(parents=True)
    (data / "masks").mkdir()
    mask = np.zeros((32, 32, 32), dtype=np.int64)
    mask[26:30, 26:30, 26:30] = 1  # a small lesion in a corner
    np.save(
        data / "images" / "a.npy",
        np.random.default_rng(0).normal(size=mask.shape).astype(np.float32),
    )
    np.save(data / "masks" / "a.npy", mask)
    items = scan_segmentation(data)

    def hits(pos_neg: float) -> int:
        ds = SegDataset(
            items, 8, train=True, augment=False, recipe=VolumeRecipe(8, pos_neg=pos_neg)
        )
        torch.manual_seed(0)
        return sum(int(ds[0][1].any()) for _ in range(40))

    assert hits(1.0) >= 15 and hits(0.0) <= 5  # a random 8^3 patch rarely meets a 4^3 lesion


def test_16_bit_2d_images_are_scaled_not_clipped(tmp_path: Path) -> None:
    from PIL import Image

    from bigbatch.train.tasks.segmentation.data import read_image

    (tmp_path / "images").mkdir()
    (tmp_path / "masks").mkdir()
    pixels = np.array([[0, 1000], [3000, 4095]], dtype=np.uint16)
    Image.fromarray(pixels).save(tmp_path / "images" / "x.png")
    Image.fromarray(np.array([[0, 0], [1, 1]], dtype=np.uint8)).save(tmp_path / "masks" / "x.png")
    image = read_image([tmp_path / "images" / "x.png"], 2)
    # PIL's convert("RGB") would give 255 for every non-zero pixel.
    assert np.allclose(image[0], pixels / 4095 * 255, atol=1e-3) and image.shape == (3, 2, 2)


@pytest.mark.slow
def test_the_plan_of_a_batch_loss_leaves_room_for_the_window(tmp_path: Path) -> None:
    """loss=dice_batch: the planner counts what gradient caching holds for the window (its
    outputs, their gradient, the loss at the whole window) and says so."""
    from bigbatch.train.loop import train

    data = shapes(tmp_path / "d", n=6)
    said: list[str] = []
    cfg = load_config(
        overrides=[f"data={data}", *COMMON, "size=16", "batch=4", "epochs=1", "valid_pct=0.34",
                   "loss=dice_batch", "optimizer=sgd", "budget=4GB"]
    )  # fmt: skip
    train(cfg, tmp_path / "run", progress=False, log=said.append)
    line = next(s for s in said if "couples the samples" in s)
    assert "held for the window of 4" in line, said
