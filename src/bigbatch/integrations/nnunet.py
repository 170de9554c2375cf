"""nnU-Net v2 on the card you have: :class:`nnUNetTrainerBigBatch` trains nnU-Net's own plan
(network, patch, batch size, deep supervision, DC+CE, augmentation, poly learning rate,
checkpoints, validation, output folders) with each batch split into micro-batches that fit the
memory budget, accumulated exactly into one optimizer step per batch, gradient clipping and fp16
loss scaling as nnU-Net does them, and the OOM back-off keeping the same update.

Why it is exact: nnU-Net's networks normalise each sample on its own (InstanceNorm), its
cross-entropy is a mean over voxels of equal-sized patches and its Dice (``batch_dice=False``)
a mean over samples, so each micro-batch's loss weighted by its share of the batch sums to the
batch's loss. With ``batch_dice=True`` the Dice sums over the whole batch: the samples are
coupled, and the batch goes through gradient caching (:func:`bigbatch.coupled.cached_backward`),
exact too. A label map with an ignore label makes the cross-entropy a mean over the voxels that
are not ignored, whose number differs between samples: each micro-batch's cross-entropy is then
weighed by its share of the batch's voxels not ignored, counted from the labels before the
window, at each deep supervision output (:func:`ignore_label_shares`; regions' binary
cross-entropy too); its Dice, masked, stays a mean over samples.

>>> from bigbatch.integrations.nnunet import split_sizes
>>> split_sizes(5, 2)
[2, 2, 1]
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from bigbatch.accumulate import Accumulator
from bigbatch.backoff import OOMBackoff, run_coupled_window, run_window
from bigbatch.batching import batch_len
from bigbatch.device import (
    autocast_for,
    cap_cuda_allocator,
    card_memory,
    device_kind,
    peak_memory_bytes,
    reset_peak_memory,
)
from bigbatch.distributed import maxima_over_ranks
from bigbatch.integrations import require
from bigbatch.integrations.nnunet_step import plan_step_spec
from bigbatch.memory.budget import format_bytes
from bigbatch.memory.plan import (
    Plan,
    plan_under_budget,
    refit_to_measured,
    resolve_budget,
)
from bigbatch.memory.step import Precision, StepSpec

require("nnunetv2", "nnunet")
from nnunetv2.training.nnUNetTrainer.nnUNetTrainer import nnUNetTrainer  # noqa: E402

from bigbatch.integrations.nnunet_planner import (  # noqa: E402
    largest_fitting_batch,
    nnUNetPlannerBigBatch,
)
from bigbatch.integrations.nnunet_predict import (  # noqa: E402
    plan_tiles,
    predict_folds,
    predictor_class,
)

__all__ = [
    "BUDGET_ENV",
    "MICRO_BATCH_ENV",
    "batch_dice_cache_bytes",
    "check_exact_loss",
    "ignore_label_shares",
    "largest_fitting_batch",
    "load_own_checkpoint",
    "load_pretrained",
    "nnUNetPlannerBigBatch",
    "nnUNetTrainerBigBatch",
    "plan_configuration",
    "plan_dataset",
    "plan_step_spec",
    "plan_tiles",
    "predict_folds",
    "predictor_class",
    "split_sizes",
    "trainer_for",
    "write_example_dataset",
]

# How ``nnUNetv2_train``-style construction (which passes no extra arguments) is told the budget.
BUDGET_ENV = "BIGBATCH_BUDGET"
MICRO_BATCH_ENV = "BIGBATCH_MICRO_BATCH"
LOG_ENV = "BIGBATCH_LOG"  # trackers, as bigbatch train's log= (tensorboard,wandb,mlflow)
CLIP_NORM = 12.0  # nnU-Net's gradient clipping
# The planned micro-batch is checked against the allocator's peak over optimizer steps 2 and 3:
# the first step's (cuDNN's benchmark trials, which nnU-Net turns on) is left out.
MEASURE_FROM_STEP, MEASURE_AT_STEP = 1, 3


def split_sizes(batch: int, micro_batch: int) -> list[int]:
    """The micro-batches' sizes of a batch (at most ``micro_batch`` each, in order)."""
    return [min(micro_batch, batch - start) for start in range(0, batch, micro_batch)]


