"""CUDA autocast's casting rules, applied to a trace that runs on the CPU.

A CUDA step is traced on CPU-placed fake tensors (the autograd engine wants a real CUDA context
for CUDA tensors, even fake ones), so ``torch.autocast("cpu")`` would apply the CPU's op lists,
which differ from CUDA's where memory is decided: on CUDA ``layer_norm``, ``group_norm``,
``softmax``, ``log_softmax`` and the losses run in float32 (their outputs, and what they save for
the backward, are twice the size), while on the CPU most of them run in the input's float16.

:func:`cuda_autocast_rules` makes the CPU autocast key follow CUDA's lists for as long as it is
entered: each op CUDA autocasts gets a kernel at ``AutocastCPU`` that casts as the CUDA kernel
does (``aten/src/ATen/autocast_mode.cpp``), and each op only the CPU casts falls through. The
table is checked against the ops torch registers for ``AutocastCUDA`` in this build
(``tests/memory/test_cuda_autocast.py``), so a torch that changes the lists fails a test instead
of predicting with stale rules.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._C import DispatchKey, DispatchKeySet, _ExcludeDispatchKeyGuard
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["CUDA_AUTOCAST_POLICY", "cuda_autocast_rules"]

_LOWER = "lower_precision_fp"  # cast floating inputs to the autocast dtype
_FP32 = "fp32"  # cast floating inputs to float32
_FP32_DTYPE = "fp32_set_opt_dtype"  # run with dtype=float32 (no separate cast) unless given
_PROMOTE = "promote"  # cast floating inputs to the widest among them
_BANNED = "banned"  # CUDA autocast raises (binary_cross_entropy): traced as it is

# torch's CUDA lists (docs: "CUDA Ops that can autocast to float16 / float32 / widest input
# type"), by the overload torch registers them under.
_LISTS = {
    _LOWER: """
        _convolution _convolution.deprecated conv1d conv2d conv3d conv_tbc conv_transpose1d
        conv_transpose2d.input conv_transpose3d.input convolution cudnn_convolution
        cudnn_convolution_transpose prelu addmm addmv addr matmul einsum mm mv linalg_vecdot
        linear addbmm baddbmm bmm chain_matmul linalg_multi_dot _thnn_fused_lstm_cell
        _thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell _cudnn_rnn
        _scaled_dot_product_flash_attention scaled_dot_product_attention
    """,
    _FP32: """
        acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan
        pow.Tensor_Scalar pow.Tensor_Tensor pow.Scalar softplus layer_norm native_layer_norm
        group_norm rms_norm frobenius_norm.dim nuclear_norm nuclear_norm.dim cosine_similarity
        poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div
        l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss multilabel_margin_loss
        soft_margin_loss triplet_margin_loss multi_margin_loss
        binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp linalg_matrix_sqrth
        norm.Scalar norm.ScalarOpt_dim upsample_nearest1d upsample_nearest2d
        upsample_nearest3d _upsample_nearest_exact1d _upsample_nearest_exact2d
        _upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d
        _upsample_bilinear2d_aa upsample_trilinear3d upsample_bicubic2d _upsample_bicubic2d_aa
    """,
    _FP32_DTYPE: """
        prod prod.dim_int softmax.int log_softmax.int cumprod cumsum linalg_vector_norm
        linalg_matrix_norm linalg_matrix_norm.str_ord sum sum.dim_IntList
    """,
    _PROMOTE: """
        addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put scatter_add
        tensordot
    """,
}
CUDA_AUTOCAST_POLICY: dict[str, str] = {
    op: policy for policy, ops in _LISTS.items() for op in ops.split()
} | {"binary_cross_entropy": _BANNED}

_NO_AUTOCAST = DispatchKeySet(DispatchKey.AutocastCPU)
_lock = threading.Lock()


def _op(name: str) -> Any:
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def _has_op(name: str) -> bool:
    try:
        _op(name)
    except AttributeError:
        return False
    return True


def _eligible(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


def _kernel(name: str, policy: str) -> Callable[..., Any]:
    """The CUDA autocast kernel of ``name``, for CPU tensors: cast, then run the op with
    autocast off (as the C++ kernels do, so that what it calls is not cast again)."""
    op = _op(name)
    dtype_at = next((i for i, a in enumerate(op._schema.arguments) if a.name == "dtype"), None)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        with _ExcludeDispatchKeyGuard(_NO_AUTOCAST):
            if policy == _FP32_DTYPE:
                first = args[0] if args else None
                if _eligible(first) and dtype_at is not None:
                    if dtype_at < len(args):
                        if args[dtype_at] is None:
                            args = (*args[:dtype_at], torch.float32, *args[dtype_at + 1 :])
                    elif kwargs.get("dtype") is None:
                        kwargs = {**kwargs, "dtype": torch.float32}
                return op(*args, **kwargs)
            if policy == _PROMOTE:
                floats = [t.dtype for t in tree_flatten((args, kwargs))[0] if _eligible(t)]
                to = max(floats, key=lambda d: torch.finfo(d).bits, default=None)
            else:
                to = torch.float32 if policy == _FP32 else torch.get_autocast_dtype("cpu")

            def cast(t: Any) -> Any:
                return t.to(to) if to is not None and _eligible(t) and t.dtype != to else t

            return op(*tree_map(cast, args), **tree_map(cast, kwargs))

    return kernel


@contextlib.contextmanager
def cuda_autocast_rules() -> Iterator[None]:
    """While entered, ``torch.autocast("cpu", dtype)`` casts as ``torch.autocast("cuda",
    dtype)`` does. Process-wide (torch's dispatcher has one table): the planner enters it only
    around a CUDA target's trace, and one trace at a time.

    >>> x, w = torch.randn(2, 8), torch.randn(8, 8)
    >>> with cuda_autocast_rules(), torch.autocast("cpu", dtype=torch.float16):
    ...     torch.nn.functional.layer_norm(x @ w, (8,)).dtype
    torch.float32
    """
    with _lock:
        lib = torch.library.Library("aten", "IMPL")
        try:
            with warnings.catch_warnings():  # "Overriding a previously registered kernel"
                warnings.simplefilter("ignore")
                for name, policy in CUDA_AUTOCAST_POLICY.items():
                    # An op the list names that this torch does not have (the list is
                    # torch's newest; torch 2.11 has no linalg_matrix_sqrth) is nothing to cast.
                    if policy != _BANNED and _has_op(name):
                        lib.impl(name, _kernel(name, policy), "AutocastCPU")
                cpu_only = set(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU"))
                for qualified in sorted(cpu_only):
                    name = qualified.removeprefix("aten::")
                    if qualified.startswith("aten::") and name not in CUDA_AUTOCAST_POLICY:
                        lib.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")
            yield
        finally:
            lib._destroy()
