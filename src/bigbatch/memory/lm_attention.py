"""``flash_attention_2`` as a step is traced: transformers' wrapper around flash-attn (its
``_flash_attention_forward``), whose tensors are the memory that differs from SDPA's, around
SDPA's flash kernel, which stands in for flash-attn's (flash-attn needs its package and a GPU;
both kernels save q, k, v, the output and a float32 log-sum-exp a head and token, and take
grouped-query heads as they are).

Padding is where the two differ. Under SDPA, transformers builds a ``(batch, 1, len, len)`` mask,
which SDPA turns into the queries' dtype in each layer (saved for the backward: ``len**2`` a
sequence and layer), and repeats the key and value heads of grouped-query attention for it
(the repeated copies saved). Under flash_attention_2 it hands the kernel no mask: it gathers
the real tokens of q, k and v into copies (which the kernel saves), and scatters the output
back into a zeroed padded tensor (saved beside the kernel's output where the output
projection's weight or LoRA's adapter on it trains).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from bigbatch.memory.fake_branches import (
    _is_fake,
    _outside_the_trace,
    _values_of,
    known_values,
)

__all__ = ["traced_flash_attention"]

# Without "flash" in it: transformers would look for a flash-attn package of that name.
_NAME = "bigbatch_traced_fa2"


def traced_flash_attention() -> str:
    """The ``attn_implementation`` a traced model runs flash_attention_2 as: transformers'
    wrapper's gathers and scatters around SDPA's flash kernel, registered with transformers'
    ``AttentionInterface`` and, for its padding mask, ``AttentionMaskInterface``. A
    transformers without them (an older one) gets ``"sdpa"`` (its masks, not the copies).

    >>> traced_flash_attention()
    'bigbatch_traced_fa2'
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        return "sdpa"
    AttentionInterface.register(_NAME, _flash_attention)
    AttentionMaskInterface.register(_NAME, _padding_mask)
    return _NAME


def _padding_mask(*, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
    # transformers' own flash_attention_mask: the 2D padding mask (sliced to the keys' length),
    # None without padding. Its test for padding reads values, which a fake mask has only as
    # its batch described them: it is run on those (unknown ones taken as padding, the most
    # tokens there are), and the fake mask is sliced as they were.
    from transformers.masking_utils import flash_attention_mask

    if attention_mask is None or not _is_fake(attention_mask):
        return flash_attention_mask(attention_mask=attention_mask, **kwargs)
    values = _values_of(attention_mask)
    with _outside_the_trace():
        stand_in = torch.zeros(attention_mask.shape, dtype=torch.bool)
        kept = flash_attention_mask(attention_mask=stand_in if values is None else values, **kwargs)
    if kept is None:
        return None
    sliced = attention_mask[:, attention_mask.shape[1] - kept.shape[1] :]
    return sliced if values is None else known_values(sliced, lambda: kept)


def _flash_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    # transformers' flash_attention_forward and _flash_attention_forward, in their order.
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [batch, len, heads, dim]
    # flash-attn takes 16-bit inputs: float32 ones (after norms peft keeps in float32) are
    # copied in transformers' choice of dtype (float32 weights cannot run: plan_lm refuses).
    if q.dtype == torch.float32:
        dtype = _target_dtype(query, module)
        q, k, v = (t.to(dtype) for t in (q, k, v))
    if attention_mask is None:  # no padding, or one packed row: no copies
        return _kernel(q, k, v, scaling), None
    batch, length = q.shape[:2]
    indices = _real_tokens(attention_mask)
    q, k, v = (t.reshape(-1, *t.shape[2:])[indices] for t in (q, k, v))  # _upad_input
    out = _kernel(q[None], k[None], v[None], scaling)[0]
    padded = out.new_zeros(batch * length, *out.shape[1:])  # _pad_input
    padded[indices] = out
    return padded.view(batch, length, *out.shape[1:]), None


def _target_dtype(query: torch.Tensor, module: nn.Module) -> torch.dtype:
    # transformers' get_target_dtype: the autocast's dtype, else a quantized model's config's
    # (lm_model marks it quantized, as transformers' quantizer does), else the weights'.
    try:
        from transformers.integrations.flash_attention import get_target_dtype
    except ImportError:  # an older transformers: the autocast's, else as they are
        device = query.device.type
        if torch.is_autocast_enabled(device):
            return torch.get_autocast_dtype(device)
        return query.dtype
    return get_target_dtype(query, module)


def _kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    # [batch, len, heads, dim] in and out; the sequences' bounds (cu_seqlens) decide no tensor's
    # size, and flash-attn draws dropout inside the kernel (none here: SDPA's CPU kernel would
    # fall back to one that holds the attention matrix).
    out = nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        is_causal=True,
        scale=scaling,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


def _real_tokens(mask: torch.Tensor) -> torch.Tensor:
    # The flat indices of the real tokens (_get_unpad_data's). On fake tensors, their count
    # from the values the step's batch described; unknown, every token (the most there are).
    if not _is_fake(mask):
        return torch.nonzero(mask.flatten()).flatten()
    values = _values_of(mask)
    with _outside_the_trace():
        count = mask.numel() if values is None else int(values.count_nonzero())
    return mask.new_zeros(count, dtype=torch.long)
