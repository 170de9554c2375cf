"""nnU-Net scenarios, each in its own process: nnU-Net reads its folders from the environment
when it is first imported (``nnUNet_raw``, ``nnUNet_preprocessed``, ``nnUNet_results``).

``python nnunet_scenarios.py ROOT prepare``: a tiny raw dataset (a few 3D cases, two labels)
through nnU-Net's own fingerprinting, planning and preprocessing (and bigbatch's planner).
``... exact``: the trainer's update against nnU-Net's own batch update, in float64 (printed as
JSON). ``... memory``: nnU-Net's step predicted against its measured CPU peak.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

DATASET = "Dataset987_Example"


def _paths(root: Path) -> None:
    for name in ("raw", "preprocessed", "results"):
        (root / name).mkdir(parents=True, exist_ok=True)
        os.environ[f"nnUNet_{name}"] = str(root / name)


def prepare(root: Path) -> None:
    from bigbatch.integrations.nnunet import write_example_dataset

    write_example_dataset(root / "raw", 987)
    from nnunetv2.experiment_planning.plan_and_preprocess_api import (
        extract_fingerprints,
        plan_experiment_dataset,
        plan_experiments,
        preprocess,
    )

    from bigbatch.integrations.nnunet import nnUNetPlannerBigBatch

    extract_fingerprints(
        [987], num_processes=1, check_dataset_integrity=True, verbose=False, show_progress_bar=False
    )
    plan_experiments([987])
    preprocess(
        [987],
        configurations=("3d_fullres",),
        num_processes=(1,),
        verbose=False,
        show_progress_bar=False,
    )
    # bigbatch's planner beside nnU-Net's: its plans in the same folder (nnUNetBigBatchPlans).
    plan_experiment_dataset(987, nnUNetPlannerBigBatch, 8)


def _trainer(batch_dice: bool | None = None) -> object:
    import torch

    from bigbatch.integrations.nnunet import trainer_for

    trainer = trainer_for(DATASET, "3d_fullres", 0, device=torch.device("cpu"))
    if batch_dice is not None:
        trainer.configuration_manager.configuration["batch_dice"] = batch_dice
    return trainer


def _narrowed(trainer: Any) -> Any:
    """``trainer`` with nnU-Net's planned network a quarter as wide (8, 16, 32 features for its
    32, 64, 128): the same stages, deep supervision, norms and loss, whose update the
    micro-batches must give to 1e-12 at any width, at a sixteenth of float64's convolutions
    on a CPU (the exactness scenarios took 100 s at the planned width)."""
    kwargs = trainer.configuration_manager.configuration["architecture"]["arch_kwargs"]
    kwargs["features_per_stage"] = [f // 4 for f in kwargs["features_per_stage"]]
    return trainer


def _grad(p: Any) -> Any:
    """A parameter's gradient (zeros where the loss does not reach it: deep supervision's
    lowest output has weight 0)."""
    import torch

    return p.grad.clone() if p.grad is not None else torch.zeros_like(p)


def _gradients(trainer: Any, x: Any, y: list[Any], micro: int, naive: bool = False) -> list[Any]:
    """What the trainer's own train_step steps with (its optimizer's step kept), or with
    ``naive``, each micro-batch's mean weighed the same (``loss / N``); ``micro`` 0: nnU-Net's
    own, the whole batch through its loss."""
    import torch

    from bigbatch import Accumulator, OOMBackoff

    net = trainer.network
    net.zero_grad(set_to_none=True)
    if not micro:
        trainer.loss(net(x), y).backward()
        return [_grad(p) for p in net.parameters()]
    if naive:
        parts = list(
            zip(x.split(micro), zip(*[t.split(micro) for t in y], strict=True), strict=True)
        )
        for xm, ym in parts:
            (trainer.loss(net(xm), list(ym)) / len(parts)).backward()
        return [_grad(p) for p in net.parameters()]
    kept: list[Any] = []

    class Keep(torch.optim.SGD):
        def step(self, closure: Any = None) -> None:  # the batch's gradient, as stepped
            kept.extend(_grad(p) for p in net.parameters())

    trainer.optimizer = Keep(net.parameters(), lr=0.0)
    trainer.accumulator = Accumulator(trainer.optimizer)  # no clipping: the raw gradients
    trainer.backoff = OOMBackoff(micro_batch=micro, grow_after=0)
    trainer.train_step({"data": x, "target": y})
    return kept


def exact(root: Path) -> None:
    """The gradient the bigbatch trainer steps with, at micro-batches of 1 and 2 (uneven over
    3), against nnU-Net's own (the whole batch through its loss), in float64, with and without
    batch_dice; and ``loss / N``. Printed as JSON: the largest absolute differences."""

    out: dict[str, Any] = {}
    # As shipped (float32 Dice sums) once: the round-off comparison needs no second plan.
    for batch_dice, wide in ((False, True), (True, True), (False, False)):
        with _dice_in_float64() if wide else contextlib.nullcontext():
            out[
                ("batch_dice" if batch_dice else "sample_dice") + ("" if wide else "_float32_sums")
            ] = _exact_one(batch_dice, wide)
    with _dice_in_float64():  # clipping active: the unclipped gradients are compared above
        for batch_dice in (False, True):
            name = "batch_dice" if batch_dice else "sample_dice"
            out[f"steps_{name}"] = _steps_one(batch_dice, clipped=True)
        # An ignore label: the cross-entropy a mean over the voxels not ignored, which the
        # samples hold unevenly (a sparsely annotated dataset).
        for batch_dice in (False, True):
            name = "batch_dice" if batch_dice else "sample_dice"
            out[f"ignore_{name}"] = _exact_one(batch_dice, True, ignore=True)
        out["steps_ignore_sample_dice"] = _steps_one(False, clipped=True, ignore=True)
    print(json.dumps(out))


IGNORED = 3  # past the dataset's labels 0-2


def _with_ignore_label(trainer: Any) -> None:
    """The trainer's labels with an ignore label, as a dataset.json naming one gives them."""
    from nnunetv2.utilities.label_handling.label_handling import LabelManager

    labels = dict(trainer.dataset_json["labels"]) | {"ignore": IGNORED}
    trainer.dataset_json["labels"] = labels
    trainer.label_manager = LabelManager(labels, regions_class_order=None)


