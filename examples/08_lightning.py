"""A standard Lightning script with exact accumulation: three lines change (marked `# bigbatch`).

Lightning's `accumulate_grad_batches=4` backpropagates loss / 4 for every batch; with the 100
samples below in batches of 16 the last window holds [16, 16, 4] and its update is off by 42 %.
"""

import lightning.pytorch as L
import torch
import torch.nn.functional as F

from bigbatch.integrations.lightning import ExactAccumulation, exact_backward


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3)
        )
        self.automatic_optimization = False  # bigbatch: the module decides how loss becomes grads

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        exact_backward(self, loss, count=len(y))  # bigbatch: weighted by its true count
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(100, 20), torch.randint(0, 3, (100,)))
loader = torch.utils.data.DataLoader(data, batch_size=16)
trainer = L.Trainer(
    max_epochs=2,
    accelerator="cpu",
    callbacks=[ExactAccumulation(4)],  # bigbatch: instead of accumulate_grad_batches=4
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(Classifier(), loader)
print(f"optimizer steps: {trainer.global_step} (2 epochs x 2 windows: 4 x 16, then 16+16+16+4)")
