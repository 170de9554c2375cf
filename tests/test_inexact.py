import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bigbatch import Accumulator, InexactAccumulationWarning, find_inexact_layers, freeze_batchnorm


def _bn_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.1), nn.Linear(8, 2))


def test_finds_batchnorm_and_dropout_in_train_mode_only() -> None:
    model = _bn_model().train()
    assert [(x.name, x.kind) for x in find_inexact_layers(model)] == [
        ("1", "batchnorm"),
        ("2", "dropout"),
    ]
    assert find_inexact_layers(model.eval()) == []


def test_accumulator_warns_once_and_names_the_remedies() -> None:
    model = _bn_model().train()
    acc = Accumulator(torch.optim.SGD(model.parameters(), lr=0.1), micro_batches=2, model=model)
    x, y = torch.randn(4, 4), torch.tensor([0, 1, 0, 1])
    with pytest.warns(
        InexactAccumulationWarning, match=r"freeze_batchnorm.*GroupNorm.*SyncBatchNorm"
    ):
        acc.backward(F.cross_entropy(model(x), y), count=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        acc.backward(F.cross_entropy(model(x), y), count=4)  # no second warning


def test_freeze_batchnorm_survives_only_until_train() -> None:
    model = _bn_model().train()
    assert freeze_batchnorm(model) == ["1"]
    assert not model[1].training and model[0].training
    model.train()
    assert model[1].training
