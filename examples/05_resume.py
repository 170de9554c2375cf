"""Adds one thing to 01: a checkpoint in the middle of a window, resumed bit-identically.

The Accumulator's state_dict() holds the counters and the window's partial gradient; save it
beside the model and optimizer. torch.load(..., weights_only=True) reads it back (no pickle).
"""

import io

import torch
import torch.nn.functional as F

import bigbatch


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, bigbatch.Accumulator]:
    torch.manual_seed(0)
    model = torch.nn.Linear(10, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, opt, bigbatch.Accumulator(opt, micro_batches=3)


g = torch.Generator().manual_seed(1)
batches = [
    (torch.randn(n, 10, generator=g), torch.randint(0, 2, (n,), generator=g))
    for n in [5, 9, 4, 7, 6, 2]
]


def run(model, acc, todo):
    for x, y in todo:
        acc.backward(F.cross_entropy(model(x), y), count=len(y))
        if acc.window_full:
            acc.step()


model, opt, acc = build()
run(model, acc, batches)
uninterrupted = model.weight.detach().clone()

model, opt, acc = build()
run(model, acc, batches[:4])  # stops one micro-batch into the second window
buf = io.BytesIO()
torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "acc": acc.state_dict()}, buf)

model, opt, acc = build()  # a new process, after the crash
ckpt = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
model.load_state_dict(ckpt["model"])
opt.load_state_dict(ckpt["opt"])
acc.load_state_dict(ckpt["acc"])
run(model, acc, batches[4:])
print("resumed run bit-identical:", torch.equal(model.weight, uninterrupted))
