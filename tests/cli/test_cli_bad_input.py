"""Bad input on the command line: exit 2 with one line naming the fix, never a traceback, and
before any long work (issue 8). One case per class of input."""

from __future__ import annotations

import errno
import json
import pickle
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "train"))
from bigbatch.cli.main import main
from tiny_runs import TINY_MODEL, write_images


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A tiny image folder and model in the working directory."""
    write_images(tmp_path / "train", n_per_class=6)
    (tmp_path / "tinymodel.py").write_text(TINY_MODEL)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("tinymodel", None)
    return tmp_path


TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
    "max_position_embeddings": 128,
}
PLAN = ["plan", "--arch", "resnet10t", "--batch", "8", "--budget", "1GB"]
TRAIN = [
    "train",
    "data=train",
    "model=tinymodel:tiny",
    "size=16",
    "batch=12",
    "micro_batch=4",
    "epochs=1",
    "device=cpu",
    "num_workers=0",
]


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str], match: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and match in lines[0], err
    return lines[0]


def _trained_run(job: Path) -> Path:
    assert main([*TRAIN, "--out", "run", "--no-progress"]) == 0
    return job / "run"


def _hf_plan(job: Path, *flags: str) -> list[str]:
    """``bigbatch plan --hf`` of a tiny Llama config written into ``job``, with ``flags``."""
    (job / "config.json").write_text(json.dumps(TINY_LLAMA))
    return [
        "plan",
        "--hf",
        "config.json",
        "--seq-len",
        "64",
        "--batch",
        "8",
        "--budget",
        "t4",
        *flags,
    ]


def _csv(job: Path, body: bytes) -> None:
    (job / "train.csv").write_bytes(b"file,label\n" + body)


CASES: dict[str, tuple[Callable[[Path], list[str]], str]] = {
    "csv row without a label": (
        lambda j: (
            _csv(j, b"train/red/red_0.png,red\ntrain/red/red_1.png\n"),
            [*TRAIN, "data=train.csv"],
        )[1],
        "line 3 has no label",
    ),
    "csv not utf-8": (
        lambda j: (
            _csv(j, "train/red/red_0.png,caf\xe9\n".encode("latin-1")),
            [*TRAIN, "data=train.csv"],
        )[1],
        "is not UTF-8 text",
    ),
    "negative weight decay": (lambda j: [*TRAIN, "weight_decay=-1"], "weight_decay must be >= 0"),
    "lr nan": (lambda j: [*TRAIN, "lr=nan"], "lr must be a finite number"),
    "device tpu (train)": (lambda j: [*TRAIN, "device=tpu"], "device='tpu'"),
    "device tpu (plan)": (
        lambda j: [
            *PLAN,
            "--device",
            "tpu",
        ],
        "--device='tpu'",
    ),
    "confirm on a missing GPU": (
        lambda j: [
            *PLAN,
            "--device",
            "cuda",
            "--confirm",
        ],
        "no CUDA device is available",
    ),
    "missing weights file": (lambda j: [*TRAIN, "weights=nope.safetensors"], "does not exist"),
    "garbage weights file": (
        lambda j: (
            (j / "w.pt").write_bytes(b"not a checkpoint"),
            [
                *TRAIN.copy()[:2],
                "arch=resnet10t",
                "size=16",
                "batch=4",
                "epochs=1",
                "device=cpu",
                "weights=w.pt",
            ],
        )[1],
        "w.pt: it is damaged or truncated",
    ),
    "out is a file": (lambda j: ((j / "f").write_text(""), [*TRAIN, "--out", "f"])[1], "is a file"),
    "out inside a file": (
        lambda j: ((j / "f").write_text(""), [*TRAIN, "--out", "f/run"])[1],
        "a part of it is a file",
    ),
    "plan csv into a file's folder": (
        lambda j: (
            (j / "f").write_text(""),
            [*PLAN, "--csv", "f/t.csv"],
        )[1],
        "is a file, not a folder",
    ),
    "verify --micro without --model": (lambda j: ["verify", "--micro", "4,4"], "add --model"),
    "verify --loss without --model": (
        lambda j: ["verify", "--loss", "mse", "--tokens"],
        "--tokens, --loss describe(s) your model's window: add --model",
    ),
    "verify --loss at its default without --model": (
        lambda j: ["verify", "--loss", "cross_entropy"],
        "--loss describe(s) your model's window: add --model",
    ),
    "verify --distributed with --dtype": (
        lambda j: ["verify", "--distributed", "2", "--dtype", "float32"],
        "--dtype: --distributed's cases run in float64 on their own data",
    ),
    "verify --distributed 0": (  # refused, not the non-distributed cases run instead
        lambda j: ["verify", "--distributed", "0"],
        "hold data for 2 ranks: use --distributed 2",
    ),
    "verify --distributed with --model": (
        lambda j: ["verify", "--distributed", "2", "--model", "m:f"],
        "--distributed runs bigbatch's own distributed cases, not --model",
    ),
    # Root passes every access check: /proc refuses the file itself. Refused before planning.
    "plan csv where no file can be made": (
        lambda j: [*PLAN, "--csv", "/proc/bigbatch-plan.csv"],
        "is not writable",
    ),
    "plan arch empty": (lambda j: ["plan", "--arch", "", *PLAN[3:]], "names no arch"),
    "plan num-classes negative": (
        lambda j: [*PLAN, "--num-classes", "-3"],
        "--num-classes must be >= 1",
    ),
    # A flag the plan would not read, even typed at its default value, is refused, not ignored.
    "plan of a training run with a step flag": (
        lambda j: ["plan", "data=train", "model=tinymodel:tiny", "--batch", "64"],
        "--batch: a plan of bigbatch train's run reads its keys, not these flags",
    ),
    "plan --hf with an image flag at its default": (
        lambda j: _hf_plan(j, "--size", "224"),
        "--size: not for a language model's plan (--hf); drop it",
    ),
    "plan an image model with a language flag at its default": (
        lambda j: [*PLAN, "--attn", "sdpa"],
        "--attn: for a language model's plan; add --hf",
    ),
    "plan --hf with a negative LoRA rank": (
        lambda j: _hf_plan(j, "--lora", "-1"),
        "--lora takes the adapters' rank, >= 1",
    ),
    "plan --hf with a margin above 1": (
        lambda j: _hf_plan(j, "--margin", "1.5"),
        "--margin is the fraction of the budget kept back, in [0, 1), got 1.5",
    ),
    "csv columns swapped": (
        lambda j: (
            _csv(j, b"red,train/red/red_0.png\ngreen,train/green/green_0.png\n"),
            [*TRAIN, "data=train.csv"],
        )[1],
        "the columns are swapped",
    ),
    "a folder where the config goes": (lambda j: ["train", "train"], "data=train"),
    "resume with another out": (
        lambda j: ["train", "--resume", "run", "--out", "other"],
        "drop --out",
    ),
    "segmentation folder without the task": (
        lambda j: (
            (j / "seg" / "images").mkdir(parents=True),
            (j / "seg" / "masks").mkdir(),
            [*TRAIN, "data=seg"],
        )[2],
        "task=segmentation",
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line(name: str, job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if "missing GPU" in name and torch.cuda.is_available():
        pytest.skip("checks the refusal where no GPU is present")
    argv, match = CASES[name]
    _fails(argv(job), capsys, match)
    assert not (job / "run" / "last.pt").exists()


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--size", "-3"], "--size takes positive integers"),
        (["--margin", "2"], "--margin is the fraction of the budget kept back"),
        (
            ["--world-size", "2,4"],
            "--world-size 2,4: a model's step plan is for one number of ranks",
        ),
        (["--arch", "resnet99"], "unknown architecture 'resnet99'"),
    ],
)
def test_a_plan_for_a_card_refused_says_the_error_alone(
    extra: list[str], match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # The lines about the card (its defaults, its memory) follow the checks: a refused plan
    # prints the one line that names the fix, nothing that reads as a plan begun.
    argv = ["plan", "--arch", "resnet10t", "--size", "32", "--batch", "8", "--budget", "t4"]
    assert main([*argv, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and match in err[0], err


def test_damaged_run_files_on_resume(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _trained_run(job)
    capsys.readouterr()
    (run / "done.json").unlink()  # unfinished: resumed from last.pt (a finished run reads none)
    last = run / "last.pt"
    good = last.read_bytes()
    last.write_bytes(good[: len(good) // 2])  # truncated
    _fails(["train", "--resume", "run"], capsys, "damaged or truncated")

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (print, ("this must never run",))

    last.write_bytes(pickle.dumps({"model": Evil()}))
    line = _fails(["train", "--resume", "run"], capsys, "will not unpickle it")
    assert "weights_only=False" not in line and "this must never run" not in line
    (run / "config.json").write_text("{ not json")
    _fails(["train", "--resume", "run"], capsys, "is not a bigbatch config")


def test_predict_bad_input(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _trained_run(job)
    capsys.readouterr()
    (job / "test").mkdir()
    write_images(job / "test", n_per_class=1)
    if not torch.cuda.is_available():
        _fails(["predict", "run", "test", "--device", "cuda"], capsys, "no CUDA device")
    _fails(["predict", "run", "test", "--tta", "0"], capsys, "tta is a number of passes")
    # A mistyped run folder is said, and not made (it was, for the predictions' folder).
    _fails(["predict", "rnu", "test"], capsys, "rnu is not a bigbatch run folder")
    assert not (job / "rnu").exists()
    (job / "test" / "red" / "broken.png").write_bytes(b"\x89PNG not really")
    _fails(["predict", "run", "test"], capsys, "broken.png")


def test_a_full_disk_is_one_line(
    job: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import bigbatch.train.run_dir as run_dir

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", "run/last.safetensors")

    # On the writer's thread (checkpoints are written off the training thread): still one line.
    monkeypatch.setattr(run_dir, "write_weights", full)
    line = _fails([*TRAIN, "--out", "run"], capsys, "no space left on the device")
    assert "run/last.safetensors" in line and "--resume" in line


@pytest.mark.parametrize(
    ("argv", "missing"),
    [
        (["example"], "nnUNet_raw is"),
        (["plan", "4", "--budget", "t4"], "nnUNet_preprocessed is"),
        (["train", "4", "3d_fullres", "0"], "nnUNet_preprocessed and nnUNet_results are"),
        (["predict", "4", "3d_fullres", "-i", "in", "-o", "out"], "nnUNet_results is"),
    ],
)
def test_nnunet_without_its_folders_says_which_first(
    argv: list[str],
    missing: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name in ("nnUNet_raw", "nnUNet_preprocessed", "nnUNet_results"):
        monkeypatch.delenv(name, raising=False)
    line = _fails(["nnunet", *argv], capsys, f"{missing} not set: export nnUNet_raw")
    assert "setting_up_paths.md" in line


def test_train_help_lists_every_key(capsys: pytest.CaptureFixture[str]) -> None:
    from dataclasses import fields

    from bigbatch.train.config import help_for, shared_fields
    from bigbatch.train.tasks import task_entry, task_names

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for f in shared_fields():
        assert f"  {f.name} = " in out and help_for(f.name) in out
    for task in task_names():  # each task's own keys, under its heading
        assert f"task={task}'s own keys:" in out
        for f in fields(task_entry(task).options_class()):
            assert f"  {f.name} = " in out and f.metadata["help"] in out


@pytest.mark.slow
def test_cuda_device_name_alone_plans_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("this checks planning for a GPU on a machine without one")
    argv = ["plan", "--arch", "resnet10t", "--size", "32", "--batch", "8", "--budget", "4GB"]
    assert main([*argv, "--device", "cuda", "--json"]) == 0
    capsys.readouterr()
    # In cuDNN's benchmark mode: the trials the card profile lacks are said.
    assert main([*argv, "--device", "cuda", "--json", "--cudnn-benchmark"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert any("cuDNN benchmark mode: the trials of" in note for note in plan["notes"])


def test_cudnn_benchmark_is_planned_for_cuda_model_steps_only(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["plan", "--arch", "resnet10t", "--size", "32", "--batch", "8", "--budget", "4GB"]
    argv.append("--cudnn-benchmark")
    _fails(argv, capsys, "add --device cuda")
    _fails([*argv, "task=classify", "data=x"], capsys, "cudnn_benchmark=true")


def test_a_full_disk_inside_torch_save_is_one_line(
    job: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch.save to a path reports a full disk as a RuntimeError; the checkpoint goes through a
    Python file object, so it is an OSError (ENOSPC) and one line naming the file."""
    import builtins

    import bigbatch.train.checkpoint as checkpoint

    real_open = builtins.open

    def full_open(file: object, mode: str = "r", *args: object, **kwargs: object) -> object:
        if "w" in mode and ".last.pt." in str(file):
            return real_open("/dev/full", mode, *args, **kwargs)  # type: ignore[call-overload]
        return real_open(file, mode, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(checkpoint, "open", full_open, raising=False)
    line = _fails([*TRAIN, "--out", "run"], capsys, "no space left on the device")
    assert "last.pt" in line and "--resume" in line
    assert not list((job / "run").glob(".last.pt.*"))  # no temporary file left behind


def test_a_read_only_out_folder_is_one_line(
    job: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import bigbatch.train.run_dir as run_dir

    def read_only(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system", "run/last.safetensors")

    monkeypatch.setattr(run_dir, "write_weights", read_only)
    _fails([*TRAIN, "--out", "run"], capsys, "read-only file system: run/last.safetensors")


def test_ctrl_c_is_one_line_that_says_resume(
    job: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import bigbatch.train.loop as loop

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "_loop", interrupted)
    assert main([*TRAIN, "--out", "run"]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "interrupted" in err and "bigbatch train --resume run" in err


def test_out_of_memory_at_the_smallest_micro_batch_is_one_line(
    job: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import bigbatch.train.loop as loop
    from bigbatch.backoff import OneDNNStuckError

    def stuck(*args: object, **kwargs: object) -> None:
        raise OneDNNStuckError("out of memory at micro-batch 4, and oneDNN can no longer ...")

    monkeypatch.setattr(loop, "_loop", stuck)
    _fails([*TRAIN, "--out", "run"], capsys, "out of memory at micro-batch 4, and oneDNN")

    def other(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug, not the user's input")

    monkeypatch.setattr(loop, "_loop", other)
    with pytest.raises(RuntimeError, match="a bug"):  # other errors keep their traceback
        main([*TRAIN, "--out", "run2"])


def test_weights_files_get_the_usual_permissions(job: Path) -> None:
    """safetensors replaces the file it writes (0600); the run's files follow the umask."""
    import os

    old = os.umask(0o022)
    try:
        run = _trained_run(job)
    finally:
        os.umask(old)
    for name in ("best.safetensors", "last.safetensors", "last.pt", "config.json"):
        assert (run / name).stat().st_mode & 0o777 == 0o644, name


def test_key_values_may_follow_the_flags(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`bigbatch train ... --out run epochs=1` used to fail with "unrecognized arguments"."""
    import json

    base = [a for a in TRAIN if not a.startswith("epochs=")]
    assert main([*base, "--out", "run", "--no-progress", "epochs=1", "lr=0.01"]) == 0
    saved = json.loads((job / "run" / "config.json").read_text())
    assert saved["epochs"] == 1 and saved["lr"] == 0.01
    # Other subcommands take --flags only: a key=value there is still refused (bigbatch plan
    # takes train's keys as a training run to plan, with data= or task=).
    assert main([*PLAN, "epochs=1"]) == 2
    assert (
        "unrecognized arguments: epochs=1 (bigbatch plan takes --flags" in capsys.readouterr().err
    )


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import bigbatch

    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"bigbatch {bigbatch.__version__}"


def test_a_missing_extra_is_one_line_naming_it(
    job: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A core install (no [train]) gave a 25-38 line ModuleNotFoundError."""
    monkeypatch.setitem(sys.modules, "timm", None)  # as if not installed
    line = _fails([*PLAN, "--overhead", "0"], capsys, "pip install 'bigbatch[train]'")
    assert "timm is not installed" in line


def test_help_and_import_load_no_torch() -> None:
    """`bigbatch --help` answers at once: neither it nor `import bigbatch` loads torch."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "import bigbatch\n"
        "from bigbatch.cli.main import main\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('torch' in sys.modules, bigbatch.__version__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.stdout.strip().splitlines()[-1].startswith("False "), done.stdout + done.stderr


TIGHT = """
import torch
from tinymodel import tiny

class Tight(torch.nn.Module):
    # As a small GPU would: more than two training images at a time do not fit.
    def __init__(self, num_classes):
        super().__init__()
        self.net = tiny(num_classes)

    def forward(self, x):
        if self.training and x.shape[0] > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.net(x)
"""


def test_the_summary_names_the_training_loss_and_says_the_back_off_fired(
    job: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """valid_pct=0: the best value is the training loss and the summary calls it that (it said
    valid_loss); a run whose plan did not fit says that the back-off shrank it, and how."""
    (job / "tight.py").write_text(TIGHT)
    sys.modules.pop("tight", None)
    argv = [*TRAIN, "valid_pct=0", "model=tight:Tight", "--out", "run", "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "(best train_loss " in out and "valid_loss" not in out
    assert "out of memory 1 time(s): the back-off shrank the micro-batch (4 -> 2 first" in out


def test_the_sweep_of_issue_43_over_classification(
    job: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What first users met in Kaggle segmentation, tried on classification: spreadsheet CSV
    dialects, another working directory, an existing output folder, damaged run files."""
    rows = [f"train/{c}/{c}_{i}.png;{c}" for c in ("red", "blue") for i in range(6)]
    excel = b"\xef\xbb\xbf" + b'"file";"label"\r\n' + "\r\n".join(rows).encode() + b"\r\n"
    (job / "train.csv").write_bytes(excel)  # BOM, quoted header, semicolons, CRLF
    assert main([*TRAIN, "data=train.csv", "--out", "run", "--no-progress"]) == 0
    capsys.readouterr()
    saved = json.loads((job / "run" / "config.json").read_text())
    assert saved["data"] == str(job / "train.csv")  # absolute: usable from anywhere
    split = json.loads((job / "run" / "split.json").read_text())
    assert len(split["train"]) + len(split["valid"]) == 12
    # From another working directory, into an existing folder.
    elsewhere = job / "elsewhere"
    (elsewhere / "out").mkdir(parents=True)
    write_images(job / "test", n_per_class=1)
    monkeypatch.chdir(elsewhere)
    assert main(["predict", str(job / "run"), str(job / "test"), "--out", "out"]) == 0
    assert (elsewhere / "out" / "predictions.csv").is_file()
    monkeypatch.chdir(job)
    # Damaged run files: the file, what is wrong, the fix; no traceback.
    (job / "run" / "plan.json").write_text('{"threads": ')
    done = (job / "run" / "done.json").read_bytes()
    (job / "run" / "done.json").unlink()  # unfinished: a resumed run reads its plan
    _fails(["train", "--resume", "run"], capsys, "plan.json is damaged (not JSON")
    (job / "run" / "done.json").write_bytes(done)
    (job / "run" / "classes.json").write_text("[")
    _fails(["predict", "run", "test"], capsys, "classes.json is missing or damaged")


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="the peak resident memory is read on Linux")
def test_a_run_records_its_measured_peak_beside_the_predicted(
    job: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each run is a data point for the memory model: plan.json and the log hold the predicted
    and the measured peaks (on a CPU the process's peak resident memory against the step's
    prediction plus the planned overhead)."""
    from bigbatch.device import process_rss
    from bigbatch.memory.budget import format_bytes

    kept = [a for a in TRAIN if not a.startswith(("micro_batch", "epochs"))]
    # The budget is the whole process's here: so much more than this process (which earlier
    # tests in it may have grown) that the step fits.
    budget = (process_rss() // 10**9 + 2) * 10**9
    argv = [*kept, f"budget={budget // 10**9}GB", "epochs=2"]
    assert main([*argv, "--out", "run", "--no-progress"]) == 0
    out = capsys.readouterr().out
    plan = json.loads((job / "run" / "plan.json").read_text())
    # Measured after the first optimizer steps too (adjusted only over the whole budget here).
    first = plan["first_steps"]
    assert first["measured"] == "process peak resident" and first["measured_peak_bytes"] > 0
    assert first["optimizer_steps"] == 2 and first["limit_bytes"] == budget
    assert "memory: after 2 optimizer steps at micro-batch" in out
    # Validation planned under the same budget, for the inputs it meets.
    assert plan["valid_shape"] == [3, 16, 16] and plan["valid_predicted_peak_bytes"] > 0
    assert plan["valid_batch"] >= 2 * plan["micro_batch"]
    assert f"plan: validation batch {plan['valid_batch']} (inputs of 3x16x16)" in out
    assert plan["budget_bytes"] == budget and plan["predicted_peak_bytes"] > 0
    assert plan["measured"] == "process peak resident" and plan["measured_peak_bytes"] > 0
    predicted = plan["predicted_peak_bytes"] + plan["overhead_bytes"]
    assert plan["compared_prediction_bytes"] == predicted
    # Like with like: the process's resident peak against the step plus the overhead.
    assert "memory: the process's peak" in out
    assert f"budget {format_bytes(budget)} for the whole process" in out
