"""The cuDNN profile the CUDA model reads (bigbatch.memory.cuda_cudnn): a signature the card
measured gets its measured workspace, interpolated in the batch between measured batches; any
other the transposed-copy rule's, and the prediction says how many of each."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from bigbatch.memory.cuda_cudnn import PROFILES, CudnnProfile, profile_for_target
from bigbatch.memory.cuda_runtime import cudnn_workspaces
from bigbatch.memory.predict import predict_peak
from bigbatch.memory.step import StepSpec

ROOT = Path(__file__).resolve().parents[2]
# The H100's second sweep (1126 signatures: the first's 599 again, to the byte, and batch 64
# and 8, ResNet-18 at 128 px, the MONAI 3D U-Net's and EfficientNet's convolutions).
SWEEP = (
    ROOT
    / "benchmarks"
    / "results"
    / "h100-80gb-hbm3-cuda13.0-2026-11-26-run2"
    / "cudnn-profile.json"
)
# The third and fourth H100 sessions' sweeps (946 and 950 of their 1174 signatures in their
# time boxes, ConvNeXt-S's among them; the fourth's 4 beyond the third's the second's, every
# row repeated to the byte), packaged over the second's in order: the profile holds them all.
LATER_SWEEPS = [
    SWEEP.parent.with_name(f"h100-80gb-hbm3-cuda13.0-2026-11-26-{run}") / SWEEP.name
    for run in ("run3", "run4")
]
sys.path.insert(0, str(ROOT / "benchmarks"))


def sm90() -> CudnnProfile:
    """The packaged sm90 profile (an H100's sweep, which holds every signature the H200's did):
    the one chosen without a GPU, or beside an sm90 card."""
    profile = profile_for_target()
    if profile is None:
        pytest.skip("this machine's GPU is of an architecture no profile was measured on")
    return profile


def measured(**sig: object) -> int:
    """The sweep's own row (the H100's result file) for a signature and pass."""
    rows = json.loads(SWEEP.read_text())["rows"]
    return next(r["extra_bytes"] for r in rows if all(r.get(k) == v for k, v in sig.items()))


def conv_backward(dtype: torch.dtype, batch: int, channels: int, size: int, kernel: int, pad: int):  # type: ignore[no-untyped-def]
    """A convolution_backward's arguments and outputs (meta tensors: shapes only)."""
    x = torch.empty(batch, channels, size, size, dtype=dtype, device="meta")
    w = torch.empty(channels, channels, kernel, kernel, dtype=dtype, device="meta")
    args = (torch.empty_like(x), x, w, None, [1, 1], [pad, pad], [1, 1], False, [0, 0], 1)
    return args, (torch.empty_like(x), torch.empty_like(w), None)


def backward_workspaces(profile: CudnnProfile | None, dtype: torch.dtype, batch: int,
                        channels: int = 64, size: int = 56, kernel: int = 3,
                        pad: int | None = None) -> list[int]:  # fmt: skip
    pad = kernel // 2 if pad is None else pad  # the sweep's: "same"
    args, out = conv_backward(dtype, batch, channels, size, kernel, pad)
    return cudnn_workspaces("aten.convolution_backward.default", args, out, profile)


def test_a_measured_signature_gets_the_cards_workspaces() -> None:
    profile = sm90()
    assert "H100" in profile.card
    sig = dict(dtype="float16", layout="nchw", kernel=3, channels=64, size=56, batch=64)
    sizes = backward_workspaces(profile, torch.float16, 64)
    assert sizes == [
        measured(**sig, benchmark=False, groups=1, **{"pass": "data_grad"}),
        measured(**sig, benchmark=False, groups=1, **{"pass": "weight_grad"}),
    ]
    # The weight gradient's is not the rule's: 1.83 MiB more than its transposed operands (the
    # data gradient's 131 bytes more).
    rule = backward_workspaces(None, torch.float16, 64)
    assert sizes[1] - rule[1] == 1917591 and sizes[0] - rule[0] == 131
    assert profile.counts == {"profile": 2, "rule": 0, "without_benchmark": 0}


