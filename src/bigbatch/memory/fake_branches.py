"""Libraries that take another branch on fake tensors than on real ones, made to take the real
run's branch while a step is traced, so the prediction counts what the real step allocates.

Hugging Face transformers treats a FakeTensor as tracing (``is_tracing``), since it cannot read
its values: ``find_packed_sequence_indices`` then reports the model's own position ids as
packed sequences and the model builds a (batch, 1, length, length) attention mask that the real
run, with SDPA's ``is_causal``, never builds. A 2-layer Llama at 1024 tokens was over-predicted
by 28-34 % (growing with the square of the length). While tracing, fake position ids count as
one sequence per row, what the model's own ``arange`` ids are; ids you pack yourself
(several sequences in a row) are a mask the prediction does not see.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["real_branches"]


def _is_fake(t: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


@contextlib.contextmanager
def real_branches() -> Iterator[None]:
    """While tracing a step on fake tensors, libraries take the branch a real step takes.

    Only what is already imported is touched, and it is restored on exit.

    >>> with real_branches():
    ...     pass
    """
    masking: Any = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "find_packed_sequence_indices", None)
    if masking is None or original is None:
        yield
        return

    def find_packed_sequence_indices(position_ids: Any) -> Any:
        if _is_fake(position_ids):
            return None  # one sequence per row: what the real run finds for arange ids
        return original(position_ids)

    # A module attribute, looked up at each call by transformers' own mask builder.
    masking.find_packed_sequence_indices = find_packed_sequence_indices
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original
