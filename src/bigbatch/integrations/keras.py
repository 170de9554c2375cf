"""Exact gradient accumulation for Keras 3, on the torch, tensorflow and jax backends.

Keras's ``optimizer(gradient_accumulation_steps=N)`` averages the micro-batch gradients with
equal weights (keras#20241): a short last batch is over-weighted, and an epoch that ends inside
a window never applies it. For ``model.fit``, wrap the model; its own code stays as it is:

.. code-block:: python

    model = AccumulatingModel(model, micro_batches=4)     # the one changed line
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=32, epochs=5)

Each batch's gradient is weighted by its count (``count="samples"``: its samples, for Keras's
default ``"sum_over_batch_size"`` reduction with or without ``sample_weight``;
``count="weights"``: the sum of its ``sample_weight``, for ``reduction=
"mean_with_sample_weight"``, a padded token loss with a 0/1 mask), the optimizer steps once per
window with the summed gradient divided by the window's true count, and the epoch's last partial
window is applied with the epoch's last batch (before validation). ``optimizer.iterations``
counts optimizer steps, so schedules do too; callbacks, validation, ``predict`` and saving the
wrapped model (``wrapper.model.save(...)``) are Keras's own.

For a custom training loop (``tf.GradientTape``, ``jax.grad``, torch), wrap the optimizer
instead: :class:`AccumulatingOptimizer`. Without ``KERAS_BACKEND`` set, importing this module
chooses the torch backend (torch is always installed with bigbatch).
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Literal

from bigbatch.accumulate import EmptyWindowWarning
from bigbatch.counts import resolve_count
from bigbatch.integrations import require
from bigbatch.integrations._window import adapter_window

os.environ.setdefault("KERAS_BACKEND", "torch")
keras: Any = require("keras", "keras")
BACKEND: str = keras.backend.backend()
if BACKEND not in ("torch", "tensorflow", "jax"):
    raise ImportError(
        f"bigbatch.integrations.keras supports Keras's torch, tensorflow and jax backends, not "
        f"{BACKEND!r}: set KERAS_BACKEND before the first `import keras`"
    )
from keras import ops  # noqa: E402
from keras.src.trainers.data_adapters import data_adapter_utils  # noqa: E402

__all__ = ["BACKEND", "AccumulatingModel", "AccumulatingOptimizer"]


class AccumulatingModel(keras.Model):
    """Wrap a Keras model so that ``fit`` accumulates ``micro_batches`` batches (or
    ``n_acc`` samples/weight) per optimizer step, exactly, on any backend. Predicting,
    evaluating and saving go to the wrapped ``model`` as usual (``wrapper.model``).

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
        self.window = adapter_window(micro_batches, n_acc, count_name="n_acc")
        self.unit = count
        # On tensorflow and jax the step is compiled: the window lives in variables.
        self.state: _GraphWindow | None = None
        if BACKEND != "torch" and model.built:
            self._make_state()
        if model.built:
            # Built with its model: BackupAndRestore, load_weights and summary() take it
            # before any call (its weights are the model's, its window's made above).
            self.built = True

    def _make_state(self) -> None:
        self.state = _GraphWindow(self.model.trainable_variables)
        # Tracked by the model, so that jax's compiled step carries them in its state.
        self.window_variables = self.state.variables

    def call(self, inputs: Any, training: bool | None = None) -> Any:
        return self.model(inputs, training=training)

    def save(self, filepath: Any, *args: Any, **kwargs: Any) -> Any:
        """Save the wrapped model, a plain Keras model that ``keras.models.load_model`` reads
        without bigbatch (accumulation is the training's, not the model's): what
        ``ModelCheckpoint("ck.keras")`` writes each epoch. To resume training exactly, with
        the optimizer's state and the window, use ``save_weights`` on the wrapper."""
        return self.model.save(filepath, *args, **kwargs)

    def load_weights(self, filepath: Any, *args: Any, **kwargs: Any) -> Any:
        """Load what ``save_weights`` wrote, the optimizer's state included: a compiled
        wrapper's optimizer is built first, since Keras skips (with only a warning) the saved
        state of an optimizer not built yet, and a resumed Adam would restart from step 0."""
        optimizer = getattr(self, "optimizer", None)
        if optimizer is not None and not optimizer.built and self.built:
            optimizer.build(self.trainable_variables)
        return super().load_weights(filepath, *args, **kwargs)

    def get_weights(self) -> list[Any]:
        """The wrapped model's weights (a plain model's list; the window's sums are no weights)."""
        return self.model.get_weights()

    def set_weights(self, weights: list[Any]) -> None:
        """Set the wrapped model's weights from a plain model's list."""
        self.model.set_weights(weights)

    def compile(self, *args: Any, **kwargs: Any) -> None:
        super().compile(*args, **kwargs)
        _refuse_misuse(self.optimizer)
        self._refuse_strategy()
        float16 = any(
            getattr(layer, "compute_dtype", None) == "float16"
            for layer in self.model._flatten_layers()
        )
        if float16 and not isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer):
            raise ValueError(
                "the model computes in float16 (built under mixed_float16) but the optimizer "
                "scales no loss, so small gradients underflow to 0: compile while the policy "
                "is mixed_float16 (Keras then wraps the optimizer), or pass "
                "keras.optimizers.LossScaleOptimizer(optimizer); on tensorflow and jax use "
                "mixed_bfloat16"
            )

    def _refuse_strategy(self) -> None:
        """A model made inside a ``strategy.scope()`` keeps that strategy, also when compiled
        and fit outside it (where ``_refuse_misuse`` sees none)."""
        for held in (self, self.model):
            strategy = getattr(held, "_distribute_strategy", None)
            if strategy is not None and strategy.num_replicas_in_sync > 1:
                raise ValueError(STRATEGY_REFUSED)

    def fit(self, *args: Any, callbacks: list[Any] | None = None, **kwargs: Any) -> Any:
        self._refuse_strategy()
        if BACKEND != "torch":
            if self.state is None:
                if not self.model.built:
                    raise ValueError(
                        "build the wrapped model before fit (a keras.Input first layer, or "
                        "`model.build(input_shape)`): the window's sums take its weights' shapes"
                    )
                self._make_state()
            optimizer = getattr(self, "optimizer", None)  # None before compile: Keras says so
            if optimizer is not None and not optimizer.built:  # not in a compiled step
                optimizer.build(self.trainable_variables)
        # First, so that the user's callbacks (ModelCheckpoint, EarlyStopping) see the epoch's
        # partial window applied where it is applied at the epoch's end.
        return super().fit(*args, callbacks=[_SettleWindow(self), *(callbacks or [])], **kwargs)

    def train_step(self, *args: Any) -> Any:
        if BACKEND == "torch":
            return self._torch_step(*args)
        if BACKEND == "tensorflow":
            return self._tensorflow_step(*args)
        return self._jax_step(*args)

    def _count(self, x: Any, sample_weight: Any) -> Any:
        """The batch's count: its samples, or the sum of its weights."""
        if self.unit == "samples":
            return ops.shape(next(i for i in keras.tree.flatten(x) if i is not None))[0]
        if sample_weight is None:
            raise ValueError(
                "count='weights' normalises by the sum of sample_weight, but this batch has "
                "none: pass sample_weight to fit, or use count='samples'"
            )
        return ops.sum(sample_weight)

    def _torch_step(self, data: Any) -> Any:
        import torch

        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        y_pred = self(x, training=True)
        loss = self._compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
        )
        samples = next(i for i in keras.tree.flatten(x) if i is not None).shape[0]
        self._loss_tracker.update_state(loss, sample_weight=samples)
        if self.unit == "weights":
            mb = resolve_count(samples, weight=torch.as_tensor(self._count(x, sample_weight)))
        else:
            mb = resolve_count(int(samples))
        factor = self.window.add(mb)
        # No zero_grad here: the gradients add up over the window.
        self.optimizer.scale_loss(loss * factor).backward()
        if self.window.full:
            self.apply_window()
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _tensorflow_step(self, data: Any) -> Any:
        import tensorflow as tf

        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self._compute_loss(
                x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
            )
            samples = tf.shape(next(i for i in keras.tree.flatten(x) if i is not None))[0]
            self._loss_tracker.update_state(loss, sample_weight=samples)
        grads = tape.gradient(loss, self.trainable_variables)
        state = self._graph_state()
        state.add(grads, self._count(x, sample_weight))
        ops.cond(
            state.full(self.window),
            lambda: state.apply(self.optimizer, self.trainable_variables),
            lambda: None,
        )
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _jax_step(self, state_in: Any, data: Any) -> Any:
        import jax
        import jax.numpy as jnp

        trainable, non_trainable, optimizer_vars, metrics_vars = state_in
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
        (_, aux), grads = grad_fn(
            trainable,
            non_trainable,
            metrics_vars,
            x,
            y,
            sample_weight,
            training=True,
            optimizer_variables=optimizer_vars,
        )
        unscaled_loss, y_pred, non_trainable, metrics_vars = aux
        state = self._graph_state()
        values = list(non_trainable)
        everything = self.non_trainable_variables
        at = [next(i for i, u in enumerate(everything) if u is v) for v in state.variables]
        window = state.unflatten([values[i] for i in at])
        n = jnp.asarray(self._count(x, sample_weight), window["count"].dtype)
        sums = [
            s + g.astype(s.dtype) * n.astype(s.dtype)
            for s, g in zip(window["sums"], grads, strict=True)
        ]
        count, micro = window["count"] + n, window["micro"] + 1
        batch = window["batch"] + 1
        full = state.full_from(self.window, count, micro, batch, window["steps"])
        empty = full & (count <= 0)  # every weight zero: skipped, as the core skips it
        full = full & (count > 0)
        mean = [s / jnp.maximum(count, 1e-30).astype(s.dtype) for s in sums]
        # jax has no side effects in a branch: compute the step, keep it where the window is full
        # (as Keras's own accumulation does on jax).
        stepped, new_optimizer = self.optimizer.stateless_apply(optimizer_vars, mean, trainable)
        trainable = [jnp.where(full, a, b) for a, b in zip(stepped, trainable, strict=True)]
        optimizer_vars = [
            jnp.where(full, a, b) for a, b in zip(new_optimizer, optimizer_vars, strict=True)
        ]
        closing = full | empty
        closed = {
            "sums": [jnp.where(closing, jnp.zeros_like(s), s) for s in sums],
            "count": jnp.where(closing, jnp.zeros_like(count), count),
            "micro": jnp.where(closing, 0, micro),
            "batch": batch,
            "steps": window["steps"],
            "skipped": window["skipped"] + empty.astype(window["skipped"].dtype),
        }
        for i, value in zip(at, state.flatten(closed), strict=True):
            values[i] = value
        logs, metrics_vars = self._update_metrics_variables(
            metrics_vars, unscaled_loss, x, y, y_pred, sample_weight
        )
        return logs, (trainable, values, optimizer_vars, metrics_vars)

    def _graph_state(self) -> _GraphWindow:
        if self.state is None:
            raise RuntimeError("AccumulatingModel.fit sets up the window; call fit, not train_step")
        return self.state

    def apply_window(self) -> None:
        """Apply the open window's gradient, divided by its true count (the callback that
        ``fit`` adds calls this at the end of each epoch where the step count is unknown)."""
        if BACKEND != "torch":
            if self.state is not None and int(ops.convert_to_numpy(self.state.micro)):
                self.state.apply(self.optimizer, self.trainable_variables)
            return
        if self.window.micro == 0:
            return
        factor = self.window.close()
        weights = self.trainable_weights[:]
        if factor is None:
            _warn_empty(1)
        else:
            import torch

            grads = [None if v.value.grad is None else v.value.grad * factor for v in weights]
            with torch.no_grad():
                self.optimizer.apply(grads, weights)
        self.zero_grad()


