"""`make gpu-evidence DRY=1`: every part of the GPU evidence run, on the CPU with tiny
workloads, so that the one command a GPU session runs never rots (benchmarks/gpu_evidence.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(1000)  # six parts, each its own processes: 214 s alone on a 2-core EPYC
def test_the_dry_run_runs_every_part_and_writes_the_summary(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_evidence.py"), "--dry-run",
         "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=900,
    )  # fmt: skip
    logs = {p.name: p.read_text()[-1500:] for p in (tmp_path / "logs").glob("*.log")}
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:], logs)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["parts"]) == {
        "imports", "gpu_tests", "cudnn_workspaces", "decode", "memory_matrix", "speed",
    }  # fmt: skip
    assert all(p["state"] == "passed" for p in summary["parts"].values()), summary["parts"]
    matrix = json.loads((tmp_path / "memory_matrix.json").read_text())
    assert matrix["rows_measured"] == matrix["rows_total"] == 5
    kinds = {row["row"]["kind"] for row in matrix["rows"]}
    assert {"nnunet", "hf"} <= kinds  # nnU-Net's step and a language model's from its config
    assert any(row["row"].get("ranks") == 2 for row in matrix["rows"])  # one FSDP2 rank
    for row in matrix["rows"]:  # each row predicted (from the CPU) and measured
        assert row["predicted"]["reserved_mib"] > 0 and row["measured"]["reserved_mib"] > 0
        assert (tmp_path / "traces" / f"{row['name']}.json.gz").exists()
    speed = json.loads((tmp_path / "speed.json").read_text())
    assert {"loaderless", "budget_train", "trainer_budget", "resnet50_fp16"} <= set(speed)
    # benchmarks/checkpoint_stall.py and train_throughput.py as a user runs them (--json; the
    # tests run them here only): each stall timed, each loop's fixed costs apart and against
    # the step alone (the loader-less limit), the same checkpoints written by both loops.
    stall = speed["checkpoint_stall"]
    assert set(stall["stall_seconds"]) == {"inline", "background"}
    assert stall["stall_seconds"]["background"] > 0
    assert stall["stall_ratio"] > 0 and stall["written_seconds"] > 0
    loops = speed["resnet50_fp16"]
    assert loops["ratio_vs_hand_loop"] > 0 and loops["whole_run_ratio"] > 0
    assert loops["hand_loop_checkpoints"]
    assert set(loops["first_step_seconds"]) == {"hand", "bigbatch"}
    assert all(v > 0 for v in loops["first_step_seconds"].values())
    assert loops["loaderless_images_per_s"] > 0
    assert all(v > 0 for v in loops["fraction_of_loaderless"].values())
    assert "Checkpoint stall" in (tmp_path / "summary.md").read_text()
    assert all("row_seconds" in row["measured"] for row in matrix["rows"])
    assert "2 times over" in speed["resnet50_fp16"]["workload"]  # the steady job's --passes
    assert "split_seconds" in speed["resnet50_fp16_profile"]["profile"]["bigbatch"]
    # Each row recorded in a process forked from the forkserver (no fallback to new ones).
    assert "forked recording failed" not in logs["memory_matrix.log"]
    assert speed["trainer_budget"]["backoffs"] == []  # the Trainer run set from a plan ran
    assert speed["trainer_budget"]["eval_batch"] >= 1  # and evaluated at the planned batch
    # ... a plan made beforehand, on the CPU, while the other parts ran
    assert speed["trainer_budget"]["plan"] == "planned beforehand (trainer-plan.json)"
    # Each loop from its own process's start (a user's command): to the first step, the end.
    command = speed["resnet50_fp16_command"]["from_command"]
    assert 0 < command["bigbatch"]["to_first_step"] < command["bigbatch"]["to_end"]
    assert "from each command's start" in (tmp_path / "summary.md").read_text()
    assert (tmp_path / "tests-gpu.xml").exists() and (tmp_path / "summary.md").exists()


def test_a_second_run_that_day_never_writes_over_a_finished_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run writes into its card's and day's folder; one whose summary is written (it
    finished) is kept as it is and the next run gets ``-run2``, then ``-run3``; a run its time
    box cut (no summary) is finished in its own folder."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_evidence

    monkeypatch.setattr(gpu_evidence, "HERE", tmp_path)
    info = {"gpu": "NVIDIA H100 80GB HBM3", "cuda": "13.0", "date": "2026-11-26"}
    first = gpu_evidence.results_dir(info, dry_run=False)
    assert first.name == "h100-80gb-hbm3-cuda13.0-2026-11-26"
    first.mkdir(parents=True)
    assert gpu_evidence.results_dir(info, dry_run=False) == first  # cut short: finished there
    (first / "summary.json").write_text("{}")
    second = gpu_evidence.results_dir(info, dry_run=False)
    assert second.name == first.name + "-run2"
    second.mkdir()
    (second / "summary.json").write_text("{}")
    assert gpu_evidence.results_dir(info, dry_run=False).name == first.name + "-run3"


@pytest.mark.slow
def test_a_short_time_box_measures_what_the_tests_and_the_model_lack_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The matrix records first the rows whose trace from this card is not committed (the
    H100's first traces sit at the top of the tests' data, later ones in its own folder), and
    the cuDNN sweep first the signatures the card's packaged profile lacks."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import cudnn_workspaces
    import gpu_evidence
    import torch
    from gpu_matrix import matrix, row_name

    assert gpu_evidence.card_tag("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_evidence.card_tag("NVIDIA H200") == "h200"
    names = [row_name(r) for r in matrix(False)]
    h100 = gpu_evidence.committed("h100")
    assert "resnet18-128-b8-fp16-adamw" in h100  # at the top
    assert "resnet50-224-b32-fp16-adamw" in h100  # in h100-torch2.11/
    # Every row but nnU-Net's, the language models' from their configs (FSDP2's ranks among
    # them), convnext_small's in cuDNN's benchmark mode, capped or not, and the checkpointed
    # ViT's, 3D U-Net's and smp U-Net's (new: their traces are the next GPU session's work) is
    # recorded.
    new = {n for n in names if n.startswith(("nnunet", "qwen2.5", "llama3.2"))}
    new |= {n for n in names if n.startswith("convnext_small") and "-bench" in n}
    new |= {n for n in names if n.endswith("-ckpt")}
    assert len(new) == 25 and set(names) - new <= gpu_evidence.committed("h200")
    assert gpu_evidence.committed("a100") == set()
    # Then one language model's committed row again: a check of building it without its
    # random fills, its peaks against the committed trace's.
    known = gpu_evidence.committed_traces("h200")
    order = [row_name(r) for r in gpu_evidence.recording_order(matrix(False), set(known))]
    lacking = len(set(names) - set(known))
    assert set(order[:lacking]) == set(names) - set(known) and sorted(order) == sorted(names)
    assert order[lacking] == "qwen2.5-0.5b-full-1024-b4-bf16-adamw"
    path = known[order[lacking]]
    same = {"allocated_bytes_moved": 0, "reserved_bytes_moved": 0}
    assert gpu_evidence.same_as_committed(path, path) == same

    sigs = cudnn_workspaces.signatures()[:3]
    monkeypatch.setattr(cudnn_workspaces, "PACKAGED", tmp_path)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=0: (9, 0))
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91900)
    assert cudnn_workspaces.lacking_first(sigs) == sigs  # no profile for the card: as listed
    sweep = tmp_path / "sweep.json"
    rows = [{**sigs[0], "pass": "forward", "extra_bytes": 0}]
    sweep.write_text(json.dumps({"compute_capability": "9.0", "cudnn": 91900, "rows": rows}))
    cudnn_workspaces.package(sweep)
    assert cudnn_workspaces.lacking_first(sigs) == [sigs[1], sigs[2], sigs[0]]
    # In benchmark mode a signature is measured once its trials are (a profile from before
    # they were recorded has its workspaces only).
    bench = next(s for s in cudnn_workspaces.signatures() if s["benchmark"])
    rows = [{**bench, "pass": "forward", "extra_bytes": 0}]
    header = {"compute_capability": "9.0", "cudnn": 91900, "allow_tf32": True}
    sweep.write_text(json.dumps({**header, "rows": rows}))
    cudnn_workspaces.package(sweep)
    assert cudnn_workspaces.lacking_first([sigs[0], bench]) == [bench, sigs[0]]
    rows.append({**bench, "pass": "forward_trial", "extra_bytes": 2**20})
    sweep.write_text(json.dumps({**header, "rows": rows}))
    cudnn_workspaces.package(sweep)
    assert cudnn_workspaces.lacking_first([sigs[0], bench]) == [sigs[0], bench]


def test_the_cudnn_sweep_ends_itself_inside_its_time_box(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its ``--seconds`` count from its process's start (a fresh machine's imports included),
    and it begins no signature that one as slow as its slowest would not finish: its box had
    killed it in every GPU run since the first, failing ``make gpu-evidence``. Here on a clock
    of its own, a signature taking 10 s: two fit in 25 s, a third would end at 30."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import cudnn_workspaces

    now = [100.0]
    clock = type("Clock", (), {"monotonic": staticmethod(lambda: now[0])})

    def measure(sig: dict, device: str) -> list[dict]:
        now[0] += 10
        return [{**sig, "pass": p, "extra_bytes": 0} for p in ("a", "b", "c")]

    monkeypatch.setattr(cudnn_workspaces, "time", clock)
    monkeypatch.setattr(cudnn_workspaces, "measure", measure)
    monkeypatch.setattr(cudnn_workspaces, "STARTED", 95.0)  # its imports took 5 s
    out = tmp_path / "sweep.json"
    argv = ["cudnn_workspaces.py", "--dry-run", "--out", str(out), "--seconds", "30"]
    monkeypatch.setattr(sys, "argv", argv)
    assert cudnn_workspaces.main() == 0
    assert json.loads(out.read_text())["signatures_done"] == 2 and now[0] == 120.0


@pytest.mark.slow
def test_a_plan_made_beforehand_is_the_plan_made_in_the_run(tmp_path: Path) -> None:
    """trainer_budget's plan, saved by the planner process gpu_evidence starts and loaded by
    its run, is the plan the run would make; a planner's error is said, and the run plans."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import trainer_budget

    plan = trainer_budget.make_plan(True)
    path = tmp_path / "plan.json"
    plan.save(path)
    assert trainer_budget.read_plan(path) == plan
    path.write_text(json.dumps({"error": "RuntimeError: no memory"}))
    again, source = trainer_budget.planned(True, path, 0.0)
    assert again == replace(plan, plan=replace(plan.plan, prediction=again.plan.prediction))
    assert source == "planned here (plan.json: RuntimeError: no memory)"


