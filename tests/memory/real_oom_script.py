"""Run by test_oom.py in a subprocess: two windows of 512 samples under an address-space limit
(argv[1] MiB above the current size) that micro-batch 512 does not fit; saves the weights.
test_oom.py imports build() to compute the reference without a limit."""

import resource
import sys

import torch
import torch.nn.functional as F

from bigbatch import Accumulator
from bigbatch.backoff import OOMBackoff, run_window


def build() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """The model and the window: 512 samples whose activations (32768 wide) need ~500 MiB."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 32768), torch.nn.ReLU(), torch.nn.Linear(32768, 10)
    )
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 256, generator=g, dtype=torch.float64)
    return model.double(), x, torch.randint(0, 10, (512,), generator=g)


def vmsize() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


if __name__ == "__main__":
    torch.set_num_threads(1)  # threads need address space too: keep the limit about tensors
    model, x, y = build()
    acc = Accumulator(torch.optim.SGD(model.parameters(), lr=0.1))
    backoff = OOMBackoff(micro_batch=512, grow_after=0)
    resource.setrlimit(
        resource.RLIMIT_AS, (vmsize() + int(sys.argv[1]) * 2**20, resource.RLIM_INFINITY)
    )
    for _ in range(2):
        run_window(acc, (x, y), lambda b: F.cross_entropy(model(b[0]), b[1]), backoff)
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    print([(e.old, e.new) for e in backoff.events])
    torch.save(model.state_dict(), sys.argv[2])