def _ignored_unevenly(y: list[Any]) -> list[Any]:
    """Labels with most of the first sample's voxels ignored, a tenth of the second's and
    half of the third's (at every deep supervision scale)."""
    import torch

    out = []
    for level in y:
        generator = torch.Generator().manual_seed(7)
        draws = torch.rand(level.shape, generator=generator, dtype=torch.float64)
        fractions = torch.tensor([0.8, 0.1, 0.5], dtype=torch.float64).view(-1, 1, 1, 1, 1)
        out.append(torch.where(draws < fractions, torch.full_like(level, IGNORED), level))
    return out


class _Scaled:
    """nnU-Net's loss times a factor: large enough, its gradient's norm passes nnU-Net's clip
    at 12, so the steps are compared with clipping active."""

    def __init__(self, loss: Any, factor: float) -> None:
        self.loss, self.factor = loss, factor

    def __call__(self, *args: Any) -> Any:
        return self.loss(*args) * self.factor


def _steps_one(
    batch_dice: bool, clipped: bool, steps: int = 3, ignore: bool = False
) -> dict[str, Any]:
    """Several optimizer steps of nnU-Net's own optimizer (SGD, Nesterov momentum 0.99, weight
    decay 3e-5) and clipping at 12, from one state: nnU-Net's own ``train_step`` on each whole
    batch against the bigbatch trainer's at micro-batches of 1 and 2 (2 + 1), and ``loss / N``
    at 2, in float64. Every parameter after the steps, and which ones had no gradient (None,
    as nnU-Net leaves deep supervision's unused output), at each step."""
    import torch
    from nnunetv2.training.nnUNetTrainer.nnUNetTrainer import nnUNetTrainer

    import bigbatch.integrations.nnunet as nnunet
    from bigbatch import Accumulator, OOMBackoff
    from bigbatch.integrations.nnunet import CLIP_NORM

    trainer = _narrowed(_trainer(batch_dice))
    if ignore:
        _with_ignore_label(trainer)
    torch.manual_seed(0)
    trainer.initialize()
    trainer.network.double()
    loss = trainer._build_loss()
    if clipped and ignore:
        # Scaled through deep supervision's weights: still nnU-Net's own loss, which the
        # trainer weighs by the voxels kept (a wrapper around it would not be).
        loss.weight_factors = tuple(w * 1e4 for w in loss.weight_factors)
    trainer.loss = _Scaled(loss, 1e4) if clipped and not ignore else loss
    batches = []
    for k in range(steps):
        x, y = _random_batch(trainer, seed=100 + k)
        batches.append({"data": x, "target": _ignored_unevenly(y) if ignore else y})
    state = {k: v.clone() for k, v in trainer.network.state_dict().items()}
    net = trainer.network
    norms: list[float] = []

    def naive_step(batch: dict, micro: int) -> None:
        trainer.optimizer.zero_grad(set_to_none=True)
        xs = batch["data"].split(micro)
        ys = list(zip(*[t.split(micro) for t in batch["target"]], strict=True))
        for xm, ym in zip(xs, ys, strict=True):
            (trainer.loss(net(xm), list(ym)) / len(xs)).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP_NORM)
        trainer.optimizer.step()

    def run(micro: int, naive: bool = False) -> tuple[list[Any], list[list[bool]]]:
        net.load_state_dict(state)
        trainer.optimizer, _ = trainer.configure_optimizers()
        trainer.accumulator = Accumulator(trainer.optimizer, clip_grad_norm=CLIP_NORM)
        trainer.backoff = OOMBackoff(micro_batch=micro or 3, grow_after=0)
        missing: list[list[bool]] = []
        real_step = trainer.optimizer.step

        def step(*args: Any, **kwargs: Any) -> Any:  # which gradients are None, as stepped
            missing.append([p.grad is None for p in net.parameters()])
            return real_step(*args, **kwargs)

        trainer.optimizer.step = step
        for batch in batches:
            if naive:
                naive_step(batch, micro)
            elif micro:
                trainer.train_step(batch)
            else:
                nnUNetTrainer.train_step(trainer, batch)  # nnU-Net's own step
                norms.append(
                    float(
                        torch.norm(
                            torch.stack(
                                [p.grad.norm() for p in net.parameters() if p.grad is not None]
                            )
                        )
                    )
                )
        return [p.detach().clone() for p in net.parameters()], missing

    reference, reference_missing = run(0)
    out: dict[str, Any] = {
        "grad_norms": norms,
        "no_grad_params": sum(reference_missing[-1]),
        "steps": len(reference_missing),
    }
    runs = [("micro_1", 1, False), ("micro_2", 2, False), ("naive_2", 2, True)]
    for name, micro, naive in runs + ([("samples_2", 2, False)] if ignore else []):
        real = nnunet.ignore_label_shares
        if name == "samples_2":  # each micro-batch weighed by its samples alone
            nnunet.ignore_label_shares = lambda *_: None  # type: ignore[assignment]
        try:
            params, missing = run(micro, naive)
        finally:
            nnunet.ignore_label_shares = real
        out[name] = max(float((a - b).abs().max()) for a, b in zip(params, reference, strict=True))
        out[f"{name}_same_none_grads"] = missing == reference_missing
    return out


