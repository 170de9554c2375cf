"""bigbatch: train with the batch size you want on the memory you have.

Exact gradient accumulation (the update equals the big-batch update whatever the micro-batch
sizes), memory planning and OOM recovery, for plain PyTorch loops.
"""

from bigbatch.accumulate import (
    Accumulator,
    EmptyWindowWarning,
    NonFiniteGradientWarning,
    StepResult,
    scale_grads_,
)
from bigbatch.counts import MicroBatchCount, count_tokens, resolve_count
from bigbatch.inexact import (
    InexactAccumulationWarning,
    InexactLayer,
    find_inexact_layers,
    freeze_batchnorm,
)
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
    "StepResult",
    "__version__",
    "count_tokens",
    "find_inexact_layers",
    "freeze_batchnorm",
    "resolve_count",
    "scale_grads_",
]
