"""Adds one thing to a plain loop you cannot restructure: the drop-in optimizer wrapper.

The loop keeps loss.backward(); optimizer.step(); optimizer.zero_grad(). Only step learns the
count. (It costs one extra gradient-sized buffer; Accumulator does not.)
"""

import torch
import torch.nn.functional as F

import bigbatch

torch.manual_seed(0)
model = torch.nn.Linear(10, 2)
optimizer = bigbatch.AccumulatingOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.1), micro_batches=4
)

for size in [8, 8, 8, 3, 8, 8]:
    x, y = torch.randn(size, 10), torch.randint(0, 2, (size,))
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step(count=size)  # the one change
optimizer.end_epoch()  # the last, partial window (8 + 8 samples) steps, renormalised
print(f"optimizer steps: {optimizer.optimizer_step}, samples: {optimizer.samples_seen}")
