"""Adds one thing to 01: a token loss with padding, normalised by real tokens, not micro-batches.

Sequences of different lengths are padded with -100 labels; each micro-batch holds a different
number of real tokens. bigbatch counts labels != -100 and normalises the window by their sum.
"""

import torch
import torch.nn.functional as F

import bigbatch

VOCAB = 100
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 32), torch.nn.Linear(32, VOCAB))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
acc = bigbatch.Accumulator(optimizer, micro_batches=4)


def micro_batch(max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.randint(1, max_len, (8,))
    tokens = torch.randint(0, VOCAB, (8, max_len))
    labels = tokens.roll(-1, dims=1)
    labels[torch.arange(max_len) >= lengths[:, None]] = -100  # padding
    return tokens, labels


for _ in range(8):
    tokens, labels = micro_batch(max_len=int(torch.randint(8, 128, ())))
    logits = model(tokens)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
    acc.backward(loss, labels=labels)  # counts the real tokens
    if acc.window_full:
        r = acc.step()
        print(f"step {r.optimizer_step}: loss {r.loss:.4f} per token over {r.count:.0f} tokens")
print(f"tokens_seen={acc.tokens_seen} samples_seen={acc.samples_seen}")
