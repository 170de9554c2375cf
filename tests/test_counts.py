import pytest
import torch

from bigbatch import count_tokens, resolve_count


def test_count_tokens_ignores_padding() -> None:
    labels = torch.tensor([[1, 2, -100], [-100, -100, -100], [5, 6, 7]])
    assert int(count_tokens(labels)) == 5
    assert int(count_tokens(labels, ignore_index=5)) == 8


def test_resolve_count_units() -> None:
    assert resolve_count(8).normaliser == 8 and resolve_count(8).samples == 8
    labels = torch.tensor([[1, -100], [2, 3]])
    mb = resolve_count(labels=labels)
    assert int(mb.normaliser) == 3 and mb.samples == 2 and int(mb.tokens) == 3
    w = resolve_count(4, weight=torch.tensor(2.5))
    assert float(w.normaliser) == 2.5 and w.samples == 4
    assert resolve_count(torch.tensor(7)).normaliser.item() == 7  # type: ignore[union-attr]
    assert resolve_count(6.0).normaliser == 6  # an integral float is accepted as an integer


@pytest.mark.parametrize(
    ("count", "match"),
    [(-1, ">= 0"), (1.5, "weight="), (True, "bool"), (torch.ones(2, dtype=torch.long), "single")],
)
def test_resolve_count_rejects_bad_counts(count: object, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        resolve_count(count)


def test_resolve_count_rejects_bad_weights() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        resolve_count(weight=float("nan"))
    with pytest.raises(ValueError, match=r"w\.sum"):
        resolve_count(weight=torch.ones(3))
