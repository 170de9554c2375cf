"""Adds one thing to 12: SimCLR-style views through one encoder with dropout, and two cached big
batches per optimizer step.

The encoder runs twice per micro-batch (once without a graph, once with); its random state is
replayed, so dropout draws the same masks both times. Two cached big batches of 64 make one
optimizer step, each weighted by its count, as any two micro-batches would be.
"""

import torch

import bigbatch
from bigbatch.coupled import cached_backward, info_nce

torch.manual_seed(0)
encoder = torch.nn.Sequential(
    torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(128, 16)
)
acc = bigbatch.Accumulator(torch.optim.SGD(encoder.parameters(), lr=0.1), micro_batches=2)


def views(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two augmentations of the same samples: noise and a random feature mask."""
    return x + 0.1 * torch.randn_like(x), x * (torch.rand_like(x) > 0.2)


data = torch.randn(256, 32)
for big_batch in data.split(64):  # 4 cached big batches of 64 = 2 optimizer steps
    v1, v2 = views(big_batch)
    micro = list(zip(v1.split(16), v2.split(16), strict=True))  # 4 x 16
    loss = cached_backward(acc, lambda mb: (encoder(mb[0]), encoder(mb[1])), info_nce, micro)
    if acc.window_full:
        result = acc.step()
        print(
            f"step {result.optimizer_step}: window loss {result.loss:.4f} over {result.count:.0f} pairs"
        )
