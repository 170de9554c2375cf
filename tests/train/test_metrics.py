import math

import torch
import torch.nn.functional as F

from bigbatch.train.tasks.classification.metrics import ClassificationMetrics


def test_metrics_over_batches_equal_metrics_over_the_whole_set() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, 4, generator=g)
    targets = torch.randint(0, 4, (50,), generator=g)
    m = ClassificationMetrics()
    for lo, t in zip(logits.split([7, 20, 3, 20]), targets.split([7, 20, 3, 20]), strict=True):
        m.update(lo, t)
    assert m.count == 50
    assert math.isclose(m.loss, float(F.cross_entropy(logits, targets)), rel_tol=1e-6)
    accuracy = int((logits.argmax(1) == targets).sum()) / 50
    assert math.isclose(m.accuracy, accuracy) and math.isclose(m.error_rate, 1 - accuracy)


def test_empty_metrics_are_nan() -> None:
    assert math.isnan(ClassificationMetrics().loss)
