"""Adds one thing to 01: mixed precision with a GradScaler and gradient clipping.

The loss is scaled on every micro-batch, the window's gradient unscaled once, normalised by the
true count, clipped once, and the step (with the scheduler) is skipped if it holds inf/nan.
On a GPU use device "cuda" and dtype float16; this runs anywhere (bf16 autocast on CPU).
"""

import torch
import torch.nn.functional as F

import bigbatch

device = "cuda" if torch.cuda.is_available() else "cpu"
amp_dtype = torch.float16 if device == "cuda" else torch.bfloat16
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3)).to(
    device
)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler(device)
acc = bigbatch.Accumulator(optimizer, micro_batches=3, scaler=scaler, clip_grad_norm=1.0)

for size in [16, 16, 7, 16, 16, 16]:
    x, y = torch.randn(size, 20, device=device), torch.randint(0, 3, (size,), device=device)
    with torch.autocast(device, dtype=amp_dtype):
        logits = model(x)
    acc.backward(F.cross_entropy(logits.float(), y), count=size)
    if acc.window_full:
        r = acc.step()
        print(
            f"step {r.optimizer_step}: loss {r.loss:.4f}, grad norm before clipping {r.grad_norm:.3f}, skipped={r.skipped}"
        )