class nnUNetTrainerBigBatch(nnUNetTrainer):
    """nnU-Net's trainer with exact micro-batches under a memory budget (module docstring).

    ``budget`` (``"auto"``: the device's free memory; ``"12GB"``; a card's name such as ``t4``)
    and ``micro_batch`` (0: planned) are attributes, set before training, or read from the
    environment (``BIGBATCH_BUDGET``, ``BIGBATCH_MICRO_BATCH``) where nnU-Net builds the trainer
    itself. Everything nnU-Net prints and writes stays nnU-Net's, plus one line with the
    micro-batch and the predicted peak. ``bigbatch nnunet train`` runs it (nnU-Net's own
    ``nnUNetv2_train`` looks for trainers only inside its package)::

        bigbatch nnunet train 987 3d_fullres 0 --budget 16GB
    """

    # nnU-Net reads this signature to re-create the trainer from a checkpoint: its own.
    def __init__(
        self,
        plans: dict,
        configuration: str,
        fold: int,
        dataset_json: dict,
        device: torch.device = torch.device("cuda"),  # noqa: B008 - nnU-Net's default
    ) -> None:
        super().__init__(plans, configuration, fold, dataset_json, device)
        self.budget = os.environ.get(BUDGET_ENV, "auto")
        self.micro_batch = int(os.environ.get(MICRO_BATCH_ENV, "0") or 0)
        self.log_to = os.environ.get(LOG_ENV, "none")
        self.trackers: Any = None  # bigbatch.trackers.Trackers, on rank 0 with log_to
        self.window_log: Any = None
        self.plan: Plan | None = None
        self.memory_checked = False  # the planned micro-batch checked against the measured peak
        self.backoff: OOMBackoff | None = None
        self.accumulator: Accumulator | None = None

    # -- set-up ----------------------------------------------------------------------------

    def on_train_start(self) -> None:
        # Refused before nnU-Net's own start, which launches its data workers: their tracebacks
        # would bury the one line that says why.
        if not self.was_initialized:
            self.initialize()  # as nnU-Net's start does first: its loss, to check before them
        check_exact_loss(self)
        super().on_train_start()
        micro, line = self._choose_micro_batch()
        if self.plan is not None:
            reset_peak_memory(self.device)  # the training's peak, for check_memory
        self.backoff = OOMBackoff(micro_batch=micro, max_micro_batch=micro, grow_after=0)
        self.accumulator = Accumulator(
            self.optimizer, scaler=self.grad_scaler, clip_grad_norm=CLIP_NORM
        )
        self.print_to_log_file(line)
        self._open_trackers(micro)

    def _open_trackers(self, micro: int) -> None:
        """``log_to``'s trackers in the fold's folder (continued when training continues):
        nnU-Net's settings and the plan as parameters."""
        from bigbatch.trackers import WindowLog, open_trackers, parse_trackers

        names = parse_trackers(self.log_to)
        if not names or self.local_rank != 0:
            return
        name = f"{self.plans_manager.dataset_name}-{self.configuration_name}-fold{self.fold}"
        self.trackers = open_trackers(
            names,
            self.output_folder,
            run_name=name,
            resume=self.current_epoch > 0,
            log=self.print_to_log_file,
        )
        if self.current_epoch == 0:
            params: dict[str, Any] = {
                "configuration": self.configuration_name,
                "fold": self.fold,
                "batch_size": int(self.batch_size),
                "micro_batch": micro,
                "patch_size": list(self.configuration_manager.patch_size),
                "num_epochs": self.num_epochs,
                "budget": self.budget,
                "iterations_per_epoch": self.num_iterations_per_epoch,
            }
            if self.plan is not None:
                params["plan"] = self.plan.to_dict()
            self.trackers.log_params(params)

        def send(metrics: dict[str, float], step: int) -> None:
            self.trackers.log_metrics({f"train/{k}": v for k, v in metrics.items()}, step)

        self.window_log = WindowLog(send, every=10)

    def on_epoch_end(self) -> None:
        """nnU-Net's epoch end, then the epoch's losses and pseudo Dice to the trackers."""
        epoch, logger = self.current_epoch, self.logger
        super().on_epoch_end()
        if self.trackers is None or self.accumulator is None or self.window_log is None:
            return
        self.window_log.flush()
        values = {"epoch": epoch + 1}
        for key in ("train_losses", "val_losses", "mean_fg_dice", "ema_fg_dice", "lrs"):
            with contextlib.suppress(Exception):  # a key nnU-Net has not logged this epoch
                values[key] = float(logger.get_value(key, step=-1))
        values["samples_seen"] = self.window_log.samples_seen
        self.trackers.log_metrics(values, self.accumulator.optimizer_step)

    def on_train_end(self) -> None:
        super().on_train_end()
        if self.trackers is not None:
            folder = Path(self.output_folder)
            for name in ("progress.png", "checkpoint_final.pth"):
                self.trackers.log_artifact(folder / name)
            self.trackers.close()
            self.trackers = None

    def _choose_micro_batch(self) -> tuple[int, str]:
        batch = int(self.batch_size)
        if self.micro_batch:
            micro = min(self.micro_batch, batch)
            return micro, f"bigbatch: batch {batch} in micro-batches of {micro} (fixed)"
        from bigbatch.memory.plan import DoesNotFitError

        try:
            self.plan = plan_configuration(self, self.budget)
        except DoesNotFitError as exc:
            raise ValueError(does_not_fit(self, self.budget, exc.floor.planning_bytes)) from None
        micro = self.plan.micro_batch
        if self.budget.strip().lower() != "auto":
            cap_cuda_allocator(self.device, self.plan.budget_bytes - self.plan.overhead_bytes)
        return micro, (
            f"bigbatch: batch {batch} in micro-batches of {micro}, predicted peak "
            f"{format_bytes(self.plan.predicted_peak_bytes)} of {format_bytes(self.plan.usable_bytes)} "
            f"usable (budget {self.budget})"
        )

    def save_checkpoint(self, filename: str) -> None:
        """nnU-Net's checkpoint, naming nnU-Net's own ``nnUNetTrainer`` as its trainer class:
        ``nnUNetv2_predict`` (and what builds on it: ``nnUNetv2_find_best_configuration``,
        ``nnUNetv2_ensemble``) rebuilds the network from the class a checkpoint names, and looks
        for it only inside nnunetv2's own package. This trainer's network is that class's, so
        the fold predicts the same; the class that trained it is kept as ``bigbatch_trainer``."""
        super().save_checkpoint(filename)
        if self.local_rank != 0 or self.disable_checkpointing or not os.path.isfile(filename):
            return
        with torch.serialization.safe_globals(_checkpoint_types()):
            checkpoint = torch.load(filename, map_location="cpu", weights_only=True)
        checkpoint["bigbatch_trainer"] = checkpoint.get("trainer_name", type(self).__name__)
        checkpoint["trainer_name"] = nnUNetTrainer.__name__
        partial = f"{filename}.partial"
        torch.save(checkpoint, partial)
        os.replace(partial, filename)  # whole or not at all

    # -- the step --------------------------------------------------------------------------

    def train_step(self, batch: dict) -> dict:
        """nnU-Net's step on the whole batch, in micro-batches: one optimizer step, the same
        update (clipped at 12, fp16 loss scaling on CUDA), the batch's mean loss back."""
        if self.accumulator is None or self.backoff is None:
            raise RuntimeError("train_step before on_train_start: run the trainer's run_training()")
        data = batch["data"].to(self.device, non_blocking=True)
        target = batch["target"]
        if isinstance(target, list):
            target = [t.to(self.device, non_blocking=True) for t in target]
        else:
            target = target.to(self.device, non_blocking=True)
        self.optimizer.zero_grad(set_to_none=True)
        precision = "fp16" if self.grad_scaler is not None else "fp32"
        if self.configuration_manager.batch_dice:
            result = run_coupled_window(
                self.accumulator,
                (data, target),
                cast(
                    Any, lambda x: _as_tuple(self._forward(x, precision))
                ),  # towers: each DS output
                lambda *outs: self._loss_of(list(outs[:-1]), outs[-1], precision),
                self.backoff,
                device=self.device,
                model=self.network,
            )
        else:
            ignored = ignore_label_shares(self.loss, self.label_manager.ignore_label, target)

            def step(micro: Any) -> tuple[torch.Tensor, int]:
                x, y = micro
                output = self._forward(x, precision)
                if ignored is not None:
                    with autocast_for(precision, self.device.type):
                        return ignored(output, y), batch_len(x)
                return self._loss_of(output, y, precision), batch_len(x)

            result = run_window(
                self.accumulator,
                (data, target),
                step,
                self.backoff,
                device=self.device,
                model=self.network,
            )
        if self.window_log is not None:
            self.window_log.add(
                result, samples=batch_len(data), extra={"lr": self.optimizer.param_groups[0]["lr"]}
            )
        self.check_memory()
        return {"loss": np.array(result.loss)}

    def check_memory(self) -> None:
        """After the first optimizer steps, a planned micro-batch on a GPU is refitted to the
        allocator's measured peak as ``bigbatch train`` refits its own
        (:func:`~bigbatch.memory.plan.refit_to_measured`): smaller, before an out-of-memory
        error, where the step takes more than the plan said (or than the card has left beside
        NCCL), up to twice as large where it takes far less. The update is unchanged. Ranks
        take the largest peak, so that they agree. Nothing on a CPU, whose resident memory is
        the process's, not the step's."""
        checked = self.memory_checked
        if checked or self.plan is None or self.backoff is None or self.accumulator is None:
            return
        step = self.accumulator.optimizer_step
        if step == MEASURE_FROM_STEP and torch.backends.cudnn.benchmark:
            reset_peak_memory(self.device)
        if step < MEASURE_AT_STEP:
            return
        self.memory_checked = True
        measured = peak_memory_bytes(self.device)
        if measured is None or measured[1]:
            return  # a process's resident memory, not the step's
        # Every rank reaches the same collectives, one whose OOM back-off refitted already too.
        card = card_memory(self.device)
        agreed = [measured[0], card[1] if card else 0, len(self.backoff.events)]
        peak, outside, backoffs = maxima_over_ranks(agreed, self.device)
        card = None if card is None else (card[0], outside)
        if backoffs:
            return  # the OOM back-off has had its say
        micro, batch = self.backoff.micro_batch, int(self.batch_size)
        new = refit_to_measured(self.plan, micro, peak, card, target=batch)
        predicted = dict(self.plan.curve).get(micro, self.plan.predicted_peak_bytes)
        self.print_to_log_file(
            f"bigbatch: measured {format_bytes(peak)} at micro-batch {micro} after {step} "
            f"steps (predicted {format_bytes(predicted)}): "
            + (f"micro-batch {micro} -> {new}" if new != micro else "kept")
        )
        self.backoff.refit(step, new)

    def _forward(self, x: torch.Tensor, precision: str) -> Any:
        with autocast_for(precision, self.device.type):
            return self.network(x)

    def _loss_of(self, output: Any, target: Any, precision: str) -> torch.Tensor:
        with autocast_for(precision, self.device.type):
            if not self.enable_deep_supervision and isinstance(output, list | tuple):
                output = output[0]
            return self.loss(output, target)


