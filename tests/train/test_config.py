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
