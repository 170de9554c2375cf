"""Adds one thing to 01: a Kaggle segmentation competition's data and submission, with classes
that overlap (Understanding Clouds' layout), trained at an uneven micro-batch split, exactly.

The masks come as run-length encodings in `Image_Label,EncodedPixels`; a pixel can be two
classes at once, so each class gets its own sigmoid and the loss is each image's Dice per class
plus its BCE, averaged over images (a mean of per-sample terms: exact under accumulation). Each
class's threshold and smallest kept component are chosen on the validation set by the
competition's Dice (an empty prediction of an empty mask scores 1), then the test set's masks
are written as a submission at the competition's mask size.
"""

import csv
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

import bigbatch
from bigbatch.segmentation.losses import multilabel_loss
from bigbatch.segmentation.models import UNet
from bigbatch.segmentation.postprocess import (
    apply_rules,
    competition_dice,
    resize_probabilities,
    save_rules,
    tune_rules,
)
from bigbatch.segmentation.rle import read_rle_csv, rle_encode, write_rle_csv

CLASSES = ("Fish", "Sugar")
# Each class's texture: stripes (every other row) or dots (every other row and column).
PATTERNS = {"Fish": (slice(None, None, 2), slice(None)), "Sugar": (slice(None, None, 2),) * 2}
HEIGHT, WIDTH, MASK_SIZE = 32, 48, (16, 24)  # the submission's masks are half size


def make_competition(root: Path, n: int, seed: int) -> list[str]:
    """Images with a striped region (Fish) and a dotted one (Sugar) that may overlap, and
    their masks in train.csv, as the competition ships them."""
    rng = np.random.default_rng(seed)
    (root / "images").mkdir(parents=True, exist_ok=True)
    names, rows = [], []
    for i in range(n):
        image = rng.integers(0, 40, (HEIGHT, WIDTH, 3)).astype(np.uint8)
        masks = {c: np.zeros((HEIGHT, WIDTH), dtype=bool) for c in CLASSES}
        for c, pattern in PATTERNS.items():
            if rng.random() < 0.3:
                continue  # this image has no such region
            top, left = int(rng.integers(0, HEIGHT - 12)), int(rng.integers(0, WIDTH - 16))
            masks[c][top : top + 12, left : left + 16] = True
            region = image[top : top + 12, left : left + 16]
            region[pattern] = 220 if c == "Fish" else 150  # a texture to tell the classes by
        name = f"{i:03d}.jpg"
        Image.fromarray(image).save(root / "images" / name.replace(".jpg", ".png"))
        names.append(name)
        rows += [(f"{name}_{c}", rle_encode(masks[c])) for c in CLASSES]
    with (root / "train.csv").open("w", newline="") as f:
        csv.writer(f).writerows([("Image_Label", "EncodedPixels"), *rows])
    return names


def load(root: Path, names: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    table = read_rle_csv(root / "train.csv")
    images = [np.asarray(Image.open(root / "images" / n.replace(".jpg", ".png"))) for n in names]
    x = torch.tensor(np.stack(images)).permute(0, 3, 1, 2).float() / 255
    y = torch.tensor(np.stack([table.decode(n, (HEIGHT, WIDTH)) for n in names])).float()
    return x, y


torch.manual_seed(0)
root = Path(tempfile.mkdtemp())
names = make_competition(root, 72, seed=0)
x, y = load(root, names)
assert ((y[:, 0] > 0) & (y[:, 1] > 0)).any(), "the classes overlap somewhere"
train, valid, test = slice(0, 48), slice(48, 64), slice(64, 72)

model = UNet(3, len(CLASSES), dims=2, width=8, depth=2)
loss_fn = multilabel_loss("dice_bce")
acc = bigbatch.Accumulator(torch.optim.AdamW(model.parameters(), lr=3e-3), micro_batches=3)
for _epoch in range(12):
    order = torch.randperm(48)
    for start in range(0, 48, 8):  # windows of 8 images, as micro-batches of 3, 3 and 2
        window = order[start : start + 8]
        for part in window.split([3, 3, 2]):
            acc.backward(loss_fn(model(x[train][part]), y[train][part]), count=len(part))
        acc.step()

model.eval()
with torch.no_grad():
    probs = torch.sigmoid(model(x))
at_mask_size = resize_probabilities(probs, MASK_SIZE).numpy()
truth = F.interpolate(y, size=MASK_SIZE, mode="nearest").numpy() > 0.5
rules, scores = tune_rules(at_mask_size[valid], truth[valid])
plain = competition_dice(at_mask_size[valid] > 0.5, truth[valid])
save_rules(root / "postprocess.json", CLASSES, rules, scores, MASK_SIZE)
for c, rule, score, before in zip(CLASSES, rules, scores, plain, strict=True):
    print(
        f"{c}: threshold {rule.threshold:.2f}, smallest component {rule.min_size} px -> "
        f"validation Dice {score:.3f} (threshold 0.5 alone: {before:.3f})"
    )

predicted = {names[i]: apply_rules(at_mask_size[i], rules) for i in range(64, 72)}
rows = ((n, dict(zip(CLASSES, m, strict=True))) for n, m in predicted.items())
count = write_rle_csv(root / "submission.csv", "image_label", CLASSES, rows)
back = read_rle_csv(root / "submission.csv")
assert all(np.array_equal(back.decode(n, MASK_SIZE), m) for n, m in predicted.items())
test_dice = competition_dice(np.stack(list(predicted.values())), truth[test]).mean()
print(f"submission: {count} rows in {root / 'submission.csv'}, test Dice {test_dice:.3f}")