class _GraphWindow:
    """A window in Keras variables, for the compiled steps of tensorflow and jax: each weight's
    count-weighted gradient sum, the count, the batches in the window, the batches of the epoch
    so far and the epoch's length (``-1`` unknown), and the windows skipped for a zero count."""

    def __init__(self, weights: list[Any]) -> None:
        count_dtype = "float64" if _has_float64() else "float32"
        self.sums = [
            keras.Variable(ops.zeros(w.shape, w.dtype), trainable=False, name="window_sum")
            for w in weights
        ]
        self.count = keras.Variable(0.0, dtype=count_dtype, trainable=False, name="window_count")
        self.micro = keras.Variable(0, dtype="int32", trainable=False, name="window_micro")
        self.batch = keras.Variable(0, dtype="int32", trainable=False, name="epoch_batch")
        self.steps = keras.Variable(-1, dtype="int32", trainable=False, name="epoch_steps")
        self.skipped = keras.Variable(0, dtype="int32", trainable=False, name="windows_skipped")
        self.connected: list[bool] | None = None

    @property
    def variables(self) -> list[Any]:
        return [*self.sums, self.count, self.micro, self.batch, self.steps, self.skipped]

    @staticmethod
    def flatten(parts: dict[str, Any]) -> list[Any]:
        scalars = [parts[k] for k in ("count", "micro", "batch", "steps", "skipped")]
        return [*parts["sums"], *scalars]

    def unflatten(self, values: list[Any]) -> dict[str, Any]:
        n = len(self.sums)
        keys = ("count", "micro", "batch", "steps", "skipped")
        return {"sums": values[:n], **dict(zip(keys, values[n:], strict=True))}

    def add(self, grads: list[Any], n: Any) -> None:
        # The backend's own arithmetic on the variables' values: keras.ops would compute
        # float64 in float32 on torch and jax (keras.backend.result_type maps 64 to 32 bits
        # there), which a float64 model's window must not.
        self.connected = [g is not None for g in grads]
        for s, g in zip(self.sums, grads, strict=True):
            if g is not None:
                s.assign(s.value + ops.cast(g, s.dtype) * ops.cast(n, s.dtype))
        self.count.assign(self.count.value + ops.cast(n, self.count.dtype))
        self.micro.assign_add(1)
        self.batch.assign_add(1)

    def full(self, window: Any) -> Any:
        return self.full_from(window, self.count, self.micro, self.batch, self.steps)

    @staticmethod
    def full_from(window: Any, count: Any, micro: Any, batch: Any, steps: Any) -> Any:
        """Whether the window is complete: its batches (or count) reached, or the epoch's last
        batch (where the epoch's length is known)."""
        size = (
            micro >= window.micro_batches
            if window.micro_batches
            else count >= ops.cast(window.target_count, count.dtype)
        )
        return ops.logical_or(size, ops.logical_and(steps > 0, batch >= steps))

    def apply(self, optimizer: Any, weights: list[Any]) -> None:
        """One optimizer step with the mean gradient, unless the window's count is 0 (all its
        weights zero: skipped and counted, as the core skips it), then an empty window."""

        def step() -> None:
            connected = self.connected or [True] * len(self.sums)
            grads = [
                s.value / ops.cast(self.count.value, s.dtype) if c else None
                for s, c in zip(self.sums, connected, strict=True)
            ]
            optimizer.apply(grads, weights)

        def skip() -> None:
            self.skipped.assign_add(1)

        if BACKEND == "tensorflow":  # perhaps in a compiled step
            ops.cond(self.count > 0, step, skip)
        elif float(ops.convert_to_numpy(self.count)) > 0:
            step()
        else:
            skip()
        self.clear()

    def clear(self) -> None:
        for s in self.sums:
            s.assign(ops.zeros(s.shape, s.dtype))
        self.count.assign(ops.zeros((), self.count.dtype))
        self.micro.assign(0)


