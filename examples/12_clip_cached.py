"""Adds one thing to 01: a CLIP-style two-tower contrastive loss at a batch that does not fit,
exactly (gradient caching).

InfoNCE's negatives are the rest of the batch, so 4 micro-batches of 32 are not a batch of 128
(31 negatives instead of 127) whatever the weights. `cached_backward` encodes every micro-batch
without a graph, takes the loss's gradient on all 128 pairs at once, then backpropagates each
micro-batch's share: the big batch's update with one micro-batch's activations.
"""

import torch

import bigbatch
from bigbatch.coupled import cached_backward, info_nce

torch.manual_seed(0)
image_tower = torch.nn.Sequential(
    torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32)
)
text_tower = torch.nn.Sequential(
    torch.nn.Embedding(100, 32), torch.nn.Flatten(), torch.nn.Linear(8 * 32, 32)
)
params = [*image_tower.parameters(), *text_tower.parameters()]
acc = bigbatch.Accumulator(torch.optim.AdamW(params, lr=1e-3), micro_batches=1)

# Synthetic pairs: a caption's tokens are a noisy function of its image.
images = torch.randn(512, 64)
captions = (images[:, :8].abs() * 12).long().clamp(max=99)

for step in range(4):
    batch = slice(step * 128, (step + 1) * 128)
    micro = list(zip(images[batch].split(32), captions[batch].split(32), strict=True))  # 4 x 32
    loss = cached_backward(acc, lambda mb: (image_tower(mb[0]), text_tower(mb[1])), info_nce, micro)
    result = acc.step()
    print(
        f"step {result.optimizer_step}: InfoNCE over 128 pairs (127 negatives each) {float(loss):.4f}"
    )