class _Torch64:
    """``torch`` as nnU-Net's Dice module sees it, its float32 made float64: the Dice sums in
    float32 whatever its inputs (``sum(..., dtype=torch.float32)``); a float64 comparison needs
    them in float64, the same arithmetic otherwise."""

    def __getattr__(self, name: str) -> Any:
        import torch

        return torch.float64 if name == "float32" else getattr(torch, name)


@contextlib.contextmanager
def _dice_in_float64() -> Any:
    import nnunetv2.training.loss.dice as dice

    real = dice.torch
    dice.torch = _Torch64()
    try:
        yield
    finally:
        dice.torch = real


def _random_batch(trainer: Any, seed: int) -> tuple[Any, list[Any]]:
    """A batch of 3 float64 patches and their labels at every deep supervision scale."""
    import torch

    torch.manual_seed(seed)
    patch = [int(p) for p in trainer.configuration_manager.patch_size]
    x = torch.randn(3, 1, *patch, dtype=torch.float64)
    y = [
        torch.randint(
            0, 3, (3, 1, *[max(1, round(p * s)) for p, s in zip(patch, sc, strict=True)])
        ).double()
        for sc in trainer._get_deep_supervision_scales()
    ]
    return x, y


def _exact_one(batch_dice: bool, wide: bool, ignore: bool = False) -> dict[str, float]:
    """One plan's largest differences from nnU-Net's own gradient: the trainer at
    micro-batches of 1 and of 2 (2 + 1), ``loss / N`` at 2, and (its Dice summing in float32,
    as shipped) nnU-Net's own round-off, its update with the sums in float64. With ``ignore``,
    an ignore label held unevenly, and the control ``samples_2``: each micro-batch's loss
    weighed by its samples alone (bigbatch's trainer before it weighed the cross-entropy by
    the voxels not ignored)."""
    import torch

    import bigbatch.integrations.nnunet as nnunet

    trainer = _narrowed(_trainer(batch_dice))
    if ignore:
        _with_ignore_label(trainer)
    torch.manual_seed(0)  # the same weights in every run
    trainer.initialize()
    trainer.network.double()
    trainer.loss = trainer._build_loss()
    x, y = _random_batch(trainer, seed=0)
    if ignore:
        y = _ignored_unevenly(y)
    state = {k: v.clone() for k, v in trainer.network.state_dict().items()}
    grads = {}
    runs = [("reference", 0), ("micro_1", 1), ("micro_2", 2), ("naive_2", 2)]
    for name, micro in runs + ([("samples_2", 2)] if ignore else []):
        trainer.network.load_state_dict(state)
        real = nnunet.ignore_label_shares
        if name == "samples_2":
            nnunet.ignore_label_shares = lambda *_: None  # type: ignore[assignment]
        try:
            grads[name] = _gradients(trainer, x, y, micro, naive=name.startswith("naive"))
        finally:
            nnunet.ignore_label_shares = real
    if not wide:
        with _dice_in_float64():
            trainer.network.load_state_dict(state)
            grads["own_round_off"] = _gradients(trainer, x, y, 0)
    reference = grads.pop("reference")
    return {
        name: max(float((a - b).abs().max()) for a, b in zip(g, reference, strict=True))
        for name, g in grads.items()
    }