def _compound(loss: nn.Module) -> tuple[tuple[float, ...], Any] | None:
    """nnU-Net's DC+CE (softmax) or DC+BCE (regions) loss and its deep supervision weights
    (one output: weight 1), or None for another loss."""
    from nnunetv2.training.loss.compound_losses import DC_and_BCE_loss, DC_and_CE_loss
    from nnunetv2.training.loss.deep_supervision import DeepSupervisionWrapper

    weights: tuple[float, ...] = (1.0,)
    inner = loss
    if isinstance(loss, DeepSupervisionWrapper):
        weights, inner = tuple(loss.weight_factors), loss.loss
    return (weights, inner) if isinstance(inner, DC_and_CE_loss | DC_and_BCE_loss) else None


def check_exact_loss(trainer: nnUNetTrainer) -> None:
    """Refuse, once the trainer has built its loss, an ignore label under a loss bigbatch does
    not weigh (a trainer of one's own whose loss is not nnU-Net's DC+CE or DC+BCE) without
    batch Dice, which would be trained with each micro-batch weighed by its samples alone:
    inexactly.

    >>> from types import SimpleNamespace
    >>> trainer = SimpleNamespace(label_manager=SimpleNamespace(ignore_label=3),
    ...     configuration_manager=SimpleNamespace(batch_dice=False), loss=nn.MSELoss())
    >>> check_exact_loss(trainer)
    Traceback (most recent call last):
    ...
    ValueError: this dataset has an ignore label and SimpleNamespace's loss (MSELoss) is not nnU-Net's DC_and_CE_loss or DC_and_BCE_loss, whose cross-entropy bigbatch weighs exactly over the voxels not ignored: build it with nnU-Net's _build_loss, or train with nnU-Net's own trainer (nnUNetv2_train)
    """
    if trainer.label_manager.ignore_label is None or trainer.configuration_manager.batch_dice:
        return
    if _compound(trainer.loss) is None:
        raise ValueError(
            f"this dataset has an ignore label and {type(trainer).__name__}'s loss "
            f"({type(trainer.loss).__name__}) is not nnU-Net's DC_and_CE_loss or "
            "DC_and_BCE_loss, whose cross-entropy bigbatch weighs exactly over the voxels not "
            "ignored: build it with nnU-Net's _build_loss, or train with nnU-Net's own trainer "
            "(nnUNetv2_train)"
        )


