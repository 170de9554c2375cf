"""`bigbatch plan` as a user runs it."""

from __future__ import annotations

import gc
import json
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from bigbatch.cli.main import main
from bigbatch.memory.budget import format_bytes


@pytest.mark.slow
def test_single_arch_json(capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "plan",
        "--arch",
        "resnet10t",
        "--size",
        "32",
        "--batch",
        "64",
        "--budget",
        "4GiB",
        "--json",
        "--no-calibrate",
    ]
    frozen = gc.get_freeze_count()
    assert main(args) == 0
    # Called in a process that goes on (this one), main leaves the collector as it was.
    assert gc.isenabled() and gc.get_freeze_count() == frozen
    plan = json.loads(capsys.readouterr().out)
    for key in (
        "micro_batch",
        "micro_batches",
        "predicted_peak_bytes",
        "budget_bytes",
        "arch",
        "size",
    ):
        assert key in plan
    assert plan["micro_batch"] * plan["micro_batches"] >= 64
    assert plan["predicted_peak_bytes"] <= plan["budget_bytes"]


@pytest.mark.slow
def test_gradient_checkpointing_plans_a_timm_model_as_it_trains(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--gradient-checkpointing`` with ``--arch``: the model's library's switch (timm's), as
    ``bigbatch train grad_checkpointing=true`` trains it; MONAI's U-Net through torch's
    checkpoint_wrapper."""
    args = ["plan", "--arch", "test_vit", "--size", "64", "--batch", "64", "--budget", "t4",
            "--json"]  # fmt: skip
    peaks = []
    for extra in ([], ["--gradient-checkpointing"]):
        assert main([*args, *extra]) == 0
        peaks.append(json.loads(capsys.readouterr().out)["predicted_peak_bytes"])
    assert peaks[1] < peaks[0]
    unet = ["plan", "--arch", "unet", "--input-shape", "1,64,64", "--batch", "8", "--budget", "t4",
            "--json"]  # fmt: skip
    peaks = []
    for extra in ([], ["--gradient-checkpointing"]):  # MONAI's blocks, in torch's wrapper
        assert main([*unet, *extra]) == 0
        peaks.append(json.loads(capsys.readouterr().out)["predicted_peak_bytes"])
    assert peaks[1] < peaks[0]


def test_gradient_checkpointing_is_refused_where_nothing_switches_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A network with neither switch is refused, and a training run's plan takes train's key."""
    plain = ["plan", "--model", "torch.nn:Identity", "--input-shape", "4", "--batch", "2"]
    assert main([*plain, "--budget", "t4", "--gradient-checkpointing"]) == 2
    assert "--gradient-checkpointing: Identity has no activation checkpointing" in (
        capsys.readouterr().err
    )
    assert main(["plan", "data=x", "--gradient-checkpointing"]) == 2
    assert "takes bigbatch train's key, grad_checkpointing=true" in capsys.readouterr().err


@pytest.mark.slow
def test_a_card_named_by_the_budget_is_planned_as_train_runs_on_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--budget t4 alone plans for CUDA in fp16 (a T4 only emulates bf16), --budget l4 in
    bf16: what bigbatch train's precision=auto takes there, said on stderr; --precision plans
    another, --device cpu refuses the card with the fix."""
    args = ["plan", "--arch", "resnet10t", "--size", "32", "--batch", "8", "--json"]
    for card, precision in [("t4", "fp16"), ("l4", "bf16")]:
        assert main([*args, "--budget", card]) == 0
        out, err = capsys.readouterr()
        plan = json.loads(out)
        assert (plan["device"], plan["precision"], plan["optimizer"]) == (
            "cuda",
            precision,
            "adamw",
        )
        assert f"--device cuda --precision {precision} (precision=auto's there" in err
    assert main([*args, "--budget", "t4", "--precision", "fp32"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["precision"] == "fp32" and "planned for the T4: --device cuda\n" in err
    assert main([*args, "--budget", "t4", "--device", "cpu"]) == 2
    assert "is a GPU (NVIDIA T4 16 GB): plan for it with --device cuda" in capsys.readouterr().err


@pytest.mark.slow
def test_table_csv_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    csv_path, png = tmp_path / "table.csv", tmp_path / "peaks.png"
    args = ["plan", "--arch", "resnet10t,test_efficientnet", "--size", "32,48", "--batch", "16"]
    args += ["--budget", "3GiB", "--overhead", "0", "--no-calibrate"]
    assert main([*args, "--csv", str(csv_path), "--plot", str(png)]) == 0
    table = capsys.readouterr().out
    assert "predicted peak" in table
    rows = csv_path.read_text().splitlines()
    assert rows[0].startswith("arch,size,fits,floor_bytes")
    assert rows[0].endswith(",target_batch,world_size,rank_batch,held_bytes")
    assert rows[1].split(",")[-4:] == ["16", "1", "16", "0"]
    assert [tuple(r.split(",")[:2]) for r in rows[1:]] == [
        ("resnet10t", "32"),
        ("resnet10t", "48"),
        ("test_efficientnet", "32"),
        ("test_efficientnet", "48"),
    ]
    assert [line.split()[:2] for line in table.splitlines()[3:7]] == [
        [arch, size] for arch, size in (r.split(",")[:2] for r in rows[1:])
    ]
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_several_rows_json(capsys: pytest.CaptureFixture[str]) -> None:
    """Several rows: a list of the objects one row prints, each with its model and size."""
    args = ["plan", "--arch", "resnet10t", "--size", "24,32", "--batch", "64"]
    assert main([*args, "--budget", "4GiB", "--json", "--no-calibrate"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["arch"], r["size"]) for r in rows] == [("resnet10t", 24), ("resnet10t", 32)]
    assert all(r["micro_batch"] * r["micro_batches"] >= 64 for r in rows)


def test_user_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "net.py").write_text(
        textwrap.dedent(
            """
            from torch import nn
            def build():
                return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
            def broken():
                raise ValueError("no such checkpoint")
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    common = ["plan", "--input-shape", "64", "--batch", "32", "--budget", "64MiB"]
    assert main([*common, "--model", "net:build", "--overhead", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["micro_batch"] == 32
    assert main([*common, "--model", "net:broken", "--overhead", "0"]) == 2
    err = capsys.readouterr().err
    assert "no such checkpoint" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--arch", "resnet19"], "did you mean resnet18"),
        (["--arch", "resnet10t", "--budget", "eight gigs"], "nor a size: 8GB, 16GiB, auto"),
        (["--arch", "resnet10t", "--budget", "8 gigs"], "cannot read the memory size"),
        (
            ["--arch", "resnet10t", "--budget", "1MiB", "--overhead", "0"],
            "does not fit: it needs",
        ),
        (["--model", "net:build"], "needs --input-shape"),
        # A flag the model planned would not read: refused, not ignored.
        (["--arch", "resnet10t", "--widths", "8,16"], "--widths: not read for a timm --arch"),
        (["--arch", "resnet10t", "--input-shape", "1,32,32"], "--input-shape: not read for a"),
        (["--arch", "unet", "--input-shape", "1,32,32"], "--size: not read for a MONAI --arch"),
        (["--model", "net:build", "--input-shape", "8", "--vocab", "100"],
         "--size, --vocab (token ids: with --input-dtype long): not read for --model"),
    ],
)  # fmt: skip
def test_bad_input_is_one_clear_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["plan", "--size", "32", "--batch", "16", "--no-calibrate"]
    if "--budget" not in args:
        base += ["--budget", "4GiB"]
    assert main([*base, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's VmHWM")
@pytest.mark.slow
def test_planning_stays_inside_the_budget_it_plans_for(tmp_path: Path) -> None:
    """resnet10t at 1024 px under 1GB: the calibration's real steps at micro-batch 2 and 4 used
    to peak at 3.2 GB RSS to report that micro-batch 1 needs 520 MiB. Calibration now runs only
    the sizes whose step fits the budget, so the planner process itself stays under it."""
    import subprocess
    import sys

    budget = 10**9
    args = ["plan", "--arch", "resnet10t", "--size", "1024", "--batch", "64", "--budget", "1GB"]
    # The child reports its own peak: VmHWM of its address space. Not ru_maxrss, which Linux
    # carries across exec from the forked parent (this pytest process, 1.1 GB after the demo).
    script = (
        "import gc, sys\n"
        "from bigbatch.cli.main import main\n"
        f"code = main({args!r}, own_process=True)\n"  # as the bigbatch executable runs it
        "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0].split()[1]\n"
        "print('PEAK', hwm, file=sys.stderr)\n"
        "print('GC', gc.isenabled(), gc.get_freeze_count() > 0, file=sys.stderr)\n"
        "sys.exit(code)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    peak = int(proc.stderr.split("PEAK ")[1].split()[0]) * 1024
    assert proc.returncode == 2 and "even micro-batch 1 does not fit" in proc.stderr
    assert "not calibrated" in proc.stderr or "calibrated at micro-batch" in proc.stderr
    assert peak < budget, f"the planner peaked at {peak / 2**20:.0f} MiB: {proc.stderr[-700:]}"
    assert "GC True True" in proc.stderr  # what it loaded is frozen; the collector runs


@pytest.mark.slow
def test_planning_prints_no_profiler_lines() -> None:
    """Calibration's profiler used to print 'USDT: ... profiler_start' and 'ERROR: ...
    gpuGetDeviceCount failed' at every start and stop; a normal run prints neither."""
    import subprocess
    import sys

    args = ["plan", "--arch", "resnet10t", "--size", "32", "--batch", "8", "--budget", "2GB"]
    proc = subprocess.run(
        [sys.executable, "-m", "bigbatch", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-1000:]
    assert "USDT" not in proc.stderr and "ERROR" not in proc.stderr, proc.stderr[-1000:]
    assert "resnet10t" in proc.stdout


@pytest.mark.slow
def test_plan_leaves_room_for_a_gradient_cache(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--model", "bigbatch.segmentation.models:unet2d", "--input-shape", "3,32,32",
            "--batch", "4096", "--budget", "1GB", "--overhead", "0", "--no-calibrate", "--json"]  # fmt: skip
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*args, "--cache-dim", "128"]) == 0
    captured = capsys.readouterr()
    cached = json.loads(captured.out)
    assert "gradient cache for batch 4096: 392.0 MiB" in captured.err
    assert cached["micro_batch"] < plain["micro_batch"]
    assert plain["usable_bytes"] - cached["usable_bytes"] == 392 * 2**20


@pytest.mark.slow
def test_a_step_plan_over_ranks_holds_each_ranks_share_and_its_buckets(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--world-size N: a rank plans its share of the window (torchrun's DDP), with DDP's
    gradient buckets (a copy of every trainable gradient) held beside each step."""
    from bigbatch.distributed import ddp_bucket_bytes
    from bigbatch.segmentation.models import unet2d

    def plan(batch: int, budget: str = "1GB", *extra: str) -> dict[str, Any]:
        args = ["plan", "--model", "bigbatch.segmentation.models:unet2d", "--input-shape",
                "3,32,32", "--batch", str(batch), "--budget", budget, "--overhead", "0",
                "--no-calibrate", "--json", *extra]  # fmt: skip
        assert main(args) == 0
        captured = capsys.readouterr()
        said.append(captured.err)  # what the plan is for, on stderr
        return dict(json.loads(captured.out))

    said: list[str] = []
    one = plan(63)
    two = plan(63, "1GB", "--world-size", "2")
    buckets = ddp_bucket_bytes(unet2d())
    assert said[1].splitlines() == [
        "distributed: 2 ranks x 32 samples per window = target batch 63",
        f"bigbatch.segmentation.models:unet2d: DDP's gradient buckets hold "
        f"{format_bytes(buckets)} on each rank",
    ]
    assert (one["world_size"], two["world_size"]) == (1, 2)
    assert (two["target_batch"], two["rank_batch"], two["held_bytes"]) == (63, 32, buckets)
    assert one["usable_bytes"] - two["usable_bytes"] == buckets
    # The rank's step is the one-process plan of its share, with that much less room.
    share = plan(32)
    assert share["curve"] == two["curve"] and share["micro_batches"] == 1
    # A budget the share's step fits alone with no room for the buckets: the rank splits it.
    tight = str(share["predicted_peak_bytes"] + buckets // 2)
    assert plan(32, tight, "--margin", "0")["micro_batches"] == 1
    assert plan(63, tight, "--margin", "0", "--world-size", "2")["micro_batches"] == 2


def test_a_token_model_is_planned_with_integer_inputs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--model with float inputs failed inside the embedding ("Expected tensor for argument #1
    'indices' to have one of the following scalar types: Long, Int")."""
    (tmp_path / "lm.py").write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn
            class TinyLM(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.embed, self.head = nn.Embedding(1000, 32), nn.Linear(32, 1000)
                def forward(self, ids):
                    return self.head(self.embed(ids))
            def build():
                return TinyLM()
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    args = ["plan", "--model", "lm:build", "--input-shape", "64", "--batch", "16"]
    args += ["--budget", "256MiB", "--overhead", "0", "--no-calibrate", "--json", "--device", "cpu"]
    assert main([*args, "--input-dtype", "long", "--vocab", "1000"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["micro_batch"] >= 1 and plan["predicted_peak_bytes"] > 0
    assert main(args) == 2  # float inputs into an embedding: one line, with the cause
    assert "Traceback" not in capsys.readouterr().err
    assert main([*args, "--input-dtype", "long", "--vocab", "0"]) == 2
    assert "--vocab must be >= 1" in capsys.readouterr().err


def test_integer_inputs_are_drawn_from_the_vocabulary() -> None:
    from bigbatch.memory.step import StepSpec, make_inputs

    spec = StepSpec(lambda: torch.nn.Embedding(1000, 4), (512,), 8, input_dtype=torch.long)
    ids = make_inputs(replace(spec, vocab=1000), "cpu")
    assert ids.dtype == torch.long and int(ids.min()) >= 0 and 500 < int(ids.max()) < 1000


@pytest.mark.slow
def test_fastest_times_the_fitting_candidates_and_picks_the_fastest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    args = ["plan", "--arch", "resnet10t", "--size", "32", "--batch", "16", "--budget", "2GB",
            "--overhead", "0", "--no-calibrate", "--fastest", "--json"]  # fmt: skip
    assert main(args) == 0
    plan = json.loads(capsys.readouterr().out)
    rates = {int(b): v for b, v in plan["samples_per_s"].items()}
    assert len(rates) >= 2 and all(v > 0 for v in rates.values())
    assert plan["micro_batch"] == max(rates, key=lambda b: rates[b])  # the fastest, measured
    assert plan["micro_batches"] * plan["micro_batch"] >= 16


@pytest.mark.slow
def test_plan_calibrates_with_the_threads_training_takes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A plan made in a shell with OMP_NUM_THREADS=1 calibrated on one thread, while `bigbatch
    train` gives torch every core: oneDNN's workspaces grow with the threads, and the demo's
    resnet10t was planned 10 x 13 where 2 x 64 fits."""
    import bigbatch.memory.plan as plan_module
    import bigbatch.train.runtime as runtime

    seen: list[int] = []

    def calibrate_within(spec: object, usable: int, **kwargs: object) -> tuple[None, str]:
        seen.append(torch.get_num_threads())
        return None, ""

    monkeypatch.setattr(plan_module, "calibrate_within", calibrate_within)
    monkeypatch.setattr(runtime, "resolve_threads", lambda cfg, device: (3, 0))
    args = ["plan", "--arch", "resnet10t", "--size", "32", "--batch", "8", "--budget", "2GB",
            "--overhead", "0", "--json"]  # fmt: skip
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as under OMP_NUM_THREADS=1
    try:
        assert main(args) == 0
        assert json.loads(capsys.readouterr().out)["threads"] == 3
        assert main([*args, "--threads", "2"]) == 0
        assert json.loads(capsys.readouterr().out)["threads"] == 2
        assert seen == [3, 2]
        assert torch.get_num_threads() == 1  # the caller's setting is back
        assert main([*args, "--threads", "-1"]) == 2
        assert "--threads must be >= 1" in capsys.readouterr().err
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_the_executable_writes_tensorboard_events_without_tensorflow(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Where TensorFlow is installed (Kaggle's images), torch's TensorBoard writer, which
    MONAI's transforms import, would import it: 3.6 s, 545 MB and its log lines. The
    executable's process takes TensorBoard's stand-in instead; the events are written."""
    import subprocess
    import sys

    pytest.importorskip("tensorboard")
    script = (
        "import sys\n"
        "from bigbatch.cli.main import main\n"
        "try:\n"
        "    main(['verify', '--help'], own_process=True)\n"
        "except SystemExit:\n"
        "    pass\n"
        "from torch.utils.tensorboard import SummaryWriter\n"
        f"with SummaryWriter({str(tmp_path)!r}) as w:\n"
        "    w.add_scalar('loss', 0.5, 1)\n"
        "print('TF', 'tensorflow' in sys.modules)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "TF False" in proc.stdout
    assert any(p.name.startswith("events.out.tfevents.") for p in tmp_path.iterdir())
