"""How a micro-batch is counted: samples, tokens, or user weights.

The count is the normaliser of the loss. A mean loss over ``c`` items contributes ``c * loss``
to the window; the window is divided by the sum of the counts once, at step time. That is what
makes accumulated gradients equal the big-batch gradient whatever the micro-batch sizes.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from bigbatch.device import device_kind

__all__ = ["MicroBatchCount", "count_tokens", "resolve_count", "samples", "tokens", "weights"]

Number = int | float | torch.Tensor


def count_tokens(
    labels: torch.Tensor, ignore_index: int = -100, *, shift: bool = False
) -> torch.Tensor:
    """Number of labels that take part in a token loss (those not equal to ``ignore_index``).

    ``shift=True`` counts ``labels[..., 1:]``: a causal language model that shifts its labels
    inside (Hugging Face's ``model(input_ids, labels=labels)``) predicts every token but the
    first, so counting all of them over-counts one token per sequence. Returned as a 0-d tensor
    on the labels' device, so counting never forces a device sync.

    >>> import torch
    >>> labels = torch.tensor([[1, 2, -100], [3, -100, -100]])
    >>> int(count_tokens(labels)), int(count_tokens(labels, shift=True))
    (3, 1)
    """
    if shift:
        if labels.dim() == 0 or labels.shape[-1] < 2:
            raise ValueError(
                f"shift=True needs sequences of at least 2 labels, got shape {tuple(labels.shape)}"
            )
        labels = labels[..., 1:]
    return (labels != ignore_index).sum()


@dataclass(frozen=True)
class MicroBatchCount:
    """The normaliser of one micro-batch and what it adds to the unit counters
    (``samples_seen``, ``tokens_seen``): what :func:`samples`, :func:`tokens`, :func:`weights`
    and :func:`resolve_count` return.

    >>> MicroBatchCount(normaliser=5, samples=2, tokens=5).normaliser
    5
    """

    normaliser: Number  # what the loss is weighted by: samples, tokens or weight
    samples: Number  # added to ``samples_seen``
    tokens: Number  # added to ``tokens_seen`` (0 unless counted from labels)


def samples(n: int | torch.Tensor) -> MicroBatchCount:
    """A loss that is a mean over ``n`` samples: ``acc.backward(loss, count=samples(len(y)))``
    (the same as ``count=len(y)``).

    >>> samples(8).normaliser
    8
    """
    return resolve_count(n)


def tokens(
    labels: torch.Tensor, *, ignore_index: int = -100, shift: bool = False
) -> MicroBatchCount:
    """A loss that is a mean over the tokens ``labels != ignore_index`` (``shift=True``: of
    ``labels[..., 1:]``, for a causal LM that shifts inside): ``count=tokens(labels)``.

    >>> int(tokens(torch.tensor([[1, 2, -100]]), shift=True).normaliser)
    1
    """
    return resolve_count(labels=labels, ignore_index=ignore_index, shift=shift)


def weights(total: float | torch.Tensor, n: int | torch.Tensor | None = None) -> MicroBatchCount:
    """A weighted mean ``sum(w * l) / sum(w)``: ``count=weights(w.sum(), len(y))`` (``n``, the
    samples, keeps ``samples_seen``).

    >>> weights(2.5, 4).normaliser, weights(2.5, 4).samples
    (2.5, 4)
    """
    return resolve_count(n, weight=total)


def _check_integer_count(count: object) -> Number:
    if isinstance(count, bool):
        raise TypeError("count must be an integer number of samples, not a bool")
    if isinstance(count, torch.Tensor):
        if count.numel() != 1:
            raise ValueError(
                f"count must be a single number, got a tensor of shape {tuple(count.shape)}; "
                "pass count=len(batch) for samples or labels=... for tokens"
            )
        if count.is_floating_point() or count.is_complex():
            raise TypeError(
                f"count must be an integer (got a {count.dtype} tensor); "
                "for fractional per-sample weights pass weight=... instead"
            )
        if count.device.type == "cpu" and int(count) < 0:  # on a device: checked at step time
            raise ValueError(f"count must be >= 0, got {int(count)}")
        return count.detach().reshape(())
    if isinstance(count, numbers.Integral):
        if int(count) < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        return int(count)
    if isinstance(count, numbers.Real) and float(count).is_integer():
        if float(count) < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        return int(float(count))
    raise TypeError(
        f"count must be a non-negative integer, got {count!r}; "
        "for fractional per-sample weights pass weight=... instead"
    )


def _check_weight(weight: object) -> Number:
    if isinstance(weight, torch.Tensor):
        if weight.numel() != 1:
            raise ValueError(
                "weight must be the micro-batch's total weight (a single number), got a tensor "
                f"of shape {tuple(weight.shape)}; pass weight=w.sum()"
            )
        if weight.device.type == "cpu" and not float(weight) >= 0:  # on a device: at step time
            raise ValueError(f"weight must be >= 0, got {float(weight)}")
        wide = torch.float64 if device_kind(weight.device).float64 else torch.float32
        return weight.detach().reshape(()).to(wide)
    if isinstance(weight, numbers.Real) and not isinstance(weight, bool):
        if not float(weight) >= 0:  # also rejects nan
            raise ValueError(f"weight must be >= 0, got {weight}")
        return float(weight)
    raise TypeError(f"weight must be a non-negative number, got {weight!r}")


def resolve_count(
    count: object = None,
    *,
    labels: torch.Tensor | None = None,
    ignore_index: int = -100,
    shift: bool = False,
    weight: object = None,
) -> MicroBatchCount:
    """Turn the ways a user can describe a micro-batch into one :class:`MicroBatchCount`.

    - ``count=len(batch)``: the loss is normalised per sample (the default meaning);
    - ``labels=labels``: the loss is normalised per token, counting labels != ``ignore_index``
      (``shift=True``: of ``labels[..., 1:]``, for causal LMs that shift labels inside);
    - ``weight=w.sum()``: the loss is a weighted mean with these total weights;
    - ``count=`` a count object, :func:`samples`, :func:`tokens` or :func:`weights`, the same
      three as values (a new kind of count is a new function returning a MicroBatchCount).

    >>> resolve_count(8).normaliser
    8
    """
    if isinstance(count, MicroBatchCount):
        # A count object (samples(n), tokens(labels), weights(w)): complete as it is.
        if labels is not None or weight is not None:
            raise ValueError(
                "count= is a count object already (samples/tokens/weights): do not pass "
                "labels= or weight= beside it"
            )
        return count
    if shift and labels is None:
        raise ValueError("shift=True shifts the labels: pass labels=labels with it")
    if type(count) is int and count >= 0 and labels is None and weight is None:
        return MicroBatchCount(normaliser=count, samples=count, tokens=0)  # the common case, fast
    if count is None and labels is None and weight is None:
        raise ValueError(
            "bigbatch needs to know how many items this micro-batch's loss averages over: "
            "pass count=len(batch) (samples), labels=labels (tokens, ignoring ignore_index) "
            "or weight=weights.sum() (weighted mean)"
        )
    samples: Number = 0
    tokens: Number = 0
    if count is not None:
        samples = _check_integer_count(count)
    if labels is not None:
        if not isinstance(labels, torch.Tensor):
            raise TypeError(f"labels must be a tensor, got {type(labels).__name__}")
        tokens = count_tokens(labels, ignore_index, shift=shift)
        if count is None:
            samples = labels.shape[0] if labels.dim() > 0 else 1
    normaliser: Number
    if weight is not None:
        normaliser = _check_weight(weight)
    elif labels is not None:
        normaliser = tokens
    else:
        normaliser = samples
    return MicroBatchCount(normaliser=normaliser, samples=samples, tokens=tokens)
