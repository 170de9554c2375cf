"""bigbatch.device: the one place that knows about cpu, cuda and mps. The accelerator branches are
checked by simulation here (no GPU in CI) and for real in tests/gpu/."""

from __future__ import annotations

import builtins
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

from bigbatch import device


def test_rng_state_round_trip_replays_the_same_draws() -> None:
    state = device.rng_state()
    first = torch.rand(3)
    device.set_rng_state(state)
    assert torch.equal(torch.rand(3), first)


def test_mps_cache_and_generator_are_handled_where_mps_exists(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.mps, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.mps, "get_rng_state", lambda: torch.tensor([7]))
    monkeypatch.setattr(torch.mps, "set_rng_state", lambda s: calls.append(f"set {int(s)}"))
    device.empty_cache()
    state = device.rng_state()
    assert int(state["mps"]) == 7
    device.set_rng_state(state)
    assert calls == ["empty_cache", "set 7"]
    assert device.auto_device().type in ("cuda", "mps")


def test_free_memory_without_proc_meminfo(monkeypatch: pytest.MonkeyPatch) -> None:
    """macOS has no /proc/meminfo: psutil where installed, else a line naming the fix."""
    real_open = builtins.open

    def no_proc(file: Any, *args: Any, **kwargs: Any) -> Any:
        if str(file).startswith("/proc/"):
            raise FileNotFoundError(file)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", no_proc)

    class FakePsutil:
        @staticmethod
        def virtual_memory() -> Any:
            return type("VM", (), {"available": 123 * 2**20})()

    monkeypatch.setitem(sys.modules, "psutil", FakePsutil)
    assert device.free_bytes("cpu") == 123 * 2**20
    monkeypatch.setitem(sys.modules, "psutil", None)  # not installed
    with pytest.raises(ValueError, match=r"give a size such as 8GB.*psutil"):
        device.free_bytes("cpu")
    assert (device.total_bytes("cpu") or 0) > 0  # sysconf still knows the RAM
    assert device.process_rss() > 0


def test_a_cuda_budget_without_a_gpu_says_so() -> None:
    if torch.cuda.is_available():
        pytest.skip("this checks the message on a machine without a GPU")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        device.free_bytes("cuda")
    assert device.total_bytes("cuda") is None


@pytest.mark.slow
def test_bound_onednn_cache_sizes_the_cache_to_the_model_and_leaves_a_users_choice() -> None:
    """Run in a subprocess: the capacity is an environment variable oneDNN reads once."""
    code = (
        "import os, torch\n"
        "from bigbatch.device import bound_onednn_cache\n"
        "convs = torch.nn.Sequential(*[torch.nn.Conv2d(2, 2, 3) for _ in range(50)])\n"
        "print(bound_onednn_cache(convs), os.environ.get('ONEDNN_PRIMITIVE_CACHE_CAPACITY'))\n"
        "print(bound_onednn_cache(torch.nn.Sequential(torch.nn.Conv2d(2, 2, 3))))\n"
        "del os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY']\n"
        "print(bound_onednn_cache(convs, entries_per_size=51))\n"
        "del os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY']\n"
        "print(bound_onednn_cache(convs, sizes=1, entries_per_size=52))\n"
    )
    env = {k: v for k, v in os.environ.items() if "PRIMITIVE_CACHE" not in k}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    ).stdout.split("\n")
    if not torch.backends.mkldnn.is_available():
        assert out[0] == "None None"
        return
    assert out[0] == "400 400"  # 2 sizes x 4 entries x 50 convolutions
    assert out[1] == "None"  # already set (here by the first call; a user's value likewise)
    assert out[2] == "110"  # counted: 2 sizes x 51 entries, and 8 to spare
    assert out[3] == "60"  # one size, for a tight limit (the OOM guide)
    with pytest.raises(ValueError, match="sizes must be >= 1"):
        device.bound_onednn_cache(torch.nn.Conv2d(2, 2, 3), sizes=0)


