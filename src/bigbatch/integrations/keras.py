"""Exact gradient accumulation for Keras 3's ``model.fit`` (torch backend).

Keras's ``optimizer(gradient_accumulation_steps=N)`` averages the micro-batch gradients with
equal weights (keras#20241): a short last batch is over-weighted, and an epoch that ends inside
a window never applies it. Wrap the model instead; its own code stays as it is:

.. code-block:: python

    model = AccumulatingModel(model, micro_batches=4)     # the one changed line
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=32, epochs=5)

The wrapper's ``train_step`` weights each batch's loss by its count before ``backward`` (keeps
the gradients between batches), and applies the optimizer once per window, with the gradient
divided by the window's true count; the epoch's last partial window is applied at the end of
its last batch (before validation). ``count="samples"`` suits Keras's default
``"sum_over_batch_size"`` reduction, with or without ``sample_weight``; ``count="weights"``
suits ``reduction="mean_with_sample_weight"`` (a padded token loss with a 0/1 mask as
``sample_weight``). ``optimizer.iterations`` counts optimizer steps, so schedules do too.
"""

from __future__ import annotations

import os
from typing import Any, Literal

import torch

from bigbatch.counts import resolve_count
from bigbatch.integrations import require
from bigbatch.integrations._window import adapter_window

if os.environ.get("KERAS_BACKEND", "torch") != "torch":
    raise ImportError(
        f"bigbatch.integrations.keras works with Keras's torch backend, but KERAS_BACKEND="
        f"{os.environ['KERAS_BACKEND']!r}: set KERAS_BACKEND=torch before importing keras"
    )
os.environ.setdefault("KERAS_BACKEND", "torch")
keras: Any = require("keras", "keras")
if keras.backend.backend() != "torch":
    raise ImportError(
        f"Keras was imported with the {keras.backend.backend()!r} backend: set "
        "KERAS_BACKEND=torch before the first `import keras`"
    )
from keras.src.trainers.data_adapters import data_adapter_utils  # noqa: E402

__all__ = ["AccumulatingModel", "ExactAccumulation"]


class AccumulatingModel(keras.Model):
    """Wrap a Keras model so that ``fit`` accumulates ``micro_batches`` batches (or
    ``n_acc`` samples/weight) per optimizer step, exactly. Predicting, evaluating and saving
    go to the wrapped ``model`` as usual (``wrapper.model``).

    >>> import keras
    >>> inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> AccumulatingModel(inner, micro_batches=4).window.micro_batches
    4
    """

    def __init__(
        self,
        model: Any,
        micro_batches: int | None = None,
        *,
        n_acc: float | None = None,
        count: Literal["samples", "weights"] = "samples",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if count not in ("samples", "weights"):
            raise ValueError(f"count must be 'samples' or 'weights', got {count!r}")
        if not isinstance(model, keras.Model):
            raise TypeError(f"wrap a keras.Model, got {type(model).__name__}")
        self.model = model
        self.window = adapter_window(micro_batches, n_acc)
        self.unit = count

    def call(self, inputs: Any, training: bool | None = None) -> Any:
        return self.model(inputs, training=training)

    def compile(self, *args: Any, **kwargs: Any) -> None:
        super().compile(*args, **kwargs)
        if getattr(self.optimizer, "gradient_accumulation_steps", None):
            raise ValueError(
                "the optimizer accumulates already (gradient_accumulation_steps="
                f"{self.optimizer.gradient_accumulation_steps}), with equal weights: remove it; "
                "AccumulatingModel(model, micro_batches=N) accumulates exactly"
            )

    def train_step(self, data: Any) -> Any:
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        y_pred = self(x, training=True)
        loss = self._compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
        )
        samples = next(i for i in keras.tree.flatten(x) if i is not None).shape[0]
        self._loss_tracker.update_state(loss, sample_weight=samples)
        if self.unit == "weights":
            if sample_weight is None:
                raise ValueError(
                    "count='weights' normalises by the sum of sample_weight, but this batch has "
                    "none: pass sample_weight to fit, or use count='samples'"
                )
            mb = resolve_count(samples, weight=torch.as_tensor(sample_weight).sum())
        else:
            mb = resolve_count(int(samples))
        factor = self.window.add(mb)
        # No zero_grad here: the gradients add up over the window.
        self.optimizer.scale_loss(loss * factor).backward()
        if self.window.full:
            self.apply_window()
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def apply_window(self) -> None:
        """Apply the open window's gradient, divided by its true count (the callback that
        ``fit`` adds calls this at the end of each epoch)."""
        if self.window.micro == 0:
            return
        factor = self.window.close()
        weights = self.trainable_weights[:]
        if factor is not None:
            grads = [None if v.value.grad is None else v.value.grad * factor for v in weights]
            with torch.no_grad():
                self.optimizer.apply(grads, weights)
        self.zero_grad()

    def fit(self, *args: Any, callbacks: list[Any] | None = None, **kwargs: Any) -> Any:
        return super().fit(*args, callbacks=[*(callbacks or []), _SettleWindow(self)], **kwargs)


class _SettleWindow(keras.callbacks.Callback):
    """Apply the epoch's last partial window at the end of its last batch, before validation
    (Keras calls ``on_epoch_end`` after validation: the fallback when the step count is
    unknown)."""

    def __init__(self, wrapper: AccumulatingModel) -> None:
        super().__init__()
        self.wrapper = wrapper

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        if self.wrapper.window.micro:  # a fit stopped mid-window earlier: start clean
            self.wrapper.window.reset()
            self.wrapper.zero_grad()

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        steps = self.params.get("steps")
        if steps is not None and batch + 1 >= steps:
            self.wrapper.apply_window()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.wrapper.apply_window()


# The name before 0.2, shared with the Lightning callback; kept as an alias for one release.
ExactAccumulation = AccumulatingModel
