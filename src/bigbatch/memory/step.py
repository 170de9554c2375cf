"""One training step, as the planner predicts it and the measurements run it: the step's
description (:class:`StepSpec`), its inputs, its optimizer and the step itself. Prediction
(:mod:`.predict`), measurement (:mod:`.measure`) and calibration (:mod:`.calibrate`) share it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from bigbatch.device import autocast_for
from bigbatch.memory.stack import LayerStack

__all__ = [
    "OPTIMIZERS",
    "PRECISIONS",
    "Precision",
    "StepSpec",
    "batch_bytes",
    "first_optimizer_step",
    "loss_of",
    "make_inputs",
    "make_optimizer",
    "optimizer_state_tensors",
    "run_step_loss",
    "run_training_step",
]

Precision = Literal["fp32", "bf16", "fp16"]
# bitsandbytes' AdamW variants (8-bit, paged) are traced as stand-ins: bigbatch.memory.bnb.
OPTIMIZERS = (
    "adamw",
    "adamw_fused",
    "adam",
    "sgd",
    "sgd_momentum",
    "rmsprop",
    "adagrad",
    "adamw_8bit",
    "paged_adamw_8bit",
    "paged_adamw_32bit",
)
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class StepSpec:
    """One training step to predict or measure.

    ``model`` builds the network (it is called under the meta device, so building is free);
    ``input_shape`` is one sample's shape, e.g. ``(3, 224, 224)``; integer ``input_dtype``
    (token ids) draws inputs from ``[0, vocab)``.

    Your own step: ``batch(batch_size, device)`` builds one micro-batch (a tensor, tuple or
    dict: it exists before the step, as a loader's batch does), and ``step(model, batch)`` runs
    the forward pass and returns the loss, with your wrapper, inputs and loss (a Hugging Face
    model called with ``labels=``, frozen weights, activation checkpointing). Without them, the
    batch is random ``input_shape`` samples and the loss a cross-entropy of ``[B, C]`` outputs
    (else a mean square). A model of repeated blocks (a decoder's layers) is traced for CUDA
    from a 5-layer model's trace with ``layers`` (:class:`~bigbatch.memory.stack.LayerStack`).

    >>> def lm_step(model, ids):
    ...     return torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
    >>> spec = StepSpec(lambda: torch.nn.Embedding(50, 50), (16,), 4, input_dtype=torch.long,
    ...                 vocab=50, step=lm_step)
    >>> run_step_loss(spec, spec.model(), make_inputs(spec, "cpu"), "cpu").shape
    torch.Size([])
    """

    model: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    batch_size: int
    optimizer: str = "adamw"
    precision: Precision = "fp32"
    device: str = "cpu"
    input_dtype: torch.dtype = torch.float32
    name: str = ""
    vocab: int = 2  # integer inputs are drawn from [0, vocab): give an embedding's size
    step: Callable[[nn.Module, Any], torch.Tensor] | None = None  # (model, batch) -> loss
    batch: Callable[[int, Any], Any] | None = None  # (batch_size, device) -> one micro-batch
    # cuDNN's benchmark mode (``torch.backends.cudnn.benchmark``): other algorithms, their
    # trials on the first step (bigbatch.memory.cuda_runtime.CudaLibraries).
    cudnn_benchmark: bool = False
    # CUDA: the bytes the caching allocator may reserve (a card's memory less its context, or a
    # set_per_process_memory_fraction cap): benchmark trials shrink to fit it, and the cache is
    # released before a request would pass it. None: as much as the step takes.
    memory_limit: int | None = None
    # A later micro-batch of a window (accumulation): every trainable weight's gradient, summed
    # from the earlier micro-batches, is alive from its start, and its backward adds into them.
    held_gradients: bool = False
    # A model whose layers repeat (a decoder's): a CUDA trace is made from a shallow model's,
    # where that reproduces a deeper one's (bigbatch.memory.stack).
    layers: LayerStack | None = None

    def with_batch(self, batch_size: int) -> StepSpec:
        return replace(self, batch_size=batch_size)

    def in_window(self, target_batch: int) -> StepSpec:
        """This step as a window of ``target_batch`` samples runs it: where the micro-batch is
        smaller, its later micro-batches hold the window's gradients (``held_gradients``).

        >>> spec = StepSpec(lambda: torch.nn.Linear(4, 2), (4,), 8)
        >>> spec.in_window(32).held_gradients, spec.in_window(8).held_gradients
        (True, False)
        """
        return replace(self, held_gradients=self.batch_size < target_batch)


def make_optimizer(
    name: str, params: Any, lr: float = 1e-3, foreach: bool | None = None
) -> torch.optim.Optimizer:
    """The optimizers the planner knows, by name (their state is what differs).
    ``adamw_fused`` is torch's fused AdamW (Trainer's default from torch 2.8): one kernel
    updates every weight in place, with no temporaries, so ``foreach`` does not apply.

    >>> make_optimizer("adamw_fused", [torch.nn.Parameter(torch.zeros(2))]).defaults["fused"]
    True
    """
    name = name.lower()
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, foreach=foreach)
    if name == "adamw_fused":
        try:
            return torch.optim.AdamW(params, lr=lr, fused=True)
        except RuntimeError as exc:  # a device torch has no fused kernel for (the CPU < 2.4)
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ValueError(
                f"torch {torch.__version__}'s fused AdamW cannot step these weights ({why}): "
                "plan with --optimizer adamw (optimizer='adamw')"
            ) from None
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, foreach=foreach)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, foreach=foreach)
    if name == "sgd_momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, foreach=foreach)
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=lr, foreach=foreach)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr, foreach=foreach)
    if name in ("adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit"):
        from bigbatch.memory.bnb import make_bnb_optimizer

        return make_bnb_optimizer(name, params, lr=lr)
    raise ValueError(f"unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}")


def loss_of(out: Any) -> torch.Tensor:
    """A loss of the shape training uses: cross-entropy on [B, C] logits, else a mean square."""
    if isinstance(out, dict):
        out = next(iter(out.values()))
    if isinstance(out, tuple | list):
        out = out[0]
    if out.dim() == 2:
        target = torch.zeros(out.shape[0], dtype=torch.long, device=out.device)
        return F.cross_entropy(out.float(), target)
    return out.float().pow(2).mean()


def make_inputs(spec: StepSpec, device: torch.device | str) -> Any:
    """One micro-batch: ``spec.batch``'s, else random samples of ``input_shape``."""
    if spec.batch is not None:
        return spec.batch(spec.batch_size, device)
    shape = (spec.batch_size, *spec.input_shape)
    if spec.input_dtype.is_floating_point:
        return torch.randn(shape, dtype=spec.input_dtype, device=device)
    return torch.randint(0, spec.vocab, shape, dtype=spec.input_dtype, device=device)


def run_step_loss(spec: StepSpec, model: nn.Module, x: Any, device_type: str) -> torch.Tensor:
    """The step's forward pass and loss: ``spec.step``'s (under autocast), else the model's
    output through :func:`loss_of` (outside autocast, in float32, as training computes it)."""
    with autocast_for(spec.precision, device_type):
        if spec.step is not None:
            return spec.step(model, x)
        out = model(x)
    loss = loss_of(out)
    del out
    return loss


def batch_bytes(x: Any) -> int:
    """The bytes of a micro-batch's tensors (any structure)."""
    leaves = torch.utils._pytree.tree_flatten(x)[0]
    return sum(t.untyped_storage().nbytes() for t in leaves if isinstance(t, torch.Tensor))


def run_training_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: Any, spec: StepSpec, device_type: str
) -> None:
    """One training step, the same for prediction and measurement; with ``held_gradients``,
    a window of two micro-batches (``x`` twice): the second holds the first's gradients."""
    for _ in range(2 if spec.held_gradients else 1):
        loss = run_step_loss(spec, model, x, device_type)
        loss.backward()
        del loss
    opt.step()
    opt.zero_grad(set_to_none=True)


def first_optimizer_step(params: list[nn.Parameter], opt: torch.optim.Optimizer) -> None:
    """The optimizer's first step on zero gradients: it creates the state (Adam's two moments)
    with the same sizes and temporaries as a real first step."""
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)


def optimizer_state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor an optimizer keeps as state (Adam's moments, Adagrad's sums, step counts)."""
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