_HEAP_SCRIPT = """
import sys, torch
from bigbatch.device import process_rss, return_freed_cpu_memory
if sys.argv[1] == "returned":
    assert return_freed_cpu_memory()
big = torch.ones(8 * 2**20 // 4)  # freed, it raises glibc's mmap threshold past 4 MiB
del big
before = process_rss()
block = torch.ones(4 * 2**20 // 4)  # now from glibc's heap, which keeps it when freed
del block
print(process_rss() - before)
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap is Linux's")
def test_return_freed_cpu_memory_gives_a_freed_tensor_back_to_the_system() -> None:
    if not device._glibc():
        pytest.skip("the C library here is not glibc")

    def kept(mode: str) -> int:
        done = subprocess.run(
            [sys.executable, "-c", _HEAP_SCRIPT, mode], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return int(done.stdout.strip().splitlines()[-1])

    assert kept("returned") < 2**20
    assert kept("default") >= 3 * 2**20  # the negative control: glibc's heap kept it


def test_each_device_kind_is_policy_as_data() -> None:
    cpu, cuda, mps = (device.device_kind(d) for d in ("cpu", "cuda:1", "mps"))
    assert cuda.dedicated_memory and not cpu.dedicated_memory and not mps.dedicated_memory
    assert (cuda.allocator_block, cpu.allocator_block) == (512, 1)
    assert cpu.float64 and cuda.float64 and not mps.float64
    assert (cuda.distributed_backend, cpu.distributed_backend) == ("nccl", "gloo")
    assert cuda.pin_memory and not cpu.pin_memory
    with pytest.raises(ValueError, match="bigbatch trains on cpu, cuda, mps, not meta"):
        device.device_kind("meta")


def test_the_training_code_reads_the_kind_not_the_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kind's entry decides: a CPU that said it pins memory and prefers channels_last (a new
    backend is an entry) changes the loader and the model's memory format with no other edit."""
    from dataclasses import replace

    from bigbatch.train.runtime import place_model

    kinds = dict(device.DEVICE_KINDS)
    kinds["cpu"] = replace(kinds["cpu"], pin_memory=True, channels_last=True)
    monkeypatch.setattr(device, "DEVICE_KINDS", kinds)
    cpu = torch.device("cpu")
    assert device.pins_memory(cpu)
    _, memory_format = place_model(torch.nn.Conv2d(3, 4, 3), "auto", cpu)
    assert memory_format == torch.channels_last


def test_train_runs_the_fused_adamw_where_the_kind_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """bigbatch train's AdamW is torch's fused one on a card (the kind's ``fused_adamw``) and
    is planned as it: simulated here on a CPU whose kind says so (torch's fused kernels run on
    the CPU from 2.4); tests/gpu steps it on a card, through fp16's GradScaler. Its update is
    the multi-tensor one's, to float32's round-off."""
    from dataclasses import replace

    from bigbatch import Accumulator
    from bigbatch.train.config import TrainConfig
    from bigbatch.train.optim import make_optimizer, plan_optimizer

    assert device.device_kind("cuda").fused_adamw and not device.device_kind("cpu").fused_adamw
    cfg = TrainConfig(data="x")

    def stepped() -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        opt, _ = make_optimizer(cfg, model, "all", 10)
        acc = Accumulator(opt, micro_batches=2)
        for n in (5, 3):
            x, y = torch.randn(n, 8), torch.randint(0, 3, (n,))
            acc.backward(torch.nn.functional.cross_entropy(model(x), y), count=n)
        acc.step()
        return opt, [p.detach().clone() for p in model.parameters()]

    foreach, reference = stepped()
    assert not foreach.defaults["fused"] and plan_optimizer("adamw", "cpu") == "adamw"
    kinds = dict(device.DEVICE_KINDS)
    kinds["cpu"] = replace(kinds["cpu"], fused_adamw=True)
    monkeypatch.setattr(device, "DEVICE_KINDS", kinds)
    fused, weights = stepped()
    assert fused.defaults["fused"] and plan_optimizer("adamw", "cpu") == "adamw_fused"
    assert plan_optimizer("sgd", "cpu") == "sgd_momentum"
    eps = torch.finfo(torch.float32).eps
    for w, r in zip(weights, reference, strict=True):
        torch.testing.assert_close(w, r, rtol=0, atol=8 * eps * float(r.abs().max()))