def _kept(inner: Any, target: torch.Tensor, ignore_label: int) -> torch.Tensor:
    """The voxels the loss does not ignore: labels other than the ignore label, or (regions,
    one-hot) where the last channel, the ignore label's, is off."""
    if hasattr(inner, "use_ignore_label"):  # DC_and_BCE_loss
        last = target[:, -1:]
        return ~last if target.dtype == torch.bool else (1 - last).bool()
    return target != ignore_label


def ignore_label_shares(
    loss: nn.Module, ignore_label: int | None, target: torch.Tensor | list[torch.Tensor]
) -> Callable[[Any, Any], torch.Tensor] | None:
    """nnU-Net's DC+CE loss, or DC+BCE for regions (deep supervision's outputs too), for the
    micro-batches of a batch with an ignore label, whose whole labels ``target`` are: each
    output's cross-entropy, a mean over the batch's voxels not ignored, is the micro-batch's
    sum over its own divided by the batch's count, over its share of the samples, so that
    micro-batches weighed by their samples sum to the batch's loss exactly; the Dice, masked,
    is a mean over samples already. None without an ignore label, or for another loss
    (refused by :func:`check_exact_loss`).

    >>> from nnunetv2.training.loss.compound_losses import DC_and_CE_loss
    >>> loss = DC_and_CE_loss({"batch_dice": False, "do_bg": False}, {}, ignore_label=2)
    >>> y = torch.tensor([[[0, 1, 2, 2]], [[1, 0, 1, 2]]]).float()  # 2 and 3 voxels labelled
    >>> g = torch.Generator().manual_seed(0)
    >>> logits = torch.randn(2, 2, 4, generator=g, requires_grad=True)
    >>> split = ignore_label_shares(loss, 2, y)
    >>> parts = [split(logits[i : i + 1], y[i : i + 1]) / 2 for i in range(2)]  # by samples
    >>> # nnU-Net's Dice sums in float32 whatever the inputs: equal to float32's round-off
    >>> bool(abs(sum(parts) - loss(logits, y)) <= 4 * torch.finfo(torch.float32).eps)
    True
    """
    if ignore_label is None:
        return None
    parts = _compound(loss)
    if parts is None:
        return None
    weights, inner = parts
    regions = hasattr(inner, "use_ignore_label")
    levels = target if isinstance(target, list | tuple) else [target]
    # Counted from the labels alone, before any forward pass: what the whole batch's
    # cross-entropy divides by at each output.
    counted = [_kept(inner, t, ignore_label).sum() for t in levels]
    samples = batch_len(levels[0])

    def micro_loss(output: Any, micro_target: Any) -> torch.Tensor:
        outputs = output if isinstance(output, list | tuple) else [output]
        targets = micro_target if isinstance(micro_target, list | tuple) else [micro_target]
        share = samples / batch_len(targets[0])
        total: Any = 0
        # In nnU-Net's order (DeepSupervisionWrapper, then the loss's forward), so that the
        # one-micro-batch window is nnU-Net's own loss to the last bit.
        for weight, out, tgt, whole in zip(weights, outputs, targets, counted, strict=False):
            if weight == 0.0:
                continue
            mask = _kept(inner, tgt, ignore_label)
            if regions:
                dc = inner.dc(out, tgt[:, :-1], loss_mask=mask)
                summed = (inner.ce(out, tgt[:, :-1].float()) * mask).sum()
                ce = summed / torch.clip(whole, min=1e-8) * share  # the batch's own divisor
            else:
                kept = mask.sum()
                dc = 0
                if inner.weight_dice != 0:
                    dc = inner.dc(out, torch.where(mask, tgt, 0), loss_mask=mask)
                ce = 0
                if inner.weight_ce != 0 and kept > 0:
                    mean = inner.ce(out, tgt[:, 0])  # over this micro-batch's voxels kept
                    ce = mean * (kept.to(mean.dtype) / whole.to(mean.dtype) * share)
            total = total + weight * (inner.weight_ce * ce + inner.weight_dice * dc)
        return cast(torch.Tensor, total)

    return micro_loss