class _SettleWindow(keras.callbacks.Callback):
    """Start each epoch with an empty window and the epoch's length known to the step, and
    apply a partial window left open at the epoch's end. On torch the window is applied at the
    end of the epoch's last batch (before validation); where the step count is unknown, at the
    epoch's end (after validation: Keras's order)."""

    def __init__(self, wrapper: AccumulatingModel) -> None:
        super().__init__()
        self.wrapper = wrapper
        self.skipped = 0

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        w = self.wrapper
        if BACKEND == "torch":
            if w.window.micro:  # a fit stopped mid-window earlier: start clean
                w.window.reset()
                w.zero_grad()
            return
        state = w._graph_state()
        if int(ops.convert_to_numpy(state.micro)):
            state.clear()
        state.batch.assign(0)
        steps = self.params.get("steps")
        state.steps.assign(-1 if steps is None else int(steps))

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        steps = self.params.get("steps")
        if BACKEND == "torch" and steps is not None and batch + 1 >= steps:
            self.wrapper.apply_window()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.wrapper.apply_window()
        if BACKEND != "torch":
            skipped = int(ops.convert_to_numpy(self.wrapper._graph_state().skipped))
            if skipped > self.skipped:
                _warn_empty(skipped - self.skipped)
            self.skipped = skipped


