"""From probabilities to a submission: per-class thresholds and smallest components chosen on
validation by the competition's Dice (empty vs empty = 1), saved and loaded as
postprocess.json, and a submission whose RLE decodes to exactly the masks the rules give."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from bigbatch.segmentation.postprocess import (
    ClassRule,
    apply_rules,
    competition_dice,
    load_rules,
    pair_dice,
    resize_probabilities,
    save_rules,
    tune_rules,
)
from bigbatch.segmentation.rle import read_rle_csv, write_rle_csv

pytest.importorskip("monai")


def _validation(n: int = 12, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Two classes: half the images empty; probabilities high on the truth, with stray
    speckles of moderate probability everywhere."""
    rng = np.random.default_rng(seed)
    truth = np.zeros((n, 2, 20, 30), dtype=bool)
    for i in range(0, n, 2):
        truth[i, 0, 4:12, 5:20] = True
        truth[i, 1, 10:18, 10:28] = True
    probs = np.where(truth, 0.75, 0.05) + rng.normal(0, 0.05, truth.shape)
    speckles = rng.random(truth.shape) < 0.01
    return np.clip(np.where(speckles, 0.6, probs), 0, 1), truth


def test_competition_dice_scores_empty_pairs_as_one() -> None:
    truth = np.zeros((2, 1, 4, 4), dtype=bool)
    truth[0, 0, :2] = True
    predicted = truth.copy()
    predicted[1, 0, 0, 0] = True  # one stray pixel on an empty mask costs the whole pair
    assert competition_dice(truth, truth).tolist() == [1.0]
    assert competition_dice(predicted, truth).tolist() == [0.5]


def test_pair_dice_is_the_exact_ratio_in_float64() -> None:
    truth = np.zeros((1, 1, 64, 64), dtype=bool)
    truth[0, 0, :3, :7] = True  # 21 pixels
    predicted = np.zeros_like(truth)
    predicted[0, 0, :2, :] = True  # 128 pixels, 14 of them in the truth
    dice = pair_dice(predicted, truth)
    assert dice.dtype == np.float64 and dice[0, 0] == 2 * 14 / (128 + 21)
    assert float(np.float32(2 * 14) / np.float32(128 + 21)) != 2 * 14 / (128 + 21)  # float32's


def test_pair_dice_agrees_with_monai_and_refuses_masks_that_differ() -> None:
    from monai.metrics import compute_dice

    probs, truth = _validation()
    predicted = probs > 0.5
    monai = compute_dice(
        torch.as_tensor(predicted).double(),
        torch.as_tensor(truth).double(),
        include_background=True,
        ignore_empty=False,
    )
    np.testing.assert_array_equal(pair_dice(predicted, truth), monai.numpy())
    with pytest.raises(ValueError, match="masks differ"):
        pair_dice(predicted, truth[:, :1])


def test_tuned_rules_beat_a_plain_half_threshold() -> None:
    probs, truth = _validation()
    rules, scores = tune_rules(probs, truth)
    plain = competition_dice(np.stack([apply_rules(p, [ClassRule()] * 2) for p in probs]), truth)
    assert all(r.min_size > 0 for r in rules)  # the speckles are dropped
    assert (scores > plain).all() and (scores > 0.95).all()


def test_rules_round_trip_and_an_unseen_class_is_refused(tmp_path: Path) -> None:
    rules = [ClassRule(0.4, 120), ClassRule(0.55, 0)]
    save_rules(tmp_path / "postprocess.json", ["Fish", "Sugar"], rules, [0.61, 0.7], (350, 525))
    assert load_rules(tmp_path / "postprocess.json", ["Fish", "Sugar"]) == (rules, (350, 525))
    with pytest.raises(ValueError, match="class 'Gravel' was not seen in training"):
        load_rules(tmp_path / "postprocess.json", ["Fish", "Gravel"])


@pytest.mark.parametrize("layout", ["image_label", "image_class"])
def test_a_submission_decodes_to_the_predicted_masks(tmp_path: Path, layout: str) -> None:
    probs, truth = _validation()
    rules, _ = tune_rules(probs, truth)
    test = resize_probabilities(torch.as_tensor(probs[:4]), (10, 15)).numpy()
    predicted = {f"{i}.jpg": apply_rules(p, rules) for i, p in enumerate(test)}
    classes = ["Fish", "Sugar"]
    rows = ((image, dict(zip(classes, m, strict=True))) for image, m in predicted.items())
    write_rle_csv(tmp_path / "submission.csv", layout, classes, rows)
    table = read_rle_csv(tmp_path / "submission.csv")
    for image, masks in predicted.items():
        assert np.array_equal(table.decode(image, (10, 15)), masks)