def test_between_two_measured_batches_the_workspace_is_interpolated() -> None:
    profile = sm90()
    low, high = backward_workspaces(profile, torch.float32, 32), backward_workspaces(profile, torch.float32, 64)  # fmt: skip
    mid = backward_workspaces(profile, torch.float32, 48)
    assert mid == [round((a + b) / 2) for a, b in zip(low, high, strict=True)]


def test_outside_the_profile_the_rule_and_the_prediction_says_how_many() -> None:
    profile = sm90()
    # 96 channels and batch 128: neither was measured. float16 takes the rule's copies;
    # float32 none (the rule gives TF32 kernels no copy: what the sweep is for).
    assert backward_workspaces(profile, torch.float16, 128, channels=96) == backward_workspaces(
        None, torch.float16, 128, channels=96
    )
    assert backward_workspaces(profile, torch.float32, 128, channels=96) == []
    # A measured signature but padded otherwise than the sweep: another output, not its row.
    assert backward_workspaces(profile, torch.float32, 64, pad=0) == []
    assert profile.counts == {"profile": 0, "rule": 6, "without_benchmark": 0}
    assert profile.note().startswith("cuDNN workspaces: 0 of 6 convolution passes from the card")


def test_float32_rows_need_tf32_as_they_were_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    profile = sm90()
    assert profile.allow_tf32
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    assert backward_workspaces(profile, torch.float32, 64) == []


def test_a_cuda_prediction_says_where_its_workspaces_came_from() -> None:
    sm90()

    def convnet() -> torch.nn.Module:
        return torch.nn.Sequential(
            torch.nn.Conv2d(64, 64, 3, padding=1),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(64, 10),
        )

    pred = predict_peak(StepSpec(convnet, (64, 56, 56), 64, "adamw", "fp16", "cuda"))
    # Each traced step's forward and weight gradient, both measured (the input needs no
    # gradient, so no data-gradient pass); the prediction traces two steps.
    assert pred.cudnn_workspaces.startswith("cuDNN workspaces: 4 of 4 convolution passes"), pred
    cpu = predict_peak(StepSpec(convnet, (64, 56, 56), 2, "adamw", "fp32", "cpu"))
    assert cpu.cudnn_workspaces == ""


def test_the_packaged_profile_is_the_sweeps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`cudnn_workspaces.py --package` of the committed sweeps, in order, writes the committed
    profile byte for byte (they cannot drift), again over it too; a later sweep replaces the
    signatures it measured and keeps the rest; a dry run's is refused."""
    import cudnn_workspaces

    monkeypatch.setattr(cudnn_workspaces, "PACKAGED", tmp_path)
    for sweep_path in (SWEEP, *LATER_SWEEPS):
        written = cudnn_workspaces.package(sweep_path)
    committed = (PROFILES / written.name).read_bytes()
    assert written.read_bytes() == committed
    for sweep_path in (SWEEP, *LATER_SWEEPS):
        written = cudnn_workspaces.package(sweep_path)
    assert written.read_bytes() == committed
    sweep = json.loads(SWEEP.read_text())
    first, second = sweep["rows"][0], sweep["rows"][1]
    later = tmp_path / "later.json"
    later.write_text(
        json.dumps(sweep | {"rows": [{**first, "extra_bytes": 7}, {**second, "batch": 3}]})
    )
    rows = json.loads(cudnn_workspaces.package(later).read_text())["rows"]
    assert len(rows) == len(json.loads(committed)["rows"]) + 1  # one replaced, one added
    profile = CudnnProfile.load(tmp_path / written.name)
    sig, pass_ = next((s, p) for (s, p), by in profile.rows.items() if 3 in by)
    assert (
        pass_ == second["pass"]
        and profile.rows[(sig, pass_)][second["batch"]] == second["extra_bytes"]
    )
    assert 7 in {
        by[first["batch"]]
        for (s, p), by in profile.rows.items()
        if p == first["pass"] and first["batch"] in by
    }
    dry = tmp_path / "dry.json"
    dry.write_text(json.dumps({"compute_capability": None, "rows": []}))
    with pytest.raises(SystemExit, match="dry run"):
        cudnn_workspaces.package(dry)


