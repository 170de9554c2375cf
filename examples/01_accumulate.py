"""A plain PyTorch loop, then the same loop with bigbatch: the change is three lines.

Before (the usual accumulation, wrong whenever micro-batches differ in size):

    for i, (x, y) in enumerate(loader):
        loss = F.cross_entropy(model(x), y)
        (loss / ACCUM).backward()
        if (i + 1) % ACCUM == 0:
            optimizer.step(); scheduler.step(); optimizer.zero_grad()

After: see train() below.
"""

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import bigbatch

ACCUM = 4
torch.manual_seed(0)
data = TensorDataset(torch.randn(270, 20), torch.randint(0, 3, (270,)))  # 4 windows of 64, then 14
loader = DataLoader(data, batch_size=16, shuffle=True)
model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=3 * 5)


def train() -> None:
    acc = bigbatch.Accumulator(optimizer, micro_batches=ACCUM, scheduler=scheduler)  # 1
    for epoch in range(3):
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            acc.backward(loss, count=len(y))  # 2: weight by the real count
            if acc.window_full:
                result = acc.step()  # normalise, step, scheduler, zero_grad
                print(
                    f"epoch {epoch} step {result.optimizer_step:2d}: loss {result.loss:.4f} over {result.count:.0f} samples"
                )
        last = acc.end_epoch()  # 3: the short last window (14 samples), renormalised
        if last is not None:
            print(
                f"epoch {epoch} step {last.optimizer_step:2d}: loss {last.loss:.4f} over {last.count:.0f} samples (partial window)"
            )
    print(
        f"{acc.optimizer_step} optimizer steps, {acc.micro_step} micro-batches, {acc.samples_seen} samples"
    )


if __name__ == "__main__":
    train()
