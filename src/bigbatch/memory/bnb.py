"""bitsandbytes' memory, as the planner traces it: quantized linear layers (QLoRA's 4-bit NF4
base, LLM.int8's 8-bit one) and the 8-bit and paged AdamW optimizers.

bitsandbytes' own modules quantize when moved to a GPU and run CUDA kernels, so a CPU trace on
fake tensors cannot run them. These stand-ins keep what decides the memory, from bitsandbytes'
source (``autograd/_functions.py``, ``backends/cuda/ops.py``, ``optim/optimizer.py``):

- **4-bit** (``Linear4bit``, ``quantize_4bit``): the weight packed two values a byte,
  ``[(out * in + 1) // 2, 1]`` uint8, with one absmax per 64 values: float32, or with double
  quantization (``bnb_4bit_use_double_quant``) uint8 plus a float32 per 256 of them and a
  256-entry code. Each training matmul (``MatMul4Bit``, many tokens) dequantizes the whole
  weight to the compute dtype, ``[out, in]``, multiplies and frees it; the backward does it
  again for the input's gradient. The layer's input is not saved (the weight has no gradient).
- **8-bit** (``Linear8bitLt``, ``MatMul8bitLt``): an int8 ``[out, in]`` weight and a float32
  scale a row. The forward casts the input to float16, quantizes it to int8 with a scale a row
  and saves the input; the backward dequantizes the weight to float16.
- **AdamW 8-bit** (``AdamW8bit``): two uint8 moments a parameter (float32 for tensors under
  4096 values) and a float32 absmax per 256 values of each. **Paged** optimizers keep their
  state in CUDA unified memory, outside PyTorch's allocator (moved to the CPU when the card is
  full): it is counted apart (:func:`paged_state_bytes`), not in the step's peak.

>>> layer = QuantizedLinear(64, 32, bits=4)
>>> layer.weight.shape, layer.weight.dtype
(torch.Size([1024, 1]), torch.uint8)
>>> quantized_bytes(4096, 4096, bits=4) / (4096 * 4096)  # a weight: half a byte, 1/64 of absmax
0.51593017578125
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "BNB_OPTIMIZERS",
    "BnbAdamW",
    "Params4bit",
    "QuantizedLinear",
    "is_packed",
    "paged_state_bytes",
    "quantize_linears",
    "quantized_bytes",
]

# bitsandbytes' optimizers as Hugging Face's TrainingArguments(optim=...) names them.
BNB_OPTIMIZERS = ("adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit")
_BLOCK_4BIT = 64  # bnb_4bit's blocksize in transformers' BitsAndBytesConfig
_BLOCK_NESTED = 256  # the absmax's own blocks under double quantization
_BLOCK_OPTIM = 256  # blockwise 8-bit optimizer state
_MIN_8BIT_SIZE = 4096  # smaller tensors keep float32 state (bitsandbytes' min_8bit_size)


def quantized_bytes(out_features: int, in_features: int, *, bits: int, nested: bool = True) -> int:
    """The bytes a quantized ``[out, in]`` weight keeps on the card (its statistics included).

    >>> quantized_bytes(300, 200, bits=4, nested=False)  # 30000 packed + 938 float32 absmax
    33752
    """
    n = out_features * in_features
    if bits == 8:
        return n + 4 * out_features
    if bits != 4:
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    blocks = math.ceil(n / _BLOCK_4BIT)
    if not nested:
        return (n + 1) // 2 + 4 * blocks
    return (n + 1) // 2 + blocks + 4 * math.ceil(blocks / _BLOCK_NESTED) + 4 * 256


class _Dequantized4bit(torch.autograd.Function):
    """``MatMul4Bit`` for many tokens: dequantize, ``linear``, free; again in the backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, packed: torch.Tensor, layer: QuantizedLinear) -> Any:
        ctx.layer = layer
        ctx.save_for_backward(packed)
        weight = layer.dequantized(x)
        return F.linear(x, weight, None if layer.bias is None else layer.bias.to(x.dtype))

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        weight = ctx.layer.dequantized(grad_out)
        return torch.matmul(grad_out, weight), None, None


