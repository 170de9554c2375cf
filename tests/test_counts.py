import pytest
import torch
import torch.nn.functional as F

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


def test_causal_lm_counts_shifted_labels_exactly() -> None:
    """A Hugging Face causal LM shifts its labels inside: `labels=labels, shift=True` counts the
    tokens it predicts, and the accumulated update equals the big batch's; counting every label
    (`labels=labels`) over-counts one token per sequence and fails the same check."""
    import copy

    transformers = pytest.importorskip("transformers")
    from bigbatch import Accumulator
    from helpers import roundoff_tol, update_rel_diff

    config = transformers.GPT2Config(
        vocab_size=50, n_positions=32, n_embd=16, n_layer=1, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    start = transformers.GPT2LMHeadModel(config).double()
    g = torch.Generator().manual_seed(0)
    # Micro-batches of different lengths and padding: 2 x 6, 3 x 12, 1 x 20 tokens.
    batches = []
    for n, length, pad in [(2, 6, 1), (3, 12, 5), (1, 20, 0)]:
        ids = torch.randint(0, 50, (n, length), generator=g)
        labels = ids.clone()
        if pad:
            labels[:, -pad:] = -100
        batches.append((ids, labels))

    def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)

    # The reference: one big batch, right-padded to the longest sequence with ignored labels.
    width = max(ids.shape[1] for ids, _ in batches)
    ids = torch.cat([F.pad(i, (0, width - i.shape[1])) for i, _ in batches])
    labels = torch.cat([F.pad(lab, (0, width - lab.shape[1]), value=-100) for _, lab in batches])

    def big_batch(exact: bool) -> torch.nn.Module:
        model = copy.deepcopy(start)
        opt = sgd(model)
        if exact:  # the shifted loss in float64 throughout
            logits = model(input_ids=ids).logits[:, :-1]
            F.cross_entropy(logits.transpose(1, 2), labels[:, 1:], ignore_index=-100).backward()
        else:
            model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        return model

    ref, exact = big_batch(exact=False), big_batch(exact=True)

    def accumulated(shift: bool) -> torch.nn.Module:
        model = copy.deepcopy(start)
        acc = Accumulator(sgd(model), micro_batches=3)
        for ids, labels in batches:
            loss = model(input_ids=ids, labels=labels).loss
            acc.backward(loss, labels=labels, shift=shift)
        acc.step()
        return model

    # The model is float64, but transformers' ForCausalLMLoss casts the logits to float32: the
    # bar is that big batch's own round-off (measured: 5e-8 from float64's, so float32's floor
    # of 9.5e-7; the shifted count is 9e-8 off), against 0.097 for the unshifted count.
    def update(model: torch.nn.Module) -> list[torch.Tensor]:
        pairs = zip(start.parameters(), model.parameters(), strict=True)
        return [p.detach() - p0.detach() for p0, p in pairs]

    tol = roundoff_tol(update(ref), update(exact))
    assert update_rel_diff(start, accumulated(shift=True), ref) <= tol
    assert update_rel_diff(start, accumulated(shift=False), ref) > tol


def test_shift_needs_labels() -> None:
    with pytest.raises(ValueError, match="labels=labels"):
        resolve_count(4, shift=True)
    with pytest.raises(ValueError, match="at least 2"):
        resolve_count(labels=torch.tensor([[1]]), shift=True)


def test_count_objects_equal_the_keyword_forms() -> None:
    """count= takes samples(n), tokens(labels, shift=...) or weights(w, n): the same windows as
    count=n, labels=..., weight=..., so a new kind of count is one function."""
    from bigbatch import Accumulator
    from bigbatch.counts import samples, tokens, weights

    labels = torch.tensor([[1, 2, -100], [3, -100, -100]])
    pairs = [
        (samples(3), {"count": 3}),
        (tokens(labels, shift=True), {"labels": labels, "shift": True}),
        (weights(torch.tensor(2.5), 4), {"weight": torch.tensor(2.5), "count": 4}),
    ]
    for obj, keywords in pairs:
        seen = []
        for kwargs in ({"count": obj}, keywords):
            w = torch.nn.Parameter(torch.ones(2))
            acc = Accumulator(torch.optim.SGD([w], lr=1.0), micro_batches=2)
            for scale in (1.0, 3.0):
                acc.backward((w * scale).sum(), **kwargs)
            result = acc.step()
            seen.append((w.detach().clone(), result.count, acc.samples_seen, acc.tokens_seen))
        assert torch.equal(seen[0][0], seen[1][0]) and seen[0][1:] == seen[1][1:]
    with pytest.raises(ValueError, match="count object already"):
        Accumulator(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)).backward(
            torch.ones(1, requires_grad=True).sum(), count=samples(1), weight=1.0
        )
