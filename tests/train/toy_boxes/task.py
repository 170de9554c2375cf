"""Images of 1-3 bright squares; the model regresses each square's box (x0, y0, x1, y1 in
[0, 1]) into one of three slots, in the order of x0. The loss is the L1 error averaged over the
micro-batch's *boxes*, not its images: ``step`` returns that count, so an image with three boxes
weighs three times one with one, in every split of the window."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import load_file
from torch import nn

from bigbatch.batching import split_batch
from bigbatch.train.config import TrainConfig, config_from_json
from bigbatch.train.tasks import EnsembleRequest, Log, Placement, PredictRequest, Task
from bigbatch.train.tasks.options import TaskOptions, option

SIZE = 16
SLOTS = 3

Boxes = list[torch.Tensor]  # one [k, 4] tensor per image, k from 1 to SLOTS


def collate(samples: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, Boxes]:
    """Images stacked, boxes kept as one tensor per image (their counts differ)."""
    return torch.stack([x for x, _ in samples]), [b for _, b in samples]


@dataclass
class ToyBoxesOptions(TaskOptions):
    """The task's own key, set as ``max_boxes=2`` beside the shared ones."""

    max_boxes: int = option(SLOTS, f"most squares in a generated image (1 to {SLOTS})")

    def check(self, cfg: Any) -> None:
        if not 1 <= self.max_boxes <= SLOTS:
            raise ValueError(
                f"max_boxes must be in 1..{SLOTS} (the model's slots), got {self.max_boxes}"
            )


def generate(n: int, seed: int, max_boxes: int = SLOTS) -> tuple[torch.Tensor, Boxes]:
    g = torch.Generator().manual_seed(seed)
    images, boxes = torch.zeros(n, 1, SIZE, SIZE), []
    for i in range(n):
        k = int(torch.randint(1, max_boxes + 1, (), generator=g))
        corners = torch.randint(0, SIZE - 4, (k, 2), generator=g)
        corners = corners[corners[:, 0].argsort()]
        for x0, y0 in corners.tolist():
            images[i, 0, y0 : y0 + 4, x0 : x0 + 4] = 1.0
        boxes.append(torch.cat([corners, corners + 4], dim=1).float() / SIZE)
    return images, boxes


def box_l1_sum(predicted: torch.Tensor, boxes: Boxes) -> torch.Tensor:
    """The summed L1 error of each image's boxes against its first k slots."""
    slots = predicted.view(len(boxes), SLOTS, 4)
    return sum(
        ((slots[i, : len(b)] - b).abs().sum() for i, b in enumerate(boxes)), slots.new_zeros(())
    )


class BoxItems:
    def __init__(self, images: torch.Tensor, boxes: Boxes) -> None:
        self.images, self.boxes = images, boxes

    def __len__(self) -> int:
        return len(self.boxes)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.boxes[i]


class BoxL1:
    """Validation: the mean L1 error per box coordinate set, weighted by boxes."""

    def __init__(self) -> None:
        self.total, self.boxes = 0.0, 0

    def update(self, logits: torch.Tensor, targets: Boxes) -> None:
        self.total += float(box_l1_sum(logits.float(), targets))
        self.boxes += sum(len(b) for b in targets)

    def as_dict(self) -> dict[str, float]:
        mean = self.total / max(self.boxes, 1)
        return {"valid_loss": mean, "box_l1": mean}


class ToyBoxes(Task):
    """Box regression on generated squares (a test's task)."""

    name = "toy_boxes"
    # What task=toy_boxes.task:ToyBoxes reads (a registry entry says the same: ENTRY).
    metric_names = ("box_l1",)
    lower_is_better_names = ("box_l1",)
    options_class = ToyBoxesOptions
    data_help = "the word generated (the images are drawn)"

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.options = cast(ToyBoxesOptions, cfg.options)
        self.classes = ["box"]

    def prepare(self, log: Log, data: Any = None) -> tuple[BoxItems, BoxItems]:
        images, boxes = generate(48, self.cfg.seed, self.options.max_boxes)
        log(f"data: {len(boxes)} generated images, {sum(len(b) for b in boxes)} boxes")
        return BoxItems(images[:36], boxes[:36]), BoxItems(images[36:], boxes[36:])

    def model_factory(self) -> Callable[[], nn.Module]:
        def build() -> nn.Module:
            return nn.Sequential(
                nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Flatten(),
                nn.Linear(8 * SIZE * SIZE, SLOTS * 4),
            )  # fmt: skip

        return build

    def input_shape(self) -> tuple[int, ...]:
        return (1, SIZE, SIZE)

    def datasets(self, train_items: BoxItems, valid_items: BoxItems) -> tuple[Any, Any]:
        return train_items, valid_items

    @property
    def collate(self) -> Callable[[list[Any]], Any]:
        return collate

    def split(self, window: Any, size: int, min_size: int = 1) -> list[Any]:
        images, boxes = window
        parts, start = [], 0
        for part in split_batch(images, size, min_size=min_size):
            parts.append((part, boxes[start : start + len(part)]))
            start += len(part)
        return parts

    def loss(self, logits: torch.Tensor, targets: Boxes) -> torch.Tensor:
        # In float32 at least (a 16-bit forward's outputs), float64 where the model is.
        wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return box_l1_sum(wide, targets) / sum(len(b) for b in targets)

    def step(self, model: nn.Module, micro: Any, where: Placement) -> tuple[torch.Tensor, int]:
        images, boxes = micro
        with where.autocast():
            logits = model(where.inputs(images))
        return self.loss(logits, where.targets(boxes)), sum(len(b) for b in boxes)

    def example_batch(self, size: int, device: torch.device | str) -> Any:
        boxes = [torch.rand(SLOTS, 4, device=device) for _ in range(size)]
        return torch.randn(size, *self.input_shape(), device=device), boxes

    def metrics(self) -> BoxL1:
        return BoxL1()

    def scores(self, row: dict[str, Any]) -> str:
        return f"valid box L1 {row['box_l1']:.4f}  "


def _boxes_of(run: Path, n: int = 4) -> torch.Tensor:
    """A run's predicted boxes for ``n`` generated images (seeded by the run's seed)."""
    cfg = config_from_json((run / "config.json").read_text())
    model = ToyBoxes(cfg).model_factory()()
    model.load_state_dict(load_file(run / "best.safetensors"))
    images, _ = generate(n, cfg.seed + 1)
    with torch.no_grad():
        return model.eval()(images)


def predict_run(request: PredictRequest) -> str:
    """``bigbatch predict`` on a toy run: boxes.json in the run (or --out)."""
    out = request.out or request.run_dir / "boxes.json"
    out.write_text(json.dumps(_boxes_of(request.run_dir).tolist()))
    return f"boxes in {out}"


def ensemble_run(request: EnsembleRequest) -> str:
    """``bigbatch ensemble RUN RUN --images DIR`` on toy runs: their boxes averaged."""
    mean = torch.stack([_boxes_of(r) for r in request.runs]).mean(0)
    out = (request.out or Path(".")) / "boxes.json"
    out.write_text(json.dumps(mean.tolist()))
    return f"{len(request.runs)} runs averaged: {out}"


ToyBoxes.predict_run = staticmethod(predict_run)  # type: ignore[attr-defined]
ToyBoxes.ensemble_runs = staticmethod(ensemble_run)  # type: ignore[attr-defined]