@pytest.mark.slow
def test_the_summary_is_rebuilt_from_a_folders_part_files(tmp_path: Path) -> None:
    """A follow-up call reruns a part into a finished run's folder; ``--summarize`` rebuilds
    the summary from the part files as they are then (the fourth H100 session's: its first
    call measured 2 matrix rows, the second 12), the machine and the states the first run's."""
    run = ROOT / "benchmarks" / "results" / "h100-80gb-hbm3-cuda13.0-2026-11-26-run4"
    for name in ("summary.json", "memory_matrix.json", "speed.json", "decode.json"):
        (tmp_path / name).write_bytes((run / name).read_bytes())
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_evidence.py"), "--summarize",
         str(tmp_path)],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["results"]["memory_matrix"]["rows_measured"] == 12
    assert summary["parts"]["gpu_tests"]["state"].startswith("out of time")
    md = (tmp_path / "summary.md").read_text()
    assert "12 of 24 rows measured" in md and "Decoding (" in md
    empty = tmp_path / "empty"
    empty.mkdir()
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_evidence.py"), "--summarize",
         str(empty)],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2 and "summary.json not found" in done.stderr


@pytest.mark.slow
def test_the_nnunet_rows_need_nnunets_losses_and_networks_not_its_whole_closure() -> None:
    """A GPU machine's image lacks nnU-Net's dependencies (SimpleITK, pandas, scikit-image,
    blosc2 ...; the trainer's imports): the matrix's nnU-Net rows are built and predicted with
    nnunetv2's losses and network builder, dynamic_network_architectures and batchgenerators'
    file helpers alone, the three small wheels prepare_gpu_wheels.sh adds."""
    pytest.importorskip("nnunetv2")
    code = (
        "import sys; sys.path.insert(0, 'benchmarks')\n"
        "from gpu_matrix import matrix, spec_of\n"
        "from bigbatch.memory.predict import predict_peak\n"
        "row = next(r for r in matrix(True) if r['kind'] == 'nnunet')\n"
        "assert predict_peak(spec_of(row, 'cuda')).reserved_bytes > 0\n"
        "print(sorted({m.split('.')[0] for m in sys.modules}))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    imported = set(json.loads(done.stdout.strip().splitlines()[-1].replace("'", '"')))
    closure = {"SimpleITK", "pandas", "sklearn", "skimage", "blosc2", "cc3d", "acvl_utils",
               "batchgeneratorsv2", "imagecodecs", "nibabel", "tifffile"}  # fmt: skip
    assert not imported & closure, imported & closure
    assert {"nnunetv2", "dynamic_network_architectures", "batchgenerators"} <= imported


@pytest.mark.parametrize("which", ["lora_ckpt", "fsdp2"])
def test_a_language_models_row_is_built_without_its_random_fills(
    which: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """record_trace builds a language model's row without transformers' and peft's random
    initialisation (most of such a row's time on a GPU machine) and fills its weights with
    constants: the same parameters (names, shapes, dtypes, which train; tied embeddings tied)
    and buffers as the step the planner's real build makes, every weight defined, a finite
    loss; an FSDP2 rank's local shards filled where they are."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_matrix
    import torch
    from gpu_matrix import matrix, ranks_of, spec_of
    from record_trace import model_and_optimizer

    tied = {**gpu_matrix.HF_CONFIGS["tiny"], "tie_word_embeddings": True}
    monkeypatch.setitem(gpu_matrix.HF_CONFIGS, "tiny", tied)  # as Llama-3.2-1B's and Qwen's

    from bigbatch.memory.measure import real_step_setup
    from bigbatch.memory.step import make_inputs, run_step_loss

    rows = [r for r in matrix(True) if r["kind"] == "hf"]
    row = rows[0] if which == "lora_ckpt" else next(r for r in rows if r.get("ranks", 1) > 1)
    with ranks_of(row):
        spec = spec_of(row, "cpu", real=True)
        built = real_step_setup(spec, 0)[0]
        model, opt = model_and_optimizer(row, spec)

        def described(m: torch.nn.Module) -> list[tuple[Any, ...]]:
            return [(n, p.shape, p.dtype, p.requires_grad, type(p).__name__)
                    for n, p in m.named_parameters()]  # fmt: skip

        assert described(model) == described(built)
        assert not any("lm_head" in n for n, _ in model.named_parameters())  # tied
        buffers = dict(built.named_buffers())
        for name, b in model.named_buffers():
            assert torch.equal(b, buffers[name]), name
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            assert torch.isin(local, torch.tensor([0.02, 1.0], dtype=local.dtype)).all(), name
        loss = run_step_loss(spec, model, make_inputs(spec, "cpu"), "cpu")
        assert torch.isfinite(loss)
        loss.backward()
        opt.step()
