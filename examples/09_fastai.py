"""A standard fastai script with exact accumulation: one line changes (marked `# bigbatch`).

fastai's `GradientAccumulation(n_acc=64)` divides every window by 64 whatever it held, and never
steps the epoch's remainder; `ExactGradientAccumulation` divides by the true count and steps it.
"""

import fastai.callback.schedule  # noqa: F401  (adds Learner.fit_one_cycle)
import torch
import torch.nn.functional as F
from fastai.data.core import DataLoaders
from fastai.learner import Learner

from bigbatch.integrations.fastai import ExactGradientAccumulation

torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(100, 20), torch.randint(0, 3, (100,)))
train = torch.utils.data.DataLoader(data, batch_size=24, shuffle=True)
valid = torch.utils.data.DataLoader(data, batch_size=50)
model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))

accumulate = ExactGradientAccumulation(n_acc=64)  # bigbatch: instead of GradientAccumulation(64)
learn = Learner(DataLoaders(train, valid), model, loss_func=F.cross_entropy, cbs=accumulate)
with learn.no_bar(), learn.no_logging():
    learn.fit_one_cycle(2, 1e-3)
print(f"optimizer steps: {accumulate.optimizer_step} (per epoch: 24+24+24, then 24+4)")
