"""The training command's optimizer, schedule and phases (fine_tune: the head alone, then all)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from bigbatch.device import device_kind
from bigbatch.train.config import TrainConfig

__all__ = [
    "head_parameters",
    "load_optimizer_state",
    "make_optimizer",
    "mode_line",
    "phases",
    "plan_optimizer",
]


def plan_optimizer(name: str, device: str | torch.device) -> str:
    """The planner's name for the training optimizer ``name`` as :func:`make_optimizer` makes
    it on ``device``: SGD has momentum; AdamW is the fused one where the device's kind runs it
    (a card: no update temporaries, its step counts on the card).

    >>> [plan_optimizer(*o) for o in (("adamw", "cuda:0"), ("adamw", "cpu"), ("sgd", "cuda"))]
    ['adamw_fused', 'adamw', 'sgd_momentum']
    """
    if name == "sgd":
        return "sgd_momentum"
    return "adamw_fused" if device_kind(device).fused_adamw else "adamw"


def load_optimizer_state(opt: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Load a checkpoint's optimizer state into ``opt``, keeping the kernel ``opt`` was built
    with (``fused``, ``foreach``): the saved groups carry the saving run's, which differ where
    it ran on another device or an earlier bigbatch, and this run's plan traced its own. Each
    step count goes where that kernel keeps it (fused: float32 beside its weight; else host).

    >>> p = nn.Parameter(torch.ones(3)); p.grad = torch.ones(3)
    >>> old = torch.optim.AdamW([p], foreach=True); old.step()
    >>> new = torch.optim.AdamW([p], fused=True)
    >>> load_optimizer_state(new, old.state_dict())
    >>> new.param_groups[0]["fused"], new.param_groups[0]["foreach"], new.state[p]["step"].item()
    (True, None, 1.0)
    """
    kernel_keys: tuple[str, ...] = ("fused", "foreach")
    built = [{k: g[k] for k in kernel_keys if k in g} for g in opt.param_groups]
    opt.load_state_dict(saved)
    for group, kernel in zip(opt.param_groups, built, strict=True):
        group.update(kernel)
        for p in group["params"]:
            step = opt.state.get(p, {}).get("step")
            if torch.is_tensor(step):
                where = p.device if group.get("fused") or group.get("capturable") else "cpu"
                opt.state[p]["step"] = step.to(where, torch.float32)


def head_parameters(model: nn.Module) -> set[int]:
    getter = getattr(model, "get_classifier", None)
    head = getter() if callable(getter) else None
    if not isinstance(head, nn.Module) or not list(head.parameters()):
        # Not a timm model: the last module with parameters is the head.
        head = [m for m in model.modules() if list(m.parameters(recurse=False))][-1]
    return {id(p) for p in head.parameters()}


def phases(cfg: TrainConfig) -> list[tuple[str, int]]:
    if cfg.fine_tunes and cfg.freeze_epochs > 0:
        return [("frozen", cfg.freeze_epochs), ("unfrozen", cfg.epochs)]
    return [("all", cfg.epochs)]


def make_optimizer(
    cfg: TrainConfig, model: nn.Module, phase: str, steps: int
) -> tuple[torch.optim.Optimizer, Any]:
    head = head_parameters(model)
    for p in model.parameters():
        p.requires_grad_(phase != "frozen" or id(p) in head)
    params = [p for p in model.parameters() if p.requires_grad]
    lr = cfg.lr * (2.0 if phase == "frozen" else 1.0)  # the head alone takes a larger rate
    opt: torch.optim.Optimizer
    if cfg.optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=cfg.weight_decay)
    else:
        # Fused exactly where the plan traces it so (one decision: plan_optimizer's).
        fused = bool(params) and plan_optimizer("adamw", params[0].device) == "adamw_fused"
        opt = torch.optim.AdamW(
            params, lr=lr, weight_decay=cfg.weight_decay, fused=True if fused else None
        )
    sched: Any
    if cfg.schedule == "one_cycle":
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=max(1, steps))
    elif cfg.schedule == "cosine":
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, steps))
    else:
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=1)
    return opt, sched


def mode_line(cfg: TrainConfig) -> str:
    """What trains, from what weights, and whether activations are recomputed: the run's log.

    >>> from bigbatch.train.config import load_config
    >>> mode_line(load_config(overrides=["data=x", "arch=resnet18", "grad_checkpointing=true"]))
    'mode: fit (random weights: every layer trains from the start); activation checkpointing'
    """
    recomputed = "; activation checkpointing" if cfg.grad_checkpointing else ""
    if cfg.fine_tunes:
        return (
            f"mode: fine_tune (the head alone for {cfg.freeze_epochs} epoch(s), then all: "
            "starting from " + ("pretrained weights)" if cfg.pretrained else "weights=)")
        ) + recomputed
    if cfg.weights or cfg.pretrained:
        start = "weights=" + cfg.weights if cfg.weights else "pretrained weights"
        return f"mode: fit (every layer trains, starting from {start})" + recomputed
    return "mode: fit (random weights: every layer trains from the start)" + recomputed
