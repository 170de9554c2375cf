"""Resume after a kill -9 in the middle of an epoch: bit-identical to an uninterrupted run.

The killed run checkpoints every optimizer step (checkpoint_every=1) and is SIGKILLed at a
fixed window of epoch 2, in a subprocess (no clean-up runs). The resume skips the windows done
without loading them, restores the random streams (augmentation) and the epoch's loss sums, and
removes the temporary file a kill mid-write leaves."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tiny_runs import TINY_MODEL, write_images

KILL = textwrap.dedent(
    """
    import os, signal, sys
    import bigbatch.io
    import bigbatch.train.stepping as stepping
    from bigbatch.cli.main import main
    real, calls = stepping.run_window, [0]
    writers, real_init = [], bigbatch.io.BackgroundWriter.__init__
    def init(self, *args, **kwargs):
        writers.append(self)
        real_init(self, *args, **kwargs)
    bigbatch.io.BackgroundWriter.__init__ = init
    def run_window(*args, **kwargs):
        calls[0] += 1
        if calls[0] == int(os.environ["KILL_AT"]):
            # The checkpoints handed over are on disk (they are written off the training
            # thread): the kill lands after window 3's, at a known place.
            for writer in writers:
                writer.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)
    stepping.run_window = run_window
    if os.environ.get("NO_RNG_RESTORE"):  # the negative control
        import torch
        torch.set_rng_state = lambda state: None
    sys.exit(main(sys.argv[1:]))
    """
)


def _train(tmp: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run(
        [sys.executable, "-c", KILL, "train", *args, "--no-progress"],
        cwd=tmp,
        env={**os.environ, "KILL_AT": "0", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_resume_after_sigkill_mid_epoch_is_bit_identical(tmp_path: Path) -> None:
    write_images(tmp_path / "train", n_per_class=10)
    (tmp_path / "tinymodel.py").write_text(TINY_MODEL)
    keys = [
        "data=train",
        "model=tinymodel:tiny",
        "size=16",
        "batch=4",  # 24 training images: 6 windows an epoch
        "micro_batch=2",
        "epochs=3",
        "mode=fit",
        "device=cpu",
        "num_workers=0",
        "threads=1",
        "lr=0.01",
        "checkpoint_every=1",
    ]
    full = _train(tmp_path, *keys, "--out", "full")
    assert full.returncode == 0, full.stderr[-2000:]
    reference = load_file(tmp_path / "full" / "last.safetensors")

    killed = _train(tmp_path, *keys, "--out", "killed", KILL_AT="10")  # epoch 2, window 4
    assert killed.returncode == -9, killed.stderr[-2000:]
    state = torch.load(tmp_path / "killed" / "last.pt", weights_only=True)
    assert state["epoch"] == 0 and state["mid"]["windows"] == 3  # mid-epoch 2
    shutil.copytree(tmp_path / "killed", tmp_path / "no_rng")  # a copied run resumes the same
    for name, env, identical in (("killed", {}, True), ("no_rng", {"NO_RNG_RESTORE": "1"}, False)):
        leftover = tmp_path / name / ".last.pt.dead0000.tmp"  # as a kill mid-write leaves
        leftover.write_bytes(b"partial")
        resumed = _train(tmp_path, "--resume", name, **env)
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        assert "in epoch 2 of 3, after window 3" in resumed.stdout
        assert not leftover.exists()
        weights = load_file(tmp_path / name / "last.safetensors")
        same = all(torch.equal(reference[k], weights[k]) for k in reference)
        assert same is identical, name
