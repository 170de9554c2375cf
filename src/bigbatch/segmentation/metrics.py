"""Segmentation scores: per case (the challenge metrics, from MONAI) and over a whole set."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch

__all__ = ["CaseScores", "SegmentationMetrics", "parse_regions"]


@dataclass
class SegmentationMetrics:
    """Accumulate hard-prediction overlaps batch by batch; :meth:`compute` gives Dice and Jaccard
    per class and their mean, exactly as if the whole set were one batch (sums, not means of
    per-batch means). Binary masks (one logit channel, threshold 0.5) score the foreground.

    >>> m = SegmentationMetrics(num_classes=1)
    >>> m.update(torch.tensor([[[[5.0, -5.0]]]]), torch.tensor([[[1, 1]]]))
    >>> m.compute()["dice"], m.compute()["jaccard"]
    (0.6666666666666666, 0.5)
    """

    num_classes: int
    intersection: torch.Tensor = field(init=False)
    predicted: torch.Tensor = field(init=False)
    actual: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        if self.num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {self.num_classes}")
        self.reset()

    def reset(self) -> None:
        scored = self.num_classes if self.num_classes > 1 else 1
        self.intersection = torch.zeros(scored, dtype=torch.float64)
        self.predicted = torch.zeros(scored, dtype=torch.float64)
        self.actual = torch.zeros(scored, dtype=torch.float64)

    @torch.no_grad()
    def update(self, logits: torch.Tensor, target: torch.Tensor) -> None:
        if logits.shape[1] == 1:
            pred = (logits[:, 0] > 0).long()  # sigmoid > 0.5
            target = target.reshape(pred.shape).long()
            classes = [1]
        else:
            pred = logits.argmax(1)
            target = target.long()
            classes = list(range(self.num_classes))
        for i, c in enumerate(classes):
            p, t = pred == c, target == c
            self.intersection[i] += float((p & t).sum())
            self.predicted[i] += float(p.sum())
            self.actual[i] += float(t.sum())

    def compute(self) -> dict[str, object]:
        """``dice``/``jaccard`` (means over the classes but the background) and
        ``dice_per_class``/``jaccard_per_class`` (every class).
        A class absent from both prediction and truth scores 1 (nothing to miss)."""
        union = self.predicted + self.actual - self.intersection
        total = self.predicted + self.actual
        dice = torch.where(
            total > 0, 2 * self.intersection / total.clamp(min=1), torch.ones_like(total)
        )
        jaccard = torch.where(
            union > 0, self.intersection / union.clamp(min=1), torch.ones_like(union)
        )
        # The means leave the background (class 0) out: it is most of every image and would
        # hide how well the structures themselves are found.
        scored = slice(1, None) if self.num_classes > 1 else slice(None)
        return {
            "dice": float(dice[scored].mean()),
            "jaccard": float(jaccard[scored].mean()),
            "dice_per_class": dice.tolist(),
            "jaccard_per_class": jaccard.tolist(),
        }


def parse_regions(text: str) -> dict[str, tuple[int, ...]]:
    """``regions=wt:1,2,3;tc:1,3;et:3``: named unions of labels, scored as one structure each
    (BraTS's whole tumour, tumour core and enhancing tumour are nested unions of its labels).

    >>> parse_regions("wt:1,2,3; tc:1,3; et:3")
    {'wt': (1, 2, 3), 'tc': (1, 3), 'et': (3,)}
    """
    regions: dict[str, tuple[int, ...]] = {}
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        name, sep, labels = part.partition(":")
        try:
            values = tuple(int(v) for v in labels.split(",") if v.strip())
        except ValueError:
            values = ()
        if not sep or not name.strip().isidentifier() or not values or min(values) < 1:
            raise ValueError(
                f"regions={text!r}: give name:labels groups separated by ';', each a name and "
                "the foreground labels (>= 1) it unites, e.g. regions=wt:1,2,3;tc:1,3;et:3"
            )
        regions[name.strip()] = values
    return regions


@dataclass
class CaseScores:
    """The challenge metrics: each case (one validation image or volume) scored on its own,
    then averaged over cases. Dice and Jaccard come from MONAI's ``compute_dice``; the 95 %
    Hausdorff distance (``hd95``, in voxels, or in mm with ``spacing``) from MONAI's
    ``compute_hausdorff_distance``. Structures are the classes but the background, the
    foreground of a binary task, or the ``regions`` (unions of labels). A structure absent from
    both prediction and truth scores Dice 1 and hd95 0; present in only one, Dice 0 and hd95 the
    image's diagonal. Pixels labelled ``void`` count nowhere.

    >>> s = CaseScores(num_classes=1)
    >>> s.update(torch.tensor([[[[5.0, -5.0]]]]), torch.tensor([[[1, 1]]]))
    >>> round(s.compute()["dice"], 4), round(s.compute()["jaccard"], 4)
    (0.6667, 0.5)
    """

    num_classes: int
    names: list[str] = field(default_factory=list)
    regions: dict[str, tuple[int, ...]] = field(default_factory=dict)
    void: int | None = None
    spacing: tuple[float, ...] = ()
    hd95: bool = True
    dice: list[torch.Tensor] = field(default_factory=list, init=False)
    distance: list[torch.Tensor] = field(default_factory=list, init=False)

    def structures(self) -> list[str]:
        if self.regions:
            return list(self.regions)
        if self.num_classes == 1:
            return ["foreground"]
        names = self.names or [str(c) for c in range(self.num_classes)]
        return names[1:]

    def _one_hot(self, labels: torch.Tensor) -> torch.Tensor:
        """(N, S, *spatial) of 0/1, one channel per structure."""
        if self.regions:
            groups = list(self.regions.values())
        elif self.num_classes == 1:
            groups = [(1,)]
        else:
            groups = [(c,) for c in range(1, self.num_classes)]
        return torch.stack(
            [torch.isin(labels, torch.tensor(g, device=labels.device)) for g in groups], 1
        ).float()

    @torch.no_grad()
    def update(self, logits: torch.Tensor, target: torch.Tensor) -> None:
        from monai.metrics import compute_dice, compute_hausdorff_distance

        logits = logits.float().cpu()
        target = target.reshape(logits.shape[0], *logits.shape[2:]).long().cpu()
        pred = (logits[:, 0] > 0).long() if logits.shape[1] == 1 else logits.argmax(1)
        if self.void is not None:  # void pixels: background in both, so they count nowhere
            keep = target != self.void
            pred, target = pred * keep, target * keep
        p, t = self._one_hot(pred), self._one_hot(target)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # MONAI warns on every empty structure
            self.dice.append(compute_dice(p, t, include_background=True, ignore_empty=False))
            if self.hd95:
                hd = compute_hausdorff_distance(
                    p,
                    t,
                    include_background=True,
                    percentile=95,
                    spacing=list(self.spacing) or None,
                )
                self.distance.append(self._conventions(hd, p, t))

    def _conventions(self, hd: torch.Tensor, p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        spatial = tuple(range(2, p.dim()))
        in_p, in_t = p.sum(spatial) > 0, t.sum(spatial) > 0
        scale = torch.tensor(self.spacing or [1.0] * len(spatial))
        diagonal = float((torch.tensor(p.shape[2:]) * scale).norm())
        hd = torch.where(in_p & in_t, hd, torch.full_like(hd, diagonal))
        return torch.where(~in_p & ~in_t, torch.zeros_like(hd), hd)

    def compute(self) -> dict[str, float]:
        """``dice``, ``jaccard`` (and ``hd95``): the mean over cases of each case's mean over
        the structures; ``dice_<structure>`` (and ``hd95_<structure>``) when there are several."""
        if not self.dice:
            return {"dice": math.nan, "jaccard": math.nan}
        dice = torch.cat(self.dice).double()  # (cases, structures)
        jaccard = dice / (2 - dice)
        row = {"dice": float(dice.mean(1).mean()), "jaccard": float(jaccard.mean(1).mean())}
        names = self.structures()
        if self.distance:
            hd = torch.cat(self.distance).double()
            row["hd95"] = float(hd.mean(1).mean())
        if len(names) > 1:
            row |= {f"dice_{n}": float(d) for n, d in zip(names, dice.mean(0), strict=True)}
            if self.distance:
                row |= {f"hd95_{n}": float(d) for n, d in zip(names, hd.mean(0), strict=True)}
        return row
