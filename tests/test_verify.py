"""verify(): bigbatch matches the big batch in float64 and float32 on the built-in cases, the naive
loss / N does not, and differences are explained."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bigbatch import freeze_batchnorm
from bigbatch.verify import TOLERANCES, run_builtin_cases, verify


@pytest.fixture(scope="module")
def builtin() -> list:
    return run_builtin_cases()


def test_bigbatch_passes_every_builtin_case_in_float64_and_float32(builtin: list) -> None:
    ours = [r for r in builtin if r.method == "bigbatch"]
    assert {r.dtype for r in ours} == {"float64", "float32"}
    assert len(ours) == 10
    for r in ours:
        assert r.passed, (r.case, r.dtype, r.max_rel)
        if r.dtype == "float64":
            assert r.max_rel <= 1e-12 and r.tolerance == 1e-12
        else:  # the float32 big batch's own round-off, times 4, never below 8 float32 ulps
            floor = 8 * torch.finfo(torch.float32).eps
            assert r.roundoff > 0 and r.tolerance == max(floor, 4 * r.roundoff) <= 1e-4


def test_naive_fails_every_builtin_case_except_equal(builtin: list) -> None:
    for r in (r for r in builtin if r.method == "naive"):
        assert r.passed == (r.case == "equal"), (r.case, r.dtype, r.max_rel)
        if r.case != "equal":
            assert r.max_rel > 0.1 and "loss / N" in r.explanation


def test_token_case_counts_real_tokens(builtin: list) -> None:
    tokens = next(r for r in builtin if r.case == "tokens_padding")
    assert tokens.micro_batch_counts == [8, 40, 120, 420]


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def _data(n: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def test_batchnorm_difference_is_detected_and_explained() -> None:
    x, y = _data()
    (r,) = verify(_bn_net().train(), x, y, [8, 8, 8])
    assert not r.passed
    assert "BatchNorm" in r.explanation and "freeze_batchnorm" in r.explanation
    assert "so they explain the difference" in r.explanation


def test_frozen_batchnorm_is_exact() -> None:
    x, y = _data()
    model = _bn_net().train()
    freeze_batchnorm(model)
    (r,) = verify(model, x, y, [4, 8, 12], dtypes=(torch.float64,))
    assert r.passed and r.max_rel <= TOLERANCES[torch.float64]


def test_dropout_difference_is_explained() -> None:
    # Two dropout layers: the big batch draws both masks for all samples, the micro-batches draw
    # them interleaved, so the masks differ (with one layer the CPU RNG stream can coincide).
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(6, 32), nn.Dropout(0.3), nn.Linear(32, 32), nn.Dropout(0.3), nn.Linear(32, 3)
    )
    model.train()
    x, y = _data()
    (r,) = verify(model, x, y, [8, 16])
    assert not r.passed and "dropout" in r.explanation


def test_non_separable_loss_is_explained() -> None:
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    x, y = _data()

    def batch_normalised_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # Couples the samples of a batch: standardising by the batch's own statistics.
        z = (out - out.mean(0)) / (out.std(0) + 1e-3)
        return F.cross_entropy(z, target)

    (r,) = verify(model, x, y, [8, 16], batch_normalised_loss)
    assert not r.passed and "not a mean of per-sample" in r.explanation


def test_sizes_that_do_not_split_the_batch_are_rejected() -> None:
    x, y = _data(10)
    with pytest.raises(ValueError, match=r"add up to 9 but the batch has 10.*\[4, 3, 3\]"):
        verify(nn.Linear(6, 3), x, y, [4, 4, 1])
