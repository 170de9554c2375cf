"""Adds one thing to 01: several processes with DDP, exact whatever each rank's share.

    torchrun --nproc-per-node 2 examples/07_ddp.py     # 2 CPU processes (gloo)
    python examples/07_ddp.py                          # also runs as a single process

Each micro-batch runs inside acc.no_sync(): DDP synchronises gradients only during the last
micro-batch of a window, and the window's sample count is summed over ranks at step time.
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import bigbatch

distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
if distributed:
    dist.init_process_group("gloo")
rank = dist.get_rank() if distributed else 0

torch.manual_seed(0)
data = TensorDataset(torch.randn(270, 20), torch.randint(0, 3, (270,)))
sampler = DistributedSampler(data, seed=0) if distributed else None
loader = DataLoader(data, batch_size=16, sampler=sampler, shuffle=sampler is None)
model: torch.nn.Module = torch.nn.Sequential(
    torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3)
)
if distributed:
    model = torch.nn.parallel.DistributedDataParallel(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
acc = bigbatch.Accumulator(optimizer, micro_batches=4, model=model)

for epoch in range(2):
    if sampler is not None:
        sampler.set_epoch(epoch)
    for x, y in loader:
        with (
            acc.no_sync()
        ):  # the one addition: no gradient sync until the window's last micro-batch
            acc.backward(F.cross_entropy(model(x), y), count=len(y))
        if acc.window_full:
            result = acc.step()
            if rank == 0:
                print(
                    f"step {result.optimizer_step}: loss {result.loss:.4f} over {result.count:.0f} samples (all ranks)"
                )
    acc.end_epoch()
# End the group once every rank is done: a barrier, then destroy. Without them torch 2.14's gloo
# often aborts a finished rank at exit ("terminate called without an active exception"); with them
# it still did in 2 runs of 100 here, which is why the `bigbatch` command skips interpreter teardown.
if distributed:
    dist.barrier()
    dist.destroy_process_group()