class AccumulatingOptimizer:
    """Wraps a Keras optimizer for a custom training loop, so that it steps once per
    ``micro_batches`` batches with the gradient weighted by each batch's count: the form seed
    002's users know (``Optimizer(Adam(), steps=N)``), exact where theirs weights every batch
    alike. It is no optimizer itself (``compile`` and ``apply_gradients`` do not take it): for
    ``model.fit`` wrap the model, :class:`AccumulatingModel`.

    Give each batch's gradient of its mean loss and its count (samples, tokens, weight);
    :meth:`apply` returns True when it stepped. At the end of an epoch, :meth:`flush` applies a
    partial window. Eager loops on any backend (``tf.GradientTape``, ``jax.grad``, torch):

    >>> import keras
    >>> w = keras.Variable([1.0, 2.0])
    >>> acc = AccumulatingOptimizer(keras.optimizers.SGD(0.1), micro_batches=2)
    >>> acc.apply([keras.ops.ones(2)], [w], count=3), acc.apply([keras.ops.ones(2)], [w], count=1)
    (False, True)
    >>> [round(float(v), 6) for v in keras.ops.convert_to_numpy(w)]
    [0.9, 1.9]
    """

    def __init__(self, optimizer: Any, micro_batches: int) -> None:
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int):
            raise TypeError(f"micro_batches must be an int, got {micro_batches!r}")
        if micro_batches <= 0:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        _refuse_misuse(optimizer)
        self.optimizer = optimizer
        self.micro_batches = micro_batches
        self.window: _GraphWindow | None = None

    def apply(self, grads: list[Any], variables: list[Any], *, count: float) -> bool:
        """Add one batch's gradients (of its mean loss) with its ``count``; step when the
        window has ``micro_batches`` batches."""
        if self.window is None:
            self.window = _GraphWindow(variables)
            if not self.optimizer.built:
                self.optimizer.build(variables)
        window = self.window
        window.add(list(grads), count)
        if BACKEND == "tensorflow":  # eager, or inside the user's tf.function
            full = window.micro >= self.micro_batches
            ops.cond(full, lambda: window.apply(self.optimizer, variables), lambda: None)
            return full
        _refuse_tracing(
            window.micro, "apply()", "jit the gradient function, as the docs' loop does"
        )
        if int(ops.convert_to_numpy(window.micro)) < self.micro_batches:
            return False
        window.apply(self.optimizer, variables)
        return True

    def flush(self, variables: list[Any]) -> bool:
        """Apply a partial window (the epoch's last batches); False when there is none."""
        if self.window is None:
            return False
        _refuse_tracing(self.window.micro, "flush()", "call it after the epoch's loop")
        if not int(ops.convert_to_numpy(self.window.micro)):
            return False
        self.window.apply(self.optimizer, variables)
        return True


