"""bigbatch: train with the batch size you want on the memory you have.

Exact gradient accumulation (the update equals the big-batch update whatever the micro-batch
sizes), memory planning and OOM recovery, for plain PyTorch loops. The headline features are
importable from here: :class:`Accumulator` and :class:`AccumulatingOptimizer`, the count objects
(:func:`samples`, :func:`tokens`, :func:`weights`), :func:`cached_backward` for losses that
couple the samples, :class:`OOMBackoff` with :func:`run_window`, and planning
(:func:`plan` = :func:`plan_under_budget`, :func:`plan_micro_batch`, :class:`StepSpec`), all
loaded on first use.
``bigbatch.verify.verify`` proves accumulation exact on your model.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the names are, for type checkers; loaded on first use below
    from bigbatch.accumulate import (
        Accumulator,
        EmptyWindowWarning,
        NonFiniteGradientWarning,
        StepResult,
        scale_grads_,
    )
    from bigbatch.backoff import OOMBackoff, run_window
    from bigbatch.counts import (
        MicroBatchCount,
        count_tokens,
        resolve_count,
        samples,
        tokens,
        weights,
    )
    from bigbatch.coupled import cached_backward
    from bigbatch.inexact import (
        InexactAccumulationWarning,
        InexactLayer,
        find_inexact_layers,
        freeze_batchnorm,
    )
    from bigbatch.memory.plan import Plan, plan_micro_batch, plan_under_budget
    from bigbatch.memory.plan import plan_under_budget as plan
    from bigbatch.memory.step import StepSpec
    from bigbatch.optim import AccumulatingOptimizer

__version__ = "0.1.0"

__all__ = [
    "AccumulatingOptimizer",
    "Accumulator",
    "EmptyWindowWarning",
    "InexactAccumulationWarning",
    "InexactLayer",
    "MicroBatchCount",
    "NonFiniteGradientWarning",
    "OOMBackoff",
    "Plan",
    "StepResult",
    "StepSpec",
    "__version__",
    "cached_backward",
    "count_tokens",
    "find_inexact_layers",
    "freeze_batchnorm",
    "plan",
    "plan_micro_batch",
    "plan_under_budget",
    "resolve_count",
    "run_window",
    "samples",
    "scale_grads_",
    "tokens",
    "weights",
]

# Every name is imported when first asked for: `import bigbatch` (and `bigbatch --help`) does not
# load torch until something needs it.
_LAZY = {
    **dict.fromkeys(
        (
            "Accumulator",
            "EmptyWindowWarning",
            "NonFiniteGradientWarning",
            "StepResult",
            "scale_grads_",
        ),
        "bigbatch.accumulate",
    ),
    **dict.fromkeys(("OOMBackoff", "run_window"), "bigbatch.backoff"),
    **dict.fromkeys(
        ("MicroBatchCount", "count_tokens", "resolve_count", "samples", "tokens", "weights"),
        "bigbatch.counts",
    ),
    "cached_backward": "bigbatch.coupled",
    **dict.fromkeys(
        ("InexactAccumulationWarning", "InexactLayer", "find_inexact_layers", "freeze_batchnorm"),
        "bigbatch.inexact",
    ),
    **dict.fromkeys(("Plan", "plan_micro_batch", "plan_under_budget"), "bigbatch.memory.plan"),
    "StepSpec": "bigbatch.memory.step",
    "plan": "bigbatch.memory.plan:plan_under_budget",
    "AccumulatingOptimizer": "bigbatch.optim",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, _, attr = _LAZY[name].partition(":")
        value = getattr(importlib.import_module(module), attr or name)
        globals()[name] = value  # once
        return value
    raise AttributeError(f"module 'bigbatch' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
