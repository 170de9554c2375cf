"""The CPU plan holds under a real budget: the process's real high-water mark (VmHWM) while
training at the plan stays inside a budget a few tens of MiB above what it needs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="VmHWM is Linux's")
@pytest.mark.parametrize("model", ["timm", "gpt"])
@pytest.mark.parametrize("threads", ["1", "2"])
def test_training_at_the_plan_stays_inside_the_budget(model: str, threads: str) -> None:
    script = Path(__file__).with_name("plan_hwm_script.py")
    done = subprocess.run(
        [sys.executable, str(script), model, threads], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["micro_batch"] >= 16  # the budget holds 16 (a few tens of MiB to spare)
    # A few tens of MiB leave no room for glibc's heap to grow past the tensors: that run
    # went to 1,069 MB of a 1,039 MB budget at micro-batch 32 (the GPT, at 1.9x its prediction).
    assert result["return_freed_memory"], result
    assert result["hwm"] <= result["budget"], result
