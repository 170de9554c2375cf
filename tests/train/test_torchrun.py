"""`torchrun --nproc-per-node 2 -m bigbatch train ...` on CPU: rank 0 alone writes; resume works."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_runs import TINY_MODEL, write_images


def _torchrun(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "bigbatch", "train", *args]
    env = dict(os.environ, PYTHONPATH=str(cwd))
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_torchrun_two_ranks(tmp_path: Path) -> None:
    write_images(tmp_path / "data")
    (tmp_path / "tinymodel.py").write_text(TINY_MODEL)
    args = ["data=data", "model=tinymodel:tiny", "size=16", "batch=12", "micro_batch=4", "epochs=2"]
    args += ["mode=fit", "device=cpu", "num_workers=0", "--out", "run", "--no-progress"]
    args += ["log=tensorboard", "budget=1GB", "overhead=0"]
    done = _torchrun(tmp_path, *args)
    assert done.returncode == 0, done.stderr[-3000:]
    # The fixed micro-batch checked against each rank's share, beside DDP's buckets.
    assert "plan: DDP's gradient buckets hold" in done.stdout
    assert done.stdout.count("run folder: run") == 1  # rank 0 alone reports
    # ... and alone writes to the trackers: one writer's event files, each epoch once.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("valid_loss")] == [2, 4]
    assert events.Scalars("samples_seen")[-1].value == 48  # both ranks' samples, 2 epochs
    assert "2 ranks x 6 samples per window = target batch 12" in done.stdout
    with open(tmp_path / "run" / "history.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["epoch"] for r in rows] == ["1", "2"]
    assert rows[-1]["optimizer_steps"] == "4"  # 24 images / 12 per window, over 2 ranks, 2 epochs
    again = _torchrun(tmp_path, "--resume", "run", "--no-progress")
    assert again.returncode == 0, again.stderr[-3000:]
    # Finished: every rank returns at once (none waits on a collective), nothing reported again.
    assert "run finished earlier (2 epoch(s), best valid_loss" in again.stdout
    assert again.stdout.count("run folder: run") == 1
    events.Reload()
    assert [e.step for e in events.Scalars("valid_loss")] == [2, 4]
    # Its end undone (done.json deleted, as the refusal of a damaged one says): each rank
    # loads last.pt and the run ends again.
    (tmp_path / "run" / "done.json").unlink()
    again = _torchrun(tmp_path, "--resume", "run", "--no-progress")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming run after epoch 2 of 2" in again.stdout