def test_a_resumed_run_keeps_the_optimizer_kernel_it_planned() -> None:
    """A checkpoint's optimizer groups carry the kernel of the run that saved it (a CPU run's
    multi-tensor AdamW resumed on a card, or a run from before bigbatch trained fused): torch's
    load_state_dict restores that one, and the resumed run keeps its own, the one its plan
    traced; its update continues the saved run's to float32's round-off."""
    import copy

    from bigbatch.train.optim import load_optimizer_state

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64))

    def step(opt: torch.optim.Optimizer, seed: int) -> None:
        w.grad = torch.randn(64, generator=torch.Generator().manual_seed(seed))
        opt.step()

    saving = torch.optim.AdamW([w], lr=0.1, foreach=True)
    step(saving, 1)
    saved, start = copy.deepcopy(saving.state_dict()), w.detach().clone()
    step(saving, 2)
    reference = w.detach().clone()
    plain = torch.optim.AdamW([w], lr=0.1, fused=True)
    plain.load_state_dict(copy.deepcopy(saved))
    assert not plain.param_groups[0]["fused"]  # the control: the saving run's kernel
    resumed = torch.optim.AdamW([w], lr=0.1, fused=True)
    load_optimizer_state(resumed, saved)
    group = resumed.param_groups[0]
    assert group["fused"] and not group["foreach"]
    assert resumed.state[w]["step"].dtype == torch.float32
    with torch.no_grad():
        w.copy_(start)
    step(resumed, 2)
    eps = torch.finfo(torch.float32).eps
    torch.testing.assert_close(
        w.detach(), reference, rtol=0, atol=8 * eps * float(start.abs().max())
    )


def test_counts_without_float64_are_summed_in_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import replace

    from bigbatch.counts import weights

    assert weights(torch.tensor(2.0)).normaliser.dtype == torch.float64  # type: ignore[union-attr]
    kinds = dict(device.DEVICE_KINDS)
    kinds["cpu"] = replace(kinds["cpu"], float64=False)  # as MPS
    monkeypatch.setattr(device, "DEVICE_KINDS", kinds)
    assert weights(torch.tensor(2.0)).normaliser.dtype == torch.float32  # type: ignore[union-attr]


