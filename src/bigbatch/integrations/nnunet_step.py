"""nnU-Net's training step as bigbatch plans it, apart from the trainer: what the planner
predicts at each candidate batch, and what ``make gpu-evidence``'s nnU-Net rows record on a
card. It needs nnU-Net's losses and its network classes (``nnunetv2``,
``dynamic_network_architectures``), not the rest of nnU-Net's dependencies (SimpleITK, pandas,
scikit-image, blosc2 ...), which :mod:`bigbatch.integrations.nnunet`'s trainer imports: a GPU
machine records these rows with three small wheels (``benchmarks/prepare_gpu_wheels.sh``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from bigbatch.memory.step import Precision, StepSpec

__all__ = ["plan_step_spec"]


def plan_step_spec(
    build: Callable[[], nn.Module],
    patch: tuple[int, ...],
    channels: int,
    outputs: int,
    arch_kwargs: dict,
    *,
    precision: Precision = "fp16",
    device: str = "cuda",
    regions: bool = False,
    ignore_label: bool = False,
) -> StepSpec:
    """nnU-Net's training step for a plan being made, as its trainer runs it: DC+CE on every
    deep supervision output (the lowest weighted 0, as nnU-Net's trainer weighs them), batch
    Dice for a 2D patch, fp16 autocast on CUDA, SGD with momentum. With ``regions`` (a dataset
    of regions, BraTS's: ``outputs`` sigmoid heads), DC+BCE over the regions' labels one-hot,
    a bool channel each and, with ``ignore_label``, the ignore label's last, as nnU-Net's
    trainer hands them to its loss; with ``ignore_label`` and classes, DC+CE that leaves out
    the voxels of the label past the heads. What the planner predicts at each candidate batch,
    and ``make gpu-evidence``'s nnU-Net rows record on a card. As the planner
    ``nnUNetPlannerBigBatch`` uses it, for the network a plan describes::

        spec = plan_step_spec(build, (128, 128, 128), 1, 3, arch_kwargs)
        predict_peak(replace(spec, batch_size=2)).planning_bytes
    """
    from nnunetv2.training.loss.compound_losses import DC_and_BCE_loss, DC_and_CE_loss
    from nnunetv2.training.loss.deep_supervision import DeepSupervisionWrapper
    from nnunetv2.training.loss.dice import MemoryEfficientSoftDiceLoss

    strides = np.array(arch_kwargs["strides"], dtype=float)
    scales = [list(s) for s in 1 / np.cumprod(strides, axis=0)][:-1]
    weights = np.array([1 / (2**i) for i in range(len(scales))])
    weights[-1] = 0
    # nnU-Net's _build_loss: regions' Dice counts the background channel (there is none).
    dice = {"batch_dice": len(patch) == 2, "smooth": 1e-5, "do_bg": regions, "ddp": False}
    inner: nn.Module = (
        DC_and_BCE_loss(
            {}, dice, use_ignore_label=ignore_label, dice_class=MemoryEfficientSoftDiceLoss
        )
        if regions
        else DC_and_CE_loss(
            dice,
            {},
            weight_ce=1,
            weight_dice=1,
            ignore_label=outputs if ignore_label else None,  # nnU-Net's: the highest label
            dice_class=MemoryEfficientSoftDiceLoss,
        )
    )
    loss = DeepSupervisionWrapper(inner, weights / weights.sum())
    # The ignore label is one past the heads: a last one-hot channel, or the highest class.
    labels = outputs + int(ignore_label)

    def labelled(b: int, shape: list[int], where: Any) -> torch.Tensor:
        if regions:
            return torch.randint(0, 2, (b, labels, *shape), device=where).bool()
        return torch.randint(0, labels, (b, 1, *shape), device=where).float()

    def example(b: int, where: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
        x = torch.randn(b, channels, *patch, device=where)
        shapes = [[max(1, round(p * f)) for p, f in zip(patch, s, strict=True)] for s in scales]
        return x, [labelled(b, sh, where) for sh in shapes]

    def step(model: nn.Module, micro: Any) -> torch.Tensor:
        x, y = micro
        return loss(model(x), y)

    return StepSpec(
        build, (channels, *patch), 1, "sgd_momentum", precision, device, step=step, batch=example
    )