def test_benchmark_mode_takes_the_signatures_workspace_measured_without_it() -> None:
    """Where the card was not swept in benchmark mode, the workspace measured without it (the
    recorded ResNet-50 steps' workspaces differ by under 1 % between the modes); the note says
    how many."""
    from bigbatch.memory.cuda_runtime import conv_passes

    profile = sm90()
    # ResNet-50's 3x3 at 28 px, swept without benchmark mode only.
    args, out = conv_backward(torch.float16, 64, 128, 28, 3, 1)
    passes = conv_passes("aten.convolution_backward.default", args, out, profile, benchmark=True)
    without = backward_workspaces(profile, torch.float16, 64, channels=128, size=28)
    assert [p.workspace for p in passes] == without
    assert all(p.sig is not None and p.sig.benchmark for p in passes)
    assert profile.counts["without_benchmark"] == 2
    assert "(2 measured without benchmark mode)" in profile.note()


def trial_profile(trial: int) -> CudnnProfile:
    """A card profile with one 3x3 convolution's forward measured in benchmark mode: its chosen
    workspace and its trial's (batches 8 and 64)."""
    sig = {"dtype": "float16", "layout": "nchw", "kernel": 3, "groups": 1, "channels": 64,
           "size": 56, "benchmark": True}  # fmt: skip
    rows = [
        {**sig, "batch": b, "pass": p, "extra_bytes": n}
        for b in (8, 64)
        for p, n in (("forward", 2**20), ("forward_trial", trial))
    ]
    return CudnnProfile.from_rows(rows, "test card")


def test_benchmark_trials_are_first_steps_only_and_shrink_to_the_free_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A convolution's first pass in benchmark mode allocates its trial's workspace, then the
    cache is emptied; the prediction's reserved peak has it (as a card with memory free shows),
    its planning figure does not (a trial takes only free memory), and under a limit the trial
    halves until it fits (PyTorch's retry)."""
    from bigbatch.memory import cuda_runtime
    from bigbatch.memory.cuda_allocator import simulate

    def conv() -> torch.nn.Module:
        return torch.nn.Sequential(
            torch.nn.Conv2d(64, 64, 3, padding=1, bias=False),
            torch.nn.Flatten(),
            torch.nn.Linear(64 * 56 * 56, 2),
        )

    trial = 3 * 2**30
    monkeypatch.setattr(cuda_runtime, "profile_for_target", lambda: trial_profile(trial))
    spec = StepSpec(conv, (64, 56, 56), 64, "sgd", "fp16", "cuda", cudnn_benchmark=True)
    libraries = cuda_runtime.CudaLibraries(benchmark=True)
    x = torch.empty(64, 64, 56, 56, dtype=torch.float16, device="meta")
    w = torch.empty(64, 64, 3, 3, dtype=torch.float16, device="meta")
    args = (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    first = libraries.after("aten.convolution.default", args, torch.empty_like(x))
    again = libraries.after("aten.convolution.default", args, torch.empty_like(x))
    assert [e[0] for e in first] == ["trial", "free", "empty_cache", "malloc", "free"]
    assert first[0][2] == trial and [e[0] for e in again] == ["malloc", "free"]

    pred = predict_peak(spec)
    settled = pred.reserved_bytes - pred.benchmark_trial_bytes
    assert pred.reserved_bytes > trial > settled > 0
    assert pred.planning_bytes == max(pred.peak_bytes, settled) + pred.cuda_handle_bytes
    assert pred.planning_bytes < pred.reserved_bytes

    events = [("malloc", "weights", 2**30), *first]
    assert simulate(events).reserved_bytes == 2**30 + trial
    # Under a 2 GiB limit, 3 GiB, then 1.5 GiB fail beside the 1 GiB held: 768 MiB fits.
    capped = simulate(events, limit=2 * 2**30)
    assert capped.reserved_bytes == 2**30 + 768 * 2**20
    assert capped.settled_bytes == simulate(events).settled_bytes


def test_trials_never_measured_are_said() -> None:
    sm90()

    def conv() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten())

    pred = predict_peak(StepSpec(conv, (3, 16, 16), 2, "sgd", "fp16", "cuda", cudnn_benchmark=True))
    assert pred.benchmark_trial_bytes == 0
    # The forward's and the weight gradient's (the input needs none), on the first step only.
    assert any(
        "benchmark mode: the trials of 2 of 2 convolution passes are not in this" in note
        for note in pred.notes
    ), pred.notes
