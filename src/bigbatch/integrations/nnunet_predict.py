"""nnU-Net's prediction with the sliding window's patches batched under a memory budget:
``bigbatch nnunet predict`` (:func:`predict_folds`) runs nnU-Net's own predictor on the folds
``nnUNetTrainerBigBatch`` trained, with :func:`plan_tiles` patches a forward pass."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from bigbatch.device import device_kind
from bigbatch.integrations import require
from bigbatch.memory.budget import format_bytes
from bigbatch.memory.plan import resolve_budget
from bigbatch.memory.step import Precision, StepSpec

require("nnunetv2", "nnunet")
from nnunetv2.training.nnUNetTrainer.nnUNetTrainer import nnUNetTrainer  # noqa: E402

__all__ = ["plan_tiles", "predict_folds", "predictor_class"]


def predictor_class() -> type:
    """:class:`nnUNetPredictorBigBatch`, made on first use (nnU-Net's predictor module imports
    its data iterators and exporters: not needed to train)."""
    global _PREDICTOR
    if _PREDICTOR is None:
        _PREDICTOR = _make_predictor_class()
    return _PREDICTOR


_PREDICTOR: type | None = None


def _make_predictor_class() -> type:
    from nnunetv2.inference.predict_from_raw_data import nnUNetPredictor
    from nnunetv2.inference.sliding_window_prediction import compute_gaussian

    from bigbatch.backoff import EvalBackoff, infer_fitting

    class nnUNetPredictorBigBatch(nnUNetPredictor):
        """nnU-Net's predictor (its preprocessing, tiling, Gaussian weighting, mirroring,
        fold averaging and export), whose sliding window runs ``tiles`` patches in one
        forward pass instead of one: planned under a memory budget, and halved on an
        out-of-memory error (:class:`~bigbatch.backoff.EvalBackoff`), down to one patch,
        before nnU-Net's own fallback (the whole volume's results on the CPU). In eval mode
        each patch's output is its own, so the prediction is nnU-Net's (up to the kernels'
        round-off at another batch size, below the float16 it accumulates in)."""

        def __init__(self, *args: Any, tiles: int = 1, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.tiles = max(1, int(tiles))
            self.backoff = EvalBackoff(chunk=self.tiles)

        def _internal_predict_sliding_window_return_logits(
            self, data: torch.Tensor, slicers: Any, do_on_device: bool = True
        ) -> torch.Tensor:
            results_device = self.device if do_on_device else torch.device("cpu")
            data = data.to(results_device)
            heads = self.label_manager.num_segmentation_heads
            logits = torch.zeros((heads, *data.shape[1:]), dtype=torch.half, device=results_device)
            counts = torch.zeros(data.shape[1:], dtype=torch.half, device=results_device)
            gaussian: Any = 1
            if self.use_gaussian:
                gaussian = compute_gaussian(
                    tuple(self.configuration_manager.patch_size),
                    sigma_scale=1.0 / 8,
                    value_scaling_factor=10,
                    device=results_device,
                )
            slicers = list(slicers)
            for start in range(0, len(slicers), self.tiles):
                group = slicers[start : start + self.tiles]
                batch = torch.stack([data[s] for s in group]).to(self.device)
                out = infer_fitting(self._internal_maybe_mirror_and_predict, batch, self.backoff)
                for s, tile in zip(group, out.to(results_device), strict=True):
                    logits[s] += tile * gaussian if self.use_gaussian else tile
                    counts[s[1:]] += gaussian
                del batch, out
            torch.div(logits, counts, out=logits)
            if torch.any(torch.isinf(logits)):
                raise RuntimeError(
                    "inf in the predicted logits (float16 sums): predict with nnU-Net's own "
                    "predictor, whose arrays are the same, to see whether it is the model's"
                )
            return logits

    return nnUNetPredictorBigBatch


def plan_tiles(predictor: Any, budget: str, *, largest: int = 64) -> tuple[int, str]:
    """The most patches one forward pass of ``predictor``'s sliding window may take under
    ``budget`` on its device: nnU-Net's network in eval mode without gradients (fp16 on CUDA, as
    nnU-Net autocasts there), beside the weights and, where nnU-Net keeps them on the device,
    the median volume's input, logits and counts; and the line that says so. 1 where even one
    patch is predicted over (the back-off and nnU-Net's CPU fallback then guard it). With an
    ``nnUNetPredictor`` initialised from a trained model folder::

        tiles, line = plan_tiles(predictor, "16GB")  # what `bigbatch nnunet predict` does
    """
    from nnunetv2.utilities.label_handling.label_handling import determine_num_input_channels

    from bigbatch.memory.evaluate import plan_evaluation_batch, predict_evaluation_peak
    from bigbatch.memory.plan import default_overhead, usable_bytes

    pm, cm = predictor.plans_manager, predictor.configuration_manager
    device = predictor.device.type
    patch = tuple(int(p) for p in cm.patch_size)
    channels = int(determine_num_input_channels(pm, cm, predictor.dataset_json))
    heads = int(predictor.label_manager.num_segmentation_heads)
    median = [int(v) for v in cm.median_image_size_in_voxels]
    volume = int(np.prod([max(m, p) for m, p in zip(median, patch, strict=True)]))
    on_device = predictor.perform_everything_on_device and device != "cpu"
    held = volume * (channels * 4 + heads * 2 + 2) if on_device else 0
    precision: Precision = "fp16" if device_kind(device).dedicated_memory else "fp32"
    usable = usable_bytes(resolve_budget(budget, device), default_overhead(budget, device), device)

    def build() -> nn.Module:
        return nnUNetTrainer.build_network_architecture(pm, cm, channels, heads, False)

    def peak(k: int) -> int:
        spec = StepSpec(build, (channels, *patch), k, "sgd", precision, device)
        return predict_evaluation_peak(spec, state_copies=0, held_bytes=held).planning_bytes

    plan = plan_evaluation_batch(peak, largest, usable, (channels, *patch))
    size = "x".join(map(str, patch))
    line = (
        f"bigbatch: {plan.batch} patch(es) of {size} a forward pass, predicted peak "
        f"{format_bytes(plan.predicted_peak_bytes)} of {format_bytes(usable)} usable "
        f"(budget {budget})"
    )
    return plan.batch, line


def predict_folds(
    dataset: str | int,
    configuration: str,
    inputs: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    folds: tuple[int | str, ...] = (0,),
    plans_identifier: str = "nnUNetPlans",
    checkpoint: str = "checkpoint_final.pth",
    budget: str = "auto",
    device: str = "cuda",
    tiles: int = 0,
    step_size: float = 0.5,
    mirroring: bool = True,
    save_probabilities: bool = False,
    log: Callable[[str], None] = print,
) -> Path:
    """``bigbatch nnunet predict``: the folds ``nnUNetTrainerBigBatch`` trained predict the
    images in ``inputs`` (nnU-Net's raw layout, ``CASE_0000.nii.gz`` ...) into ``output``, as
    ``nnUNetv2_predict -tr nnUNetTrainerBigBatch`` would, with ``tiles`` patches a forward pass
    (0: planned under ``budget``); returns the output folder. With ``nnUNet_results`` set::

        predict_folds(987, "3d_fullres", "imagesTs", "predictions", folds=(0, 1), budget="16GB")
    """
    from nnunetv2.utilities.file_path_utilities import get_output_folder

    if step_size <= 0 or step_size > 1:
        raise ValueError(f"--step-size is a fraction of the patch in (0, 1], got {step_size}")
    if tiles < 0:
        raise ValueError(f"--tiles is a number of patches >= 1 (0: planned), got {tiles}")
    # The trainer's class name, as nnU-Net names its output folder (the trainer's module is not
    # imported to predict).
    folder = get_output_folder(dataset, "nnUNetTrainerBigBatch", plans_identifier, configuration)
    missing = [
        f for f in folds if not os.path.isfile(os.path.join(folder, f"fold_{f}", checkpoint))
    ]
    if missing:
        raise ValueError(
            f"{folder}/fold_{missing[0]}/{checkpoint} does not exist: train that fold first "
            "(bigbatch nnunet train), or name the folds there with --folds"
        )
    if not os.path.isdir(inputs):
        raise ValueError(f"{inputs} is not a folder of images in nnU-Net's raw layout")
    predictor = predictor_class()(
        tile_step_size=step_size,
        use_mirroring=mirroring,
        perform_everything_on_device=device.startswith("cuda"),
        device=torch.device(device),
        allow_tqdm=False,
    )
    with contextlib.redirect_stdout(sys.stderr):
        predictor.initialize_from_trained_model_folder(folder, folds, checkpoint)
    if tiles:
        predictor.tiles, line = tiles, f"bigbatch: {tiles} patch(es) a forward pass (fixed)"
    else:
        predictor.tiles, line = plan_tiles(predictor, budget)
    predictor.backoff.chunk = predictor.tiles
    log(line)
    predictor.predict_from_files(
        str(inputs),
        str(output),
        save_probabilities=save_probabilities,
        num_processes_preprocessing=1,
        num_processes_segmentation_export=1,
    )
    return Path(output)