def does_not_fit(trainer: nnUNetTrainer, budget: str, floor_bytes: int) -> str:
    """What to do when even one sample of this plan does not fit, with the fixes the nnU-Net
    commands have (not bigbatch train's keys)."""
    patch = "x".join(str(int(p)) for p in trainer.configuration_manager.patch_size)
    return (
        f"nnU-Net's step for {trainer.configuration_name} (patch {patch}) needs "
        f"{format_bytes(floor_bytes)} at one sample, more than --budget {budget} leaves: give a "
        "larger --budget (a bigger card), or train a configuration or plans with a smaller "
        "patch (bigbatch nnunet plan DATASET --budget B lists them; nnUNetv2_plan_experiment "
        "-gpu_memory_target makes smaller ones)"
    )


def _checkpoint_types() -> list[Any]:
    """What an nnU-Net checkpoint holds besides tensors and Python's own values: numpy's
    scalars and dtypes (its EMA of the Dice, its logs). Allowed to ``torch.load`` by name, so
    that the file is still read with ``weights_only=True``: nothing else is unpickled."""
    multiarray = getattr(np, "_core", None) or np.core  # numpy 2, numpy 1
    dtypes = [getattr(np.dtypes, n) for n in dir(np.dtypes) if n.endswith("DType")]
    return [multiarray.multiarray.scalar, np.dtype, *dtypes]


@contextlib.contextmanager
def _results_elsewhere() -> Any:
    """nnU-Net's trainer makes its fold's folder and log file in ``nnUNet_results`` when it is
    built; a trainer built only to plan leaves nothing there (a temporary folder instead)."""
    import tempfile

    import nnunetv2.training.nnUNetTrainer.nnUNetTrainer as trainer_module

    real = trainer_module.nnUNet_results
    with tempfile.TemporaryDirectory(prefix="bigbatch-nnunet-plan-") as scratch:
        trainer_module.nnUNet_results = scratch
        try:
            yield
        finally:
            trainer_module.nnUNet_results = real


def _as_tuple(output: Any) -> tuple[torch.Tensor, ...]:
    """Deep supervision's outputs (a list, highest resolution first) as gradient caching's towers."""
    return tuple(output) if isinstance(output, list | tuple) else (output,)