def _refuse_tracing(value: Any, what: str, fix: str) -> None:
    """``what`` reads the window's state in Python, which a compiled function (``jax.jit``,
    ``tf.function``) cannot: one line with the fix instead of the framework's tracer error."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        if tf.inside_function():
            raise RuntimeError(f"{what} cannot run inside tf.function: {fix}")
    elif BACKEND == "jax":
        import jax

        if isinstance(getattr(value, "value", value), jax.core.Tracer):
            raise RuntimeError(f"{what} cannot run inside jax.jit: {fix}")


def _warn_empty(windows: int) -> None:
    warnings.warn(
        f"bigbatch: {windows} window(s) had a count of 0 (every sample_weight zero): skipped, "
        "the weights unchanged",
        EmptyWindowWarning,
        stacklevel=3,
    )


def _has_float64() -> bool:
    if BACKEND != "jax":
        return True
    import jax

    return bool(jax.config.read("jax_enable_x64"))


STRATEGY_REFUSED = (
    "a tf.distribute strategy with several replicas is not supported by bigbatch's Keras "
    "wrapper: train on one device, or use the torch backend with DDP (bigbatch.Accumulator)"
)


def _refuse_misuse(optimizer: Any) -> None:
    """One line for what the window cannot work with, before any step."""
    if getattr(optimizer, "gradient_accumulation_steps", None):
        raise ValueError(
            "the optimizer accumulates already (gradient_accumulation_steps="
            f"{optimizer.gradient_accumulation_steps}), with equal weights: remove it; "
            "bigbatch's wrapper accumulates exactly"
        )
    if BACKEND != "torch" and isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise ValueError(
            f"loss scaling (mixed_float16) is not supported on the {BACKEND} backend with "
            "bigbatch's Keras wrapper: use keras.mixed_precision.set_global_policy("
            '"mixed_bfloat16"), or the torch backend'
        )
    if BACKEND == "tensorflow":
        import tensorflow as tf

        if tf.distribute.has_strategy() and tf.distribute.get_strategy().num_replicas_in_sync > 1:
            raise ValueError(STRATEGY_REFUSED)
    if BACKEND == "jax" and keras.distribution.distribution() is not None:
        raise ValueError(
            "a keras.distribution (data or model parallel on jax) is not supported by "
            "bigbatch's Keras wrapper: unset it, or use the torch backend with DDP"
        )
