"""The ensemble checks everything before it trains anything (issue 8): the experiments file,
every member's config and model, the data, the test images and the sample submission."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "train"))
from bigbatch.train.config import ConfigError
from bigbatch.train.ensemble import run_ensemble
from bigbatch.train.tasks.classification.experiments import submission_ids
from tiny_runs import TINY_MODEL, write_images

COMMON = """[common]
data = "train"
model = "tinymodel:tiny"
size = 16
batch = 12
micro_batch = 4
epochs = 1
device = "cpu"
num_workers = 0
"""


@pytest.fixture
def comp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A small competition: train/, test/ (6 images), sample_submission.csv, the tiny model."""
    write_images(tmp_path / "train", n_per_class=6)
    write_images(tmp_path / "test", n_per_class=2, seed=7)
    names = sorted(p.name for p in (tmp_path / "test").rglob("*.png"))
    (tmp_path / "sample.csv").write_text("id,label\n" + "".join(f"{n},x\n" for n in names))
    (tmp_path / "tinymodel.py").write_text(TINY_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("tinymodel", None)
    return tmp_path


def _experiments(
    comp: Path, member2: str = "", ensemble: str = 'test = "test"\nsample_submission = "sample.csv"'
) -> Path:
    path = comp / "exp.toml"
    path.write_text(
        f'{COMMON}\n[ensemble]\n{ensemble}\n\n[[member]]\nname = "m1"\n\n'
        f'[[member]]\nname = "m2"\n{member2}\n'
    )
    return path


BAD = {
    "misspelled arch in member 2": (
        {"member2": 'model = ""\narch = "resnet19"'},
        "member m2: unknown architecture 'resnet19'",
    ),
    "bad weight_decay in member 2": (
        {"member2": "weight_decay = -1"},
        "member m2: weight_decay must be >= 0",
    ),
    "weight heavy": ({"member2": 'weight = "heavy"'}, "weight is a number >= 0, got 'heavy'"),
    "tta four": ({"ensemble": 'test = "test"\ntta = "four"'}, "tta is a number of passes >= 1"),
    "tta 0": ({"ensemble": 'test = "test"\ntta = 0'}, "got 0"),
    "different seeds": ({"member2": "seed = 7"}, "differ in seed"),
    "escaping member name": ({"member2": 'name = "../../x"'}, "member name '../../x' must be"),
    "missing sample submission": (
        {"ensemble": 'test = "test"\nsample_submission = "nope.csv"'},
        "does not exist",
    ),
    "unknown ensemble key": (
        {"ensemble": 'test = "test"\nimage_root = "x"'},
        "unknown [ensemble] key(s) ['image_root']",
    ),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_experiments_fail_before_any_member_trains(comp: Path, name: str) -> None:
    kwargs, match = BAD[name]
    if name == "escaping member name":  # the name replaces m2's
        path = comp / "exp.toml"
        path.write_text(f'{COMMON}\n[[member]]\nname = "m1"\n\n[[member]]\nname = "../../x"\n')
    else:
        path = _experiments(comp, **kwargs)
    with pytest.raises(ConfigError) as info:
        run_ensemble(path, comp / "out", log=lambda _: None)
    assert match in str(info.value)
    assert not (comp / "out" / "m1").exists()


def test_the_flags_of_run_folders_are_refused_for_an_experiments_toml(
    comp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--tta, --device, --images (and the task options) average run folders; an experiments
    TOML says them in the file: given with one, refused before any member trains."""
    from bigbatch.cli.main import main

    argv = ["ensemble", str(_experiments(comp)), "--out", str(comp / "out"), "--tta", "4"]
    assert main([*argv, "--device", "cuda", "--mask-size", "350x525"]) == 2
    err = capsys.readouterr().err
    assert "--tta, --device, --mask-size: for run folders; an experiments TOML says it" in err
    assert not (comp / "out" / "m1").exists()
    # Typed at its default value, a flag is as ignored: refused all the same.
    assert main([*argv[:-2], "--tta", "2"]) == 2
    assert "--tta: for run folders" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("sample", "match"),
    [
        ("", "is empty"),
        ("id,label\n", "header but no rows"),
        ("id\nred_0.png\n", "at least two columns"),
        ("id,label\nnot_an_image.png,x\n", "not an image in the test folder"),
        ("id,label\nred_0.png,x\n", "have no row in"),
    ],
)
def test_sample_submission_must_match_the_test_folder(comp: Path, sample: str, match: str) -> None:
    (comp / "sample.csv").write_text(sample)
    with pytest.raises(ConfigError, match=match):
        run_ensemble(_experiments(comp), comp / "out", log=lambda _: None)
    assert not (comp / "out" / "m1").exists()


def test_corrupt_test_image_fails_before_training(comp: Path) -> None:
    (comp / "test" / "red" / "broken.png").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"broken\.png"):
        run_ensemble(_experiments(comp, ensemble='test = "test"'), comp / "out", log=lambda _: None)


def test_ids_that_two_test_images_share_are_refused(tmp_path: Path) -> None:
    write_images(tmp_path / "test", n_per_class=1)
    (tmp_path / "test" / "red" / "red_0.jpg").write_bytes(
        (tmp_path / "test" / "red" / "red_0.png").read_bytes()
    )
    files = sorted((tmp_path / "test").rglob("*.*"))
    (tmp_path / "s.csv").write_text("id,label\nred_0,x\ngreen_0,x\nblue_0,x\n")
    with pytest.raises(ConfigError, match="'red_0' matches 2 test images"):
        submission_ids(files, tmp_path / "test", tmp_path / "s.csv")
    # Without a sample, names shared by files in different folders become paths.
    (tmp_path / "test" / "blue" / "red_0.png").write_bytes(b"")
    files = sorted((tmp_path / "test").rglob("*.png"))
    ids = submission_ids(files, tmp_path / "test", None)
    assert len(set(ids)) == len(ids) and "red/red_0.png" in ids


@pytest.mark.slow
def test_members_share_one_overhead_and_the_log_names_their_model(comp: Path) -> None:
    lines: list[str] = []
    result = run_ensemble(_experiments(comp), comp / "out", log=lines.append)
    assert result.submission is not None
    assert any("member m1: tinymodel:tiny @ 16" in line for line in lines)
    overheads = {
        json.loads((comp / "out" / m / "config.json").read_text())["overhead"] for m in ("m1", "m2")
    }
    assert len(overheads) == 1 and next(iter(overheads)).isdigit()


def test_write_submission_refuses_ids_it_cannot_place(tmp_path: Path) -> None:
    """Two test images with one name used to raise a bare KeyError (or overwrite one row)."""
    from bigbatch.train.tasks.classification.experiments import write_submission

    sample = tmp_path / "sample.csv"
    sample.write_text("id,label\na.png,\nb.png,\n")
    with pytest.raises(ValueError, match=r"share the id 'a.png'.*submission_ids"):
        write_submission(["a.png", "a.png"], ["1", "2"], tmp_path / "s.csv", sample)
    with pytest.raises(ValueError, match=r"1 id\(s\) of .* have no prediction .*'b.png'"):
        write_submission(["a.png"], ["1"], tmp_path / "s.csv", sample)
    out = write_submission(["b.png", "a.png"], ["2", "1"], tmp_path / "s.csv", sample)
    assert out.read_text().splitlines() == ["id,label", "a.png,1", "b.png,2"]