def plan_configuration(trainer: nnUNetTrainer, budget: str | int, device: str = "") -> Plan:
    """The micro-batch of ``trainer``'s plan (network, patch, batch size, deep supervision, its
    loss) that fits ``budget`` on ``device`` (default: the trainer's), predicted on fake
    tensors: nnU-Net's own training step, with SGD's momentum as its optimizer keeps it. For
    a trainer nnU-Net built (``trainer.initialize()`` not needed)::

        plan = plan_configuration(trainer, "24GB", "cuda")
        print(plan.summary())  # micro-batch x accumulation for the plan's batch size
    """
    device = device or trainer.device.type
    spec_at = _spec_at(trainer, device)
    usable_budget = resolve_budget(budget, device)
    batch = int(trainer.batch_size)
    plan = plan_under_budget(
        spec_at, batch, usable_budget, device=device, calibrate=device == "cpu"
    )
    if not trainer.configuration_manager.batch_dice or plan.micro_batch >= batch:
        return plan  # not split: the batch's own step, nothing cached
    # Split, a batch Dice goes through gradient caching, which holds the whole batch's
    # outputs, their gradients and the loss's activations beside each micro-batch's step.
    precision: Precision = "fp16" if device_kind(device).dedicated_memory else "fp32"
    held = batch_dice_cache_bytes(trainer, batch, precision)
    return plan_under_budget(
        spec_at,
        batch,
        usable_budget,
        device=device,
        calibrate=device == "cpu",
        extra_bytes=held,
    )


def batch_dice_cache_bytes(trainer: nnUNetTrainer, batch: int, precision: Precision) -> int:
    """What gradient caching holds for a batch-Dice plan split into micro-batches, besides each
    micro-batch's step: every deep-supervision output of the whole ``batch`` (16 bits under
    fp16 autocast), the copy nnU-Net's loss differentiates and their gradients, or, while the
    loss runs, its own activations at the whole batch: measured from real CPU runs of
    nnU-Net's loss at 2 and 4 samples, extrapolated (they grow with the samples)."""
    from bigbatch.memory.measure import profiled_peak
    from bigbatch.memory.window_cache import extrapolated_window_bytes

    patch = [int(p) for p in trainer.configuration_manager.patch_size]
    heads = int(trainer.label_manager.num_segmentation_heads)
    labels = max(2, len(trainer.label_manager.all_labels))
    scales = (
        trainer._get_deep_supervision_scales()
        if trainer.enable_deep_supervision
        else [[1.0] * len(patch)]
    )
    shapes = [[max(1, round(p * s)) for p, s in zip(patch, sc, strict=True)] for sc in scales]
    dtype = torch.float16 if precision == "fp16" else torch.float32
    element = torch.empty((), dtype=dtype).element_size()
    per_sample = sum(heads * int(np.prod(sh)) for sh in shapes) * element

    def loss_moment(n: int) -> int:
        outputs = [torch.zeros((n, heads, *sh), dtype=dtype) for sh in shapes]
        targets = [torch.randint(0, labels, (n, 1, *sh)).float() for sh in shapes]

        def run() -> None:
            local = [o.float().requires_grad_(True) for o in outputs]
            loss = trainer.loss(
                local if trainer.enable_deep_supervision else local[0],
                targets if trainer.enable_deep_supervision else targets[0],
            )
            loss.backward()

        return profiled_peak(run, alive_at_start=n * per_sample)

    return extrapolated_window_bytes(loss_moment, batch, per_sample)


def _spec_at(trainer: nnUNetTrainer, device: str) -> Callable[[int], StepSpec]:
    """nnU-Net's training step at micro-batch ``b``, for the planner."""
    cm = trainer.configuration_manager
    patch = tuple(int(p) for p in cm.patch_size)
    channels = int(trainer.num_input_channels)
    scales = trainer._get_deep_supervision_scales() if trainer.enable_deep_supervision else None
    net_args = (trainer.plans_manager, cm, channels, trainer.label_manager.num_segmentation_heads)
    loss = trainer.loss
    labels = max(2, len(trainer.label_manager.all_labels))
    deep = trainer.enable_deep_supervision
    # nnU-Net autocasts to fp16 on CUDA only (of the kinds bigbatch knows, the one with memory
    # of its own).
    precision: Precision = "fp16" if device_kind(device).dedicated_memory else "fp32"

    def build() -> nn.Module:
        return type(trainer).build_network_architecture(*net_args, deep)

    manager = trainer.label_manager
    # Regions' labels reach the loss one-hot, a bool channel a region and the ignore label's
    # last (nnU-Net's ConvertSegmentationToRegionsTransform); others as one float channel.
    one_hot = manager.num_segmentation_heads + (manager.ignore_label is not None)

    def labelled(b: int, shape: list[int], where: Any) -> torch.Tensor:
        if manager.has_regions:
            return torch.randint(0, 2, (b, one_hot, *shape), device=where).bool()
        return torch.randint(0, labels, (b, 1, *shape), device=where).float()

    def example(b: int, where: Any) -> tuple[torch.Tensor, Any]:
        x = torch.randn(b, channels, *patch, device=where)
        if scales is None:
            return x, labelled(b, list(patch), where)
        shapes = [[max(1, round(p * s)) for p, s in zip(patch, sc, strict=True)] for sc in scales]
        return x, [labelled(b, shape, where) for shape in shapes]

    def step(model: nn.Module, micro: Any) -> torch.Tensor:
        x, y = micro
        out = model(x)
        if not deep and isinstance(out, list | tuple):
            out = out[0]
        return loss(out, y)

    def spec_at(b: int) -> StepSpec:
        return StepSpec(
            build,
            (channels, *patch),
            b,
            "sgd_momentum",
            precision,
            device,
            step=step,
            batch=example,
        )

    return spec_at


