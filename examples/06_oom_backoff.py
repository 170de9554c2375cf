"""Adds one thing to 01: surviving out-of-memory by shrinking the micro-batch, without changing
the update. The loader yields whole target batches (windows); run_window splits each into
micro-batches that fit, and on OOM re-runs the same samples with half the micro-batch.

Here an OOM is simulated above 16 samples (as if the GPU only fit 16); the weights end equal to
a run that never ran out of memory.
"""

import copy

import torch
import torch.nn.functional as F

import bigbatch
from bigbatch.backoff import OOMBackoff, run_window

torch.manual_seed(0)
start = torch.nn.Sequential(
    torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3)
).double()
windows = [(torch.randn(64, 20, dtype=torch.float64), torch.randint(0, 3, (64,))) for _ in range(4)]


def train(model: torch.nn.Module, backoff: OOMBackoff, fits: int) -> torch.nn.Module:
    acc = bigbatch.Accumulator(torch.optim.SGD(model.parameters(), lr=0.1))

    def loss_fn(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if len(batch[1]) > fits:  # what a real GPU does past its memory
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return F.cross_entropy(model(batch[0]), batch[1])

    for window in windows:
        run_window(acc, window, loss_fn, backoff)
    return model


reference = train(copy.deepcopy(start), OOMBackoff(micro_batch=64), fits=64)
backoff = OOMBackoff(micro_batch=64, grow_after=0)
recovered = train(copy.deepcopy(start), backoff, fits=16)
print("back-off:", [f"{e.old} -> {e.new}" for e in backoff.events])
diff = max(
    float((p - q).abs().max().detach())
    for p, q in zip(recovered.parameters(), reference.parameters(), strict=True)
)
print(f"largest weight difference to the run without OOM: {diff:.1e}")
