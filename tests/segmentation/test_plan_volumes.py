"""Planning for 3D volumes: micro-batch x accumulation, and the remedies when one volume does
not fit."""

from __future__ import annotations

import pytest

from bigbatch.memory.plan import DoesNotFitError, plan_micro_batch
from bigbatch.memory.step import StepSpec
from bigbatch.segmentation.models import unet3d


def spec_at(b: int) -> StepSpec:
    return StepSpec(lambda: unet3d(width=4, depth=2), (4, 32, 32, 32), b)


@pytest.mark.slow
def test_plan_splits_a_batch_of_volumes() -> None:
    floor = plan_micro_batch(spec_at, 8, "4GB", overhead=0).floor_bytes
    plan = plan_micro_batch(spec_at, 8, int(floor * 3.5), overhead=0)
    assert 1 < plan.micro_batch < 8
    assert plan.micro_batch * plan.micro_batches >= 8
    assert plan.predicted_peak_bytes <= plan.usable_bytes


@pytest.mark.slow
def test_one_volume_too_big_names_the_remedies() -> None:
    floor = plan_micro_batch(spec_at, 8, "4GB", overhead=0).floor_bytes
    with pytest.raises(DoesNotFitError, match="smaller patches") as err:
        plan_micro_batch(spec_at, 8, floor // 2, overhead=0)
    assert "bf16" in str(err.value) and "activation checkpointing" in str(err.value)