def trainer_for(
    dataset: str | int,
    configuration: str,
    fold: int | str,
    *,
    plans_identifier: str = "nnUNetPlans",
    continue_training: bool = False,
    device: torch.device | None = None,
) -> nnUNetTrainerBigBatch:
    """:class:`nnUNetTrainerBigBatch` for a preprocessed dataset, as ``nnUNetv2_train DATASET
    CONFIGURATION FOLD`` builds nnU-Net's own trainer (its plans and ``dataset.json`` from
    ``nnUNet_preprocessed``)."""
    from batchgenerators.utilities.file_and_folder_operations import join, load_json
    from nnunetv2.paths import nnUNet_preprocessed
    from nnunetv2.utilities.dataset_name_id_conversion import maybe_convert_to_dataset_name

    if nnUNet_preprocessed is None:
        raise ValueError(
            "nnUNet_preprocessed is not set: export nnUNet_raw, nnUNet_preprocessed and "
            "nnUNet_results as nnU-Net's documentation says (setting_up_paths.md)"
        )
    name = dataset if isinstance(dataset, str) and dataset.startswith("Dataset") else int(dataset)
    folder = join(nnUNet_preprocessed, maybe_convert_to_dataset_name(name))
    plans = load_json(join(folder, plans_identifier + ".json"))
    plans["continue_training"] = continue_training
    dataset_json = load_json(join(folder, "dataset.json"))
    fold_value: Any = fold if fold == "all" else int(fold)
    return nnUNetTrainerBigBatch(
        plans=plans,
        configuration=configuration,
        fold=fold_value,
        dataset_json=dataset_json,
        device=device or torch.device("cuda"),
    )


def load_own_checkpoint(trainer: nnUNetTrainer, *, validation_only: bool = False) -> None:
    """``--c`` and ``--val``: the checkpoint nnU-Net wrote into this fold's own output folder
    (final, latest or best), as ``nnUNetv2_train`` finds it."""
    from nnunetv2.run.run_training import maybe_load_checkpoint

    maybe_load_checkpoint(trainer, not validation_only, validation_only)


def load_pretrained(trainer: nnUNetTrainer, path: str | os.PathLike[str]) -> int:
    """Start from the network weights in ``path`` (an nnU-Net checkpoint, or a plain state
    dict), read with ``weights_only=True``: a file handed to us is never unpickled. Every
    weight whose name and shape match is taken, the segmentation outputs excepted (another
    dataset's classes), as nnU-Net's ``-pretrained_weights`` does; returns how many."""
    if not trainer.was_initialized:
        trainer.initialize()
    try:
        with torch.serialization.safe_globals(_checkpoint_types()):
            saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ValueError(
            f"{path} cannot be read as weights only ({type(exc).__name__}: {str(exc)[:160]}): "
            "save its network weights alone, torch.save(checkpoint['network_weights'], path)"
        ) from exc
    weights = saved.get("network_weights", saved) if isinstance(saved, dict) else None
    if not isinstance(weights, dict):
        raise ValueError(
            f"{path} holds no state dict (nor an nnU-Net checkpoint's network_weights)"
        )
    own = trainer.network.state_dict()
    taken = {
        k: v
        for k, v in weights.items()
        if k in own and own[k].shape == v.shape and ".seg_layers." not in k
    }
    if not taken:
        raise ValueError(f"no weight in {path} matches this plan's network (names and shapes)")
    trainer.network.load_state_dict(taken, strict=False)
    trainer.print_to_log_file(f"bigbatch: {len(taken)} of {len(own)} weights from {path}")
    return len(taken)


