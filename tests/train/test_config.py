from pathlib import Path

import pytest

from bigbatch.train.config import ConfigError, load_config


def test_file_then_overrides(tmp_path: Path) -> None:
    f = tmp_path / "run.toml"
    f.write_text('data = "images"\nepochs = 7\narch = "resnet10t"\naugment = false\n')
    cfg = load_config(f, ["epochs=2", "lr=3e-4"])
    assert (cfg.data, cfg.epochs, cfg.arch, cfg.augment, cfg.lr) == (
        "images",
        2,
        "resnet10t",
        False,
        3e-4,
    )


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["data=x", "epoch=3"], "unknown key 'epoch'.*did you mean epochs"),
        (["data=x", "epochs=three"], "epochs takes an integer"),
        (["data=x", "augment=maybe"], "true or false"),
        (["data=x", "mode=train"], "mode=.train. is not one of auto, fine_tune, fit"),
        (["data=x", "batch=0"], "batch must be >= 1"),
        (["epochs=1"], "data is not set"),
        (["data=x", "novalue"], "key=value"),
    ],
)
def test_bad_config_names_the_fix(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(overrides=overrides)


def test_keys_this_run_would_not_read_are_refused(tmp_path: Path) -> None:
    """valid_pct= beside valid=, image_root= for folders, freeze_epochs= where no head trains
    alone: each would be ignored, so each is refused naming the fix; the same keys where they
    are read pass."""
    folder, csv = tmp_path / "images", tmp_path / "train.csv"
    folder.mkdir()
    csv.write_text("file,label\n")
    for overrides, match in [
        ([f"data={folder}", f"valid={folder}", "valid_pct=0.1"],
         "valid_pct=0.1 splits data= when valid= is empty, and valid=.* is given: drop one"),
        ([f"data={folder}", "image_root=imgs"], "image_root= is where a CSV's files are, and "
         "data=.* is a folder: drop image_root"),
        ([f"data={folder}", "freeze_epochs=3"], "freeze_epochs=3: the head trains alone only "
         "when fine-tuning .*: set mode=fine_tune, or drop freeze_epochs"),
        ([f"data={folder}", "task=segmentation", "freeze_epochs=2"],
         "freeze_epochs=2: task=segmentation trains no head alone, .*: drop freeze_epochs"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError, match=match):
            load_config(overrides=overrides)
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"")
    for overrides in [
        [f"data={folder}", f"valid={folder}"],
        [f"data={csv}", "image_root=imgs", "valid_pct=0.1"],
        [f"data={folder}", f"valid={csv}", "image_root=imgs"],  # valid='s files
        [f"data={folder}", "freeze_epochs=3", "mode=fine_tune"],
        [f"data={folder}", "freeze_epochs=3", f"weights={weights}"],  # auto: fine-tunes
    ]:
        load_config(overrides=overrides)
    # A resumed run (its saved config the base) goes on as it trained, by an older bigbatch
    # that let such keys be.
    saved = load_config(overrides=[f"data={folder}", f"valid={folder}"])
    saved.valid_pct = 0.1
    assert load_config(overrides=["epochs=2"], base=saved).valid_pct == 0.1
    # The task's own such keys (TaskOptions.check_read) too.
    saved = load_config(overrides=[f"data={folder}", "augment=false"])
    saved.options.auto_augment = "trivialaugment"
    assert load_config(overrides=["epochs=2"], base=saved).options.auto_augment
    saved = load_config(overrides=[f"data={folder}", "task=segmentation", "model=m:f"])
    saved.options.widths, saved.options.crop = "8,16", "16x16"
    assert load_config(overrides=["epochs=2"], base=saved).options.crop == "16x16"
    with pytest.raises(ConfigError, match="crop=16x16: for a Kaggle RLE CSV"):
        load_config(overrides=[f"data={folder}", "task=segmentation", "crop=16x16"])


def test_unknown_key_in_file(tmp_path: Path) -> None:
    f = tmp_path / "run.toml"
    f.write_text('data = "x"\nlearning_rate = 0.1\n')
    with pytest.raises(ConfigError, match="unknown key 'learning_rate'"):
        load_config(f)


def test_the_training_command_is_importable_for_notebooks() -> None:
    import bigbatch.train
    from bigbatch.train.config import load_config
    from bigbatch.train.loop import train

    assert bigbatch.train.train is train and bigbatch.train.load_config is load_config
    assert bigbatch.train.load_config(None, ["data=x", "epochs=3"]).epochs == 3


def test_a_tasks_own_keys_live_in_its_options() -> None:
    seg = load_config(overrides=["data=x", "task=segmentation", "loss=dice", "num_classes=3"])
    assert (seg.options.loss, seg.options.num_classes) == ("dice", 3)
    assert not hasattr(seg, "loss")  # the shared config knows no task's keys
    cls = load_config(overrides=["data=x", "mixup=0.4"])
    assert cls.options.mixup == 0.4 and cls.fine_tunes is False
    assert load_config(overrides=["data=x", "pretrained=true"]).fine_tunes  # a head to train
    assert not load_config(overrides=["data=x", "task=segmentation", "weights="]).fine_tunes


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        # Another task's key is refused with the task that reads it, not ignored.
        (["data=x", "loss=dice"], "loss .in the overrides. is a key of task=segmentation or "
         "task=regression, and this run is task=classification, which does not read it: drop "
         "it, or set task=segmentation or task=regression"),
        (["data=x", "task=segmentation", "mixup=0.2"], "mixup .* is a key of task=classification"),
        # Each task checks its own values.
        (["data=x", "task=segmentation", "loss=focal"], "loss='focal' is not one of dice_ce"),
        (["data=x", "task=segmentation", "pos_neg=-1"], "pos_neg must be >= 0"),
        (["data=x", "task=segmentation", "mode=fine_tune"], "mode=fine_tune trains a classifier"),
        (["data=x", "label_smoothing=1"], "label_smoothing must be in .0, 1."),
        (["data=x", "auto_augment=bogus"], "auto_augment='bogus': give a timm policy"),
        (["data=x", "auto_augment=trivialaugment", "augment=false"],
         "auto_augment=trivialaugment augments the training images, and augment=false"),
        (["data=x", "task=segmentation", "num_clases=2"], "did you mean num_classes"),
    ],
)  # fmt: skip
def test_task_keys_are_checked_by_their_task(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(overrides=overrides)


def test_task_in_the_overrides_decides_for_the_files_keys(tmp_path: Path) -> None:
    f = tmp_path / "run.toml"
    f.write_text('data = "x"\nloss = "dice"\n')  # a segmentation key; task= comes after
    assert load_config(f, ["task=segmentation"]).options.loss == "dice"
    with pytest.raises(ConfigError, match=rf"loss \(in {f}\) is a key of task=segmentation"):
        load_config(f)


def test_the_saved_config_round_trips_flat(tmp_path: Path) -> None:
    import json

    from bigbatch.train.config import config_from_json
    from bigbatch.train.run_dir import config_toml

    cfg = load_config(overrides=["data=x", "task=segmentation", "loss=dice", "regions=wt:1,2"])
    saved = cfg.to_dict()
    assert saved["loss"] == "dice" and "mixup" not in saved and "options" not in saved
    assert config_from_json(json.dumps(saved)).to_dict() == saved
    (tmp_path / "config.toml").write_text(config_toml(cfg))
    assert load_config(tmp_path / "config.toml").to_dict() == saved
    # A config.json that an older bigbatch wrote with every task's keys still reads.
    old = saved | {"mixup": 0.0, "item_transform": "squish"}
    assert config_from_json(json.dumps(old)).to_dict() == saved