def test_an_explicit_budget_caps_the_cuda_allocator_simulated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """budget= on CUDA is a cap: the allocator may hold the budget less the context the plan
    kept out (simulated here: no GPU in CI; tests/gpu runs it on a card)."""
    from types import SimpleNamespace

    from bigbatch.device import cap_cuda_allocator
    from bigbatch.train.config import TrainConfig
    from bigbatch.train.planning import PlanChoice
    from bigbatch.train.runtime import cap_to_budget

    gib = 2**30
    calls: list[tuple[float, object]] = []
    props = SimpleNamespace(total_memory=80 * gib)

    def index_of(device: object) -> int:
        # As torch's memory-fraction calls: a device without an index is refused (a bare
        # device="cuda" failed so on an H100).
        if not isinstance(device, int):
            raise ValueError(f"Expected a torch.device with a specified index, got {device}")
        return device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        torch.cuda, "get_per_process_memory_fraction", lambda device: index_of(device) + 0.75
    )
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(
        torch.cuda,
        "set_per_process_memory_fraction",
        lambda f, device: calls.append((f, index_of(device))),
    )
    cuda = torch.device("cuda")
    assert cap_cuda_allocator(torch.device("cpu"), 10 * gib) is None and not calls
    assert cap_cuda_allocator(cuda, 10 * gib) == (10 * gib, 0.75) and calls[-1] == (0.125, 0)
    assert cap_cuda_allocator(cuda, 100 * gib) == (80 * gib, 0.75) and calls[-1][0] == 1.0
    lines: list[str] = []
    choice = PlanChoice(32, 32, 5 * gib, gib // 2, 16 * gib)
    assert cap_to_budget(TrainConfig(data="d", budget="16GiB"), cuda, choice, lines.append) == 0.75
    assert calls[-1][0] == (16 * gib - gib // 2) / (80 * gib)
    assert lines == [
        "memory: this process's CUDA allocator capped at 15.50 GiB (budget 16.00 GiB less the "
        "512.0 MiB CUDA context): past it the back-off shrinks the micro-batch"
    ]
    before = len(calls)
    assert cap_to_budget(TrainConfig(data="d", budget="auto"), cuda, choice, lines.append) is None
    assert len(calls) == before  # budget=auto: the free memory, no cap
    from bigbatch.device import uncap_cuda_allocator

    uncap_cuda_allocator(cuda, 0.75)  # what the run does at its end
    assert calls[-1] == (0.75, 0)


@pytest.mark.parametrize(("capability", "auto"), [((7, 5), "fp16"), ((8, 0), "bf16")])
def test_auto_precision_is_fp16_where_the_card_only_emulates_bf16(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], auto: str
) -> None:
    """A T4 (7.5) answers torch.cuda.is_bf16_supported() with True, as its bf16 tensors work in
    float32 emulation, several times slower than fp16: precision=auto takes fp16 there, and an
    explicit bf16 is said (simulated: no GPU in CI)."""
    from bigbatch.train.runtime import resolve_precision

    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    assert device.auto_precision(cuda) == auto
    said: list[str] = []
    assert resolve_precision("bf16", cuda, said.append) == "bf16"
    assert resolve_precision("auto", cuda, said.append) == auto
    if auto == "fp16":
        assert len(said) == 1 and "on Tesla T4, which has no bfloat16 units" in said[0]
        assert "precision=fp16 (or auto)" in said[0]
    else:
        assert said == []
    assert not device.emulates_bf16(torch.device("cpu"))
    # A run's log names the card first, then what is said of its precision there.
    from types import SimpleNamespace

    from bigbatch.train import runtime

    monkeypatch.setattr(runtime, "device_for_rank", lambda name, rank, world: cuda)
    monkeypatch.setattr(runtime, "describe_device", lambda d, auto: "cuda:0 (Tesla T4)")
    monkeypatch.setattr(runtime, "idle_gpus_note", lambda d, world: "")
    logged: list[str] = []
    cfg = SimpleNamespace(device="cuda", precision="bf16")
    assert runtime.run_device(cfg, 0, 1, logged.append) == (cuda, "bf16")  # type: ignore[arg-type]
    assert logged[0] == "device: cuda:0 (Tesla T4), bf16"
    assert logged[1:] == said[:1]


def test_a_run_names_its_device_and_a_cpu_chosen_by_auto_says_no_gpu_was_found(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """A notebook with its accelerator off trains on the CPU under device=auto: the first line
    of the run says so. A GPU is named with its memory (simulated here)."""
    from types import SimpleNamespace

    assert device.describe_device(torch.device("cpu")) == "cpu"
    monkeypatch.setattr(device, "NVIDIA_DRIVER", "/no/such/driver")
    assert "device=auto found no GPU" in device.describe_device(torch.device("cpu"), auto=True)
    # A GPU machine with torch's CPU wheel (what pip picks by default on some platforms).
    driver = tmp_path / "version"
    driver.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65\n")
    monkeypatch.setattr(device, "NVIDIA_DRIVER", str(driver))
    monkeypatch.setattr(torch.version, "cuda", None)
    said = device.describe_device(torch.device("cpu"), auto=True)
    assert "this torch is a CPU build, and this machine has an NVIDIA driver" in said
    card = SimpleNamespace(name="Tesla T4", total_memory=15 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: card)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert device.describe_device(torch.device("cuda"), auto=True) == "cuda:0 (Tesla T4, 15.0 GiB)"
    assert device.describe_device(torch.device("cuda:1")) == "cuda:1 (Tesla T4, 15.0 GiB)"


def test_one_process_on_one_of_several_gpus_says_the_others_are_idle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Kaggle's two T4s: one process trains on one, and the run says how to use both."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    note = device.idle_gpus_note(torch.device("cuda", 0), 1)
    assert note.startswith("note: 2 CUDA GPUs here and this run trains on one")
    assert "torchrun --nproc-per-node 2 -m bigbatch train" in note
    assert device.idle_gpus_note(torch.device("cuda", 0), 2) == ""  # under torchrun: each used
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert device.idle_gpus_note(torch.device("cuda", 0), 1) == ""