def plan_dataset(dataset: str | int, budget: str, *, device: str = "cuda") -> list[dict[str, Any]]:
    """For each plans file of a preprocessed dataset (nnU-Net's default, the residual-encoder
    presets the user generated) and each of its configurations: the predicted peak of nnU-Net's
    training step on ``device`` at its batch size, and the micro-batch that fits ``budget``.
    Nothing runs on a device: the networks are built on the meta device. With
    ``nnUNet_preprocessed`` set and the dataset planned (``nnUNetv2_plan_and_preprocess``)::

        for row in plan_dataset(987, "16GB"):  # bigbatch nnunet plan 987 --budget 16GB
            print(row["configuration"], row["batch_size"], row["micro_batch"], row["fits"])
    """
    from batchgenerators.utilities.file_and_folder_operations import join, load_json
    from nnunetv2.paths import nnUNet_preprocessed
    from nnunetv2.utilities.dataset_name_id_conversion import maybe_convert_to_dataset_name
    from nnunetv2.utilities.label_handling.label_handling import determine_num_input_channels

    from bigbatch.memory.plan import DoesNotFitError

    if nnUNet_preprocessed is None:
        raise ValueError(
            "nnUNet_preprocessed is not set: export it as nnU-Net's documentation says"
        )
    name = dataset if isinstance(dataset, str) and dataset.startswith("Dataset") else int(dataset)
    folder = Path(join(nnUNet_preprocessed, maybe_convert_to_dataset_name(name)))
    plans_files = sorted(p for p in folder.glob("*Plans*.json"))
    if not plans_files:
        raise ValueError(f"{folder} holds no plans: run nnUNetv2_plan_and_preprocess first")
    rows = []
    for plans_file in plans_files:
        for configuration in load_json(str(plans_file))["configurations"]:
            # nnU-Net's banner is not the table; its trainer's folders are not to be made.
            with contextlib.redirect_stdout(sys.stderr), _results_elsewhere():
                trainer = trainer_for(
                    name,
                    configuration,
                    0,
                    plans_identifier=plans_file.stem,
                    device=torch.device("cpu"),
                )
            trainer._set_batch_size_and_oversample()
            trainer.num_input_channels = determine_num_input_channels(
                trainer.plans_manager, trainer.configuration_manager, trainer.dataset_json
            )
            trainer.loss = trainer._build_loss()
            row = {
                "plans": plans_file.stem,
                "configuration": configuration,
                "patch_size": [int(p) for p in trainer.configuration_manager.patch_size],
                "batch_size": int(trainer.batch_size),
            }
            try:
                plan = plan_configuration(trainer, budget, device)
            except DoesNotFitError as exc:
                rows.append(
                    row
                    | {
                        "micro_batch": 0,
                        "fits": False,
                        "predicted_peak_bytes": exc.floor.planning_bytes,
                        "predicted_peak": format_bytes(exc.floor.planning_bytes),
                    }
                )
                continue
            whole = dict(plan.curve).get(row["batch_size"])
            rows.append(
                row
                | {
                    "micro_batch": plan.micro_batch,
                    "fits": True,
                    "predicted_peak_bytes": plan.predicted_peak_bytes,
                    "predicted_peak": format_bytes(plan.predicted_peak_bytes),
                    "whole_batch_peak_bytes": whole,
                    "budget_bytes": plan.budget_bytes,
                }
            )
    return rows


def write_example_dataset(
    raw_root: str | os.PathLike[str], dataset_id: int = 987, *, cases: int = 5, side: int = 16
) -> Path:
    """A tiny dataset in nnU-Net's raw format under ``raw_root`` (``DatasetXXX_Example``):
    ``cases`` volumes of ``side``^3 voxels, one MRI-like channel, labels 0/1/2 (two nested
    blobs), ``dataset.json``; what nnU-Net's planning, preprocessing and a short training take
    in seconds on a CPU. Five cases or more: nnU-Net splits them into five folds.

    >>> import tempfile
    >>> write_example_dataset(tempfile.mkdtemp(), 987, cases=5, side=8).name
    'Dataset987_Example'
    """
    import json

    import nibabel as nib

    folder = Path(raw_root) / f"Dataset{dataset_id:03d}_Example"
    (folder / "imagesTr").mkdir(parents=True, exist_ok=True)
    (folder / "labelsTr").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    grid = np.stack(np.meshgrid(*[np.arange(side)] * 3, indexing="ij"))
    for i in range(cases):
        centre = rng.uniform(side * 0.35, side * 0.65, size=3)[:, None, None, None]
        dist = np.sqrt(((grid - centre) ** 2).sum(0))
        label = (dist < side * 0.3).astype(np.uint8) + (dist < side * 0.15).astype(np.uint8)
        image = (label + rng.normal(0, 0.3, label.shape)).astype(np.float32)
        nib.save(
            nib.Nifti1Image(image, np.eye(4)), folder / "imagesTr" / f"case_{i:03d}_0000.nii.gz"
        )
        nib.save(nib.Nifti1Image(label, np.eye(4)), folder / "labelsTr" / f"case_{i:03d}.nii.gz")
    dataset = {
        "channel_names": {"0": "MRI"},
        "labels": {"background": 0, "outer": 1, "inner": 2},
        "numTraining": cases,
        "file_ending": ".nii.gz",
    }
    (folder / "dataset.json").write_text(json.dumps(dataset, indent=1))
    return folder