def memory(root: Path) -> None:
    """nnU-Net's training step at its batch on this CPU: the planner's (calibrated) prediction
    against the measured peak of the same step (bigbatch.memory.measure), as JSON."""
    import torch

    from bigbatch.integrations.nnunet import _spec_at, plan_configuration
    from bigbatch.memory.measure import measure_step_peak

    trainer = _trainer()
    torch.manual_seed(0)
    trainer.initialize()
    plan = plan_configuration(trainer, "64GB", "cpu")
    batch = int(trainer.batch_size)
    measured = measure_step_peak(_spec_at(trainer, "cpu")(batch))
    predicted = dict(plan.curve).get(batch, plan.predicted_peak_bytes)
    print(json.dumps({"batch": batch, "predicted": predicted, "measured": measured}))


def planner_fits(root: Path) -> None:
    """Each configuration of nnUNetBigBatchPlans: its batch, the predicted peak of the planner's
    step at that batch, and what the planner could use, as JSON; and what a
    split batch-Dice plan holds for gradient caching against the outputs alone."""
    import numpy as np
    from nnunetv2.utilities.get_network_from_plans import get_network_from_plans

    from bigbatch.integrations.nnunet import (
        batch_dice_cache_bytes,
        nnUNetPlannerBigBatch,
        plan_step_spec,
    )
    from bigbatch.memory.predict import predict_peak

    folder = root / "preprocessed" / DATASET
    plans = json.loads((folder / "nnUNetBigBatchPlans.json").read_text())
    usable = nnUNetPlannerBigBatch(987, 8).usable
    out: dict[str, Any] = {"usable": usable}
    for name, c in plans["configurations"].items():
        arch = c["architecture"]

        def build(arch: dict = arch) -> Any:
            return get_network_from_plans(
                arch["network_class_name"], arch["arch_kwargs"], arch["_kw_requires_import"],
                1, 3, allow_init=False, deep_supervision=True,
            )  # fmt: skip

        spec = plan_step_spec(build, tuple(c["patch_size"]), 1, 3, arch["arch_kwargs"])
        batch = int(c["batch_size"])
        out[name] = {
            "batch": batch,
            "peak": predict_peak(spec.with_batch(batch)).planning_bytes,
        }
    trainer = _trainer(batch_dice=True)
    trainer.initialize()
    patch = [int(p) for p in trainer.configuration_manager.patch_size]
    scales = trainer._get_deep_supervision_scales()
    outputs = sum(
        3 * int(np.prod([max(1, round(p * s)) for p, s in zip(patch, sc, strict=True)]))
        for sc in scales
    )
    out["cache"] = {
        "held": batch_dice_cache_bytes(trainer, 8, "fp32"),
        "outputs_and_gradients": 2 * 8 * outputs * 4,
    }
    print(json.dumps(out))


def pretrained(root: Path) -> None:
    """``load_pretrained`` of the checkpoint named on the command line into a fresh trainer of
    fold 2: how many weights it took."""
    import torch

    from bigbatch.integrations.nnunet import load_pretrained, trainer_for

    trainer = trainer_for(DATASET, "3d_fullres", 2, device=torch.device("cpu"))
    print(load_pretrained(trainer, sys.argv[3]))


if __name__ == "__main__":
    root = Path(sys.argv[1])
    _paths(root)
    scenarios = {
        "prepare": prepare,
        "exact": exact,
        "memory": memory,
        "pretrained": pretrained,
        "planner_fits": planner_fits,
    }
    scenarios[sys.argv[2]](root)