class _Int8Matmul(torch.autograd.Function):
    """``MatMul8bitLt`` with a frozen int8 weight: the float16 and int8 copies of the input,
    the input saved, a float16 weight dequantized in the backward."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, int8_weight: torch.Tensor, layer: QuantizedLinear
    ) -> Any:
        ctx.layer, ctx.dtype = layer, x.dtype
        ctx.save_for_backward(x)
        rows = x.reshape(-1, x.shape[-1])
        half = rows.to(torch.float16)
        quantized = torch.empty_like(half, dtype=torch.int8)
        scales = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
        del half
        out = torch.empty(
            (*x.shape[:-1], layer.out_features), dtype=x.dtype, device=x.device
        )  # int8 x int8 into this, scaled
        del quantized, scales
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        (x,) = ctx.saved_tensors
        layer = ctx.layer
        weight = torch.empty(
            (layer.out_features, layer.in_features), dtype=torch.float16, device=grad_out.device
        )
        grad = torch.matmul(grad_out.to(torch.float16), weight).to(ctx.dtype)
        return grad.reshape(x.shape), None, None


class Params4bit(nn.Parameter):
    """A stand-in's packed 4-bit weight, under the name of bitsandbytes' class: the libraries
    around a QLoRA model recognise its weights by that name (accelerate's FSDP2 preparation
    leaves them whole on each rank, and keeps the other weights' dtype).

    >>> QuantizedLinear(8, 4).weight.__class__.__name__
    'Params4bit'
    """


def is_packed(p: torch.Tensor) -> bool:
    """Whether ``p`` is a quantized base's packed weight (bitsandbytes' ``Params4bit`` or
    ``Int8Params``, or the planner's 4-bit stand-in), by its class's name: what peft's
    ``prepare_model_for_kbit_training`` leaves in its dtype.

    >>> is_packed(QuantizedLinear(8, 4).weight), is_packed(nn.Linear(8, 4).weight)
    (True, False)
    """
    return type(p).__name__ in ("Params4bit", "Int8Params")


class QuantizedLinear(nn.Linear):
    """A frozen linear layer in bitsandbytes' 4- or 8-bit storage (see the module's docstring).
    An ``nn.Linear`` to peft, so LoRA adapters wrap it as they wrap ``Linear4bit``.

    >>> layer = QuantizedLinear(8, 4, bits=8)
    >>> layer(torch.zeros(2, 8)).shape
    torch.Size([2, 4])
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bits: int = 4,
        nested: bool = True,
        bias: bool = False,
        compute_dtype: torch.dtype = torch.bfloat16,
        device: Any = None,
        storage: torch.dtype = torch.uint8,
    ) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: no float weight
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.nested, self.compute_dtype = bits, nested, compute_dtype
        n = in_features * out_features
        # bitsandbytes packs two 4-bit values a byte into bnb_4bit_quant_storage's elements.
        packed = (n + 1) // (2 * storage.itemsize)
        shape = (packed, 1) if bits == 4 else (out_features, in_features)
        dtype = storage if bits == 4 else torch.int8
        weight = torch.empty(shape, dtype=dtype, device=device)
        kind = Params4bit if bits == 4 else nn.Parameter
        self.weight = kind(weight, requires_grad=False)
        blocks = math.ceil(n / _BLOCK_4BIT)
        if bits == 8:
            stats = [torch.empty(out_features, dtype=torch.float32, device=device)]
        elif nested:
            stats = [
                torch.empty(blocks, dtype=torch.uint8, device=device),
                torch.empty(math.ceil(blocks / _BLOCK_NESTED), dtype=torch.float32, device=device),
                torch.empty(256, dtype=torch.float32, device=device),
            ]
        else:
            stats = [torch.empty(blocks, dtype=torch.float32, device=device)]
        for i, t in enumerate(stats):
            self.register_buffer(f"quant_stat{i}", t)
        self.register_parameter(
            "bias",
            nn.Parameter(torch.empty(out_features, dtype=compute_dtype, device=device))
            if bias
            else None,
        )

    def dequantized(self, like: torch.Tensor) -> torch.Tensor:
        """The 4-bit weight in the compute dtype (and, nested, its absmax in float32 twice)."""
        if self.bits == 4 and self.nested:
            blocks = math.ceil(self.in_features * self.out_features / _BLOCK_4BIT)
            absmax = torch.empty(blocks, dtype=torch.float32, device=like.device)
            absmax = absmax + 0.0  # + offset: a second float32 copy, as bitsandbytes makes
            del absmax
        return torch.empty(
            (self.out_features, self.in_features), dtype=like.dtype, device=like.device
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bits == 8:
            return _Int8Matmul.apply(x, self.weight, self)
        dtype = x.dtype
        out = _Dequantized4bit.apply(x.to(self.compute_dtype), self.weight, self)
        return out.to(dtype)


def quantize_linears(
    model: nn.Module,
    *,
    bits: int,
    nested: bool = True,
    compute_dtype: torch.dtype = torch.bfloat16,
    skip: tuple[str, ...] = (),
    real: bool = False,
    storage: torch.dtype = torch.uint8,
) -> int:
    """Replace ``model``'s ``nn.Linear`` layers, and GPT-2's ``Conv1D`` ones (all but those
    whose name ends in one of ``skip``: transformers keeps the output head unquantized), by
    :class:`QuantizedLinear`, as ``from_pretrained(quantization_config=BitsAndBytesConfig(...))``
    does, 4-bit values packed in ``storage`` (``bnb_4bit_quant_storage``). Returns how many.
    ``real``: bitsandbytes' own ``Linear4bit`` / ``Linear8bitLt`` instead (they quantize when
    moved to a GPU), for a real step on one (the GPU evidence records those).

    >>> m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    >>> quantize_linears(m, bits=4, skip=("1",)), type(m[0]).__name__
    (1, 'QuantizedLinear')
    """
    replaced = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            shape = _linear_shape(child)
            if shape is None or any(full.endswith(s) for s in skip):
                continue
            new: nn.Module
            if real:
                new = _bitsandbytes_linear(child, bits, nested, compute_dtype, storage)
            else:
                new = QuantizedLinear(
                    *shape,
                    bits=bits,
                    nested=nested,
                    bias=child.bias is not None,
                    compute_dtype=compute_dtype,
                    device=child.weight.device,
                    storage=storage,
                )
            setattr(module, child_name, new)
            replaced += 1
    return replaced


def _linear_shape(layer: nn.Module) -> tuple[int, int] | None:
    """``(in_features, out_features)`` of a layer transformers' bitsandbytes quantizes: an
    ``nn.Linear`` itself (not a subclass: peft's and bitsandbytes' own are left alone), or
    transformers' ``Conv1D`` (GPT-2's), whose weight is stored ``[in, out]``; else None."""
    if type(layer) is nn.Linear:
        return layer.in_features, layer.out_features
    if type(layer).__name__ == "Conv1D" and type(layer).__module__.startswith("transformers."):
        weight: torch.Tensor = layer.weight  # type: ignore[assignment]
        return int(weight.shape[0]), int(weight.shape[1])
    return None


def _bitsandbytes_linear(
    linear: nn.Module,
    bits: int,
    nested: bool,
    compute_dtype: torch.dtype,
    storage: torch.dtype = torch.uint8,
) -> nn.Module:
    import bitsandbytes as bnb

    shape = _linear_shape(linear)
    if shape is None:
        raise TypeError(f"not a linear layer: {type(linear).__name__}")
    stored: torch.Tensor = linear.weight.data  # type: ignore[assignment]
    weight = stored if type(linear) is nn.Linear else stored.t()
    linear_bias: torch.Tensor | None = linear.bias  # type: ignore[assignment]
    bias = linear_bias is not None
    layer: nn.Module
    if bits == 4:
        layer = bnb.nn.Linear4bit(
            *shape,
            bias=bias,
            compute_dtype=compute_dtype,
            compress_statistics=nested,
            quant_type="nf4",
            quant_storage=storage,
        )
        layer.weight = bnb.nn.Params4bit(
            weight.to(compute_dtype),
            requires_grad=False,
            compress_statistics=nested,
            quant_type="nf4",
            quant_storage=storage,
        )
    else:
        layer = bnb.nn.Linear8bitLt(*shape, bias=bias, has_fp16_weights=False)
        layer.weight = bnb.nn.Int8Params(
            weight.to(torch.float16), requires_grad=False, has_fp16_weights=False
        )
    if linear_bias is not None:
        layer.bias = nn.Parameter(linear_bias.data.to(compute_dtype), requires_grad=False)
    return layer


class BnbAdamW(torch.optim.Optimizer):
    """bitsandbytes' AdamW as its state takes memory: 8-bit blockwise moments (``bits=8``) or
    float32 ones, on the card or paged (then kept out of the trace: :func:`paged_state_bytes`).
    Its fused update makes no temporaries, so the step only creates the state.

    >>> p = nn.Parameter(torch.zeros(8192)); p.grad = torch.zeros(8192)
    >>> opt = BnbAdamW([p], bits=8); opt.step()
    >>> sum(t.numel() * t.element_size() for t in opt.state[p].values())  # 2 x 8192 + 2 x 32 x 4
    16640
    """

    def __init__(self, params: Any, *, bits: int = 8, paged: bool = False, lr: float = 1e-3):
        super().__init__(params, {"lr": lr})
        self.bits, self.paged = bits, paged
        self.paged_bytes = 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or self.state.get(p):
                    continue
                eight = self.bits == 8 and p.numel() >= _MIN_8BIT_SIZE
                if self.paged:
                    self.paged_bytes += _state_bytes(p.numel(), eight)
                    self.state[p] = {"paged": True}
                    continue
                dtype = torch.uint8 if eight else torch.float32
                state = {
                    "state1": torch.zeros(p.shape, dtype=dtype, device=p.device),
                    "state2": torch.zeros(p.shape, dtype=dtype, device=p.device),
                }
                if eight:
                    blocks = math.ceil(p.numel() / _BLOCK_OPTIM)
                    state["absmax1"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
                    state["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
                self.state[p] = state


def _state_bytes(numel: int, eight: bool) -> int:
    if eight:
        return 2 * numel + 2 * 4 * math.ceil(numel / _BLOCK_OPTIM)
    return 2 * 4 * numel


def paged_state_bytes(optimizer: str, params: Any) -> int:
    """The unified memory a paged bitsandbytes optimizer keeps for ``params`` (0 for others).

    >>> paged_state_bytes("paged_adamw_32bit", [torch.zeros(10)])
    80
    """
    if not optimizer.startswith("paged_"):
        return 0
    eight = optimizer.endswith("8bit")
    return sum(_state_bytes(p.numel(), eight and p.numel() >= _MIN_8BIT_SIZE) for p in params)


def make_bnb_optimizer(name: str, params: Any, lr: float = 1e-3) -> torch.optim.Optimizer:
    """One of :data:`BNB_OPTIMIZERS`, by its Trainer name: bitsandbytes' own for real CUDA
    weights (a real step on a GPU), else the stand-in the planner traces."""
    if name not in BNB_OPTIMIZERS:
        raise ValueError(f"unknown bitsandbytes optimizer {name!r}: one of {BNB_OPTIMIZERS}")
    params = list(params)
    first = params[0] if params and isinstance(params[0], torch.Tensor) else None
    if first is not None and first.is_cuda and not _is_fake(first):
        import bitsandbytes as bnb

        kind = {
            "adamw_8bit": bnb.optim.AdamW8bit,
            "paged_adamw_8bit": bnb.optim.PagedAdamW8bit,
            "paged_adamw_32bit": bnb.optim.PagedAdamW32bit,
        }[name]
        return kind(params, lr=lr)
    return BnbAdamW(
        params, bits=8 if name.endswith("8bit") else 32, paged=name.startswith("paged_"), lr=lr
    )


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)
