"""nnU-Net's experiment planner with bigbatch's prediction of the training step as its memory
estimate (:class:`nnUNetPlannerBigBatch`), and the batch search it asks for
(:func:`largest_fitting_batch`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

from bigbatch.integrations import require
from bigbatch.integrations.nnunet_step import plan_step_spec
from bigbatch.memory.plan import _interpolate, largest_fitting

require("nnunetv2", "nnunet")
from nnunetv2.experiment_planning.experiment_planners.default_experiment_planner import (  # noqa: E402
    ExperimentPlanner,
)

__all__ = ["largest_fitting_batch", "nnUNetPlannerBigBatch"]


def largest_fitting_batch(peak_at: Callable[[int], int], usable: int, most: int = 4096) -> int:
    """The largest batch whose predicted peak (``peak_at(batch)``) is within ``usable``: each
    candidate is where the line through the last two batches that fit reaches ``usable`` (at
    most eight times the last; twice where that line does not rise), predicted, until one does
    not fit; then the planner's own search between the last that fit and it. Extrapolation
    only proposes: the answer is always a predicted batch, and so is the next one up that does
    not fit (per-sample memory at batch 1 to 2 is not that at large batches: 0.57x for a 2d
    plan, whose batch extrapolated from them was predicted 66 % over). A handful of
    predictions where doubling took a dozen: nnU-Net asks for one per patch it considers. 0
    where one sample does not fit; 1 where two do not (nnU-Net then shrinks the patch, without
    a search).

    >>> largest_fitting_batch(lambda b: 1000 + 300 * b + 5 * b * b, 20_000)  # 19,620 at 38
    38
    """
    peak = functools.cache(peak_at)  # the search asks for the sizes seen here again
    if peak(1) > usable:
        return 0
    if peak(2) > usable:
        return 1
    before, low = 1, 2  # the last two batches that fit
    while True:
        rises = peak(low) > peak(before)
        line = _interpolate(before, peak(before), low, peak(low), usable) if rises else 2 * low
        # A line from small batches may reach far past a rising curve: eight times at most.
        high = min(max(line, low + 1), 8 * low)
        if high >= most:
            if peak(most) <= usable:
                return most
            high = most
        if peak(high) > usable:
            return largest_fitting(peak, low, high, usable)
        before, low = low, high


class nnUNetPlannerBigBatch(ExperimentPlanner):
    """nnU-Net's default planner, whose memory estimate is bigbatch's prediction of nnU-Net's
    training step on a CUDA card (fp16, SGD with momentum, deep supervision, DC+CE) instead of
    the feature-map proxy: a plan for ``gpu_memory_target_in_gb`` uses what that card holds,
    less the CUDA context and the plan's margin. Its plans are ``nnUNetBigBatchPlans``.

    Dataset 4 planned for a 12 GB card::

        plan_experiment_dataset(4, nnUNetPlannerBigBatch, 12)
    """

    def __init__(
        self,
        dataset_name_or_id: str | int,
        gpu_memory_target_in_gb: float = 8,
        preprocessor_name: str = "DefaultPreprocessor",
        plans_name: str = "nnUNetBigBatchPlans",
        overwrite_target_spacing: Any = None,
        suppress_transpose: bool = False,
    ) -> None:
        super().__init__(
            dataset_name_or_id,
            gpu_memory_target_in_gb,
            preprocessor_name,
            plans_name,
            overwrite_target_spacing,
            suppress_transpose,
        )
        from bigbatch.memory.cuda_runtime import CUDA_CONTEXT_BYTES
        from bigbatch.memory.plan import usable_bytes

        self.usable = usable_bytes(int(gpu_memory_target_in_gb * 1e9), CUDA_CONTEXT_BYTES, "cuda")
        # nnU-Net's reference value for the target, as its own rules scale it: the usable bytes.
        scaled = self.usable * self.UNet_reference_val_corresp_GB / self.UNet_vram_target_GB
        self.UNet_reference_val_3d = self.UNet_reference_val_2d = scaled

    # nnU-Net declares it a staticmethod and calls it through self: an instance's method here.
    def static_estimate_VRAM_usage(
        self,
        patch_size: tuple[int, ...],
        input_channels: int,
        output_channels: int,
        arch_class_name: str,
        arch_kwargs: dict,
        arch_kwargs_req_import: tuple[str, ...],
    ) -> float:
        from nnunetv2.utilities.get_network_from_plans import get_network_from_plans
        from nnunetv2.utilities.label_handling.label_handling import LabelManager

        from bigbatch.memory.predict import predict_peak

        # nnU-Net hands over a head per label, its ignore label's too; its trainer trains a
        # head per label but that one, or a sigmoid head per region (BraTS's), its loss DC+BCE
        # over their one-hot labels, and leaves out the ignored voxels.
        labels = LabelManager(
            self.dataset_json["labels"], self.dataset_json.get("regions_class_order")
        )
        heads = labels.num_segmentation_heads

        def build() -> nn.Module:
            return get_network_from_plans(
                arch_class_name,
                arch_kwargs,
                arch_kwargs_req_import,
                input_channels,
                heads,
                allow_init=False,
                deep_supervision=True,
            )

        spec = plan_step_spec(
            build,
            tuple(patch_size),
            input_channels,
            heads,
            arch_kwargs,
            regions=labels.has_regions,
            ignore_label=labels.has_ignore_label,
        )
        ref_bs = (
            self.UNet_reference_val_corresp_bs_2d
            if len(patch_size) == 2
            else self.UNet_reference_val_corresp_bs_3d
        )
        fits = largest_fitting_batch(
            lambda b: predict_peak(spec.with_batch(b)).planning_bytes, self.usable
        )
        # nnU-Net's rules then pick that batch (or shrink the patch while fewer than 2 fit).
        return ref_bs * self.usable / max(fits, 1e-3)
