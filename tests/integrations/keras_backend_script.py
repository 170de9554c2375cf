"""One Keras backend in its own process (Keras fixes its backend at import): fit with
AccumulatingModel, Keras's own gradient_accumulation_steps (the negative control) and a custom
loop with AccumulatingOptimizer, each against the big batch. Prints one JSON line.

    KERAS_BACKEND=jax python tests/integrations/keras_backend_script.py [--jit]
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import reference as ref

# Imported in setup(), once KERAS_BACKEND is read: importing this file does nothing else
# (pytest collects it for doctests).
keras: Any = None
np: Any = None
torch: Any = None
AccumulatingModel: Any = None
AccumulatingOptimizer: Any = None
backend = ""
JIT = False
LR = 0.5


def setup() -> None:
    global keras, np, torch, backend, JIT, AccumulatingModel, AccumulatingOptimizer
    backend = os.environ["KERAS_BACKEND"]
    if backend == "jax":
        import jax

        jax.config.update("jax_enable_x64", True)  # float64, for the 1e-12 check
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if backend == "tensorflow":  # two logical CPUs, for a strategy with two replicas
        import tensorflow as tf

        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2
        )
    import keras as keras_module
    import numpy
    import torch as torch_module

    from bigbatch.integrations import keras as adapter

    keras, np, torch = keras_module, numpy, torch_module
    AccumulatingModel, AccumulatingOptimizer = (
        adapter.AccumulatingModel,
        adapter.AccumulatingOptimizer,
    )
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    JIT = "--jit" in sys.argv


def build(tokens: bool) -> Any:
    keras.utils.set_random_seed(0)
    shape = (ref.SEQ, ref.FEATURES) if tokens else (ref.FEATURES,)
    return keras.Sequential([keras.Input(shape), keras.layers.Dense(ref.CLASSES)])


def weights(model: Any) -> tuple[torch.Tensor, torch.Tensor]:
    kernel, bias = (
        torch.as_tensor(np.asarray(keras.ops.convert_to_numpy(v))) for v in model.weights
    )
    return kernel.T.double().clone(), bias.double().clone()


def batches_for_keras(batches: list[ref.Batch], tokens: bool) -> list[tuple[np.ndarray, ...]]:
    """Padding (-100) becomes label 0 with sample weight 0: Keras's way to mask a token loss."""
    if not tokens:
        return [(x.numpy(), y.numpy()) for x, y in batches]
    return [(x.numpy(), y.clamp(min=0).numpy(), (y != -100).double().numpy()) for x, y in batches]


def fit(name: str, how: str, epochs: int = 1, n: int | None = None, sized: bool = True) -> float:
    batches, window = ref.SCENARIOS[name]
    n = n or window
    tokens = name == "tokens"
    inner = build(tokens)
    init = weights(inner)
    loss = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True,
        reduction="mean_with_sample_weight" if tokens else "sum_over_batch_size",
    )
    if how == "bigbatch":
        model = AccumulatingModel(inner, micro_batches=n, count="weights" if tokens else "samples")
        optimizer = keras.optimizers.SGD(learning_rate=LR)
    else:
        model = inner
        optimizer = keras.optimizers.SGD(learning_rate=LR, gradient_accumulation_steps=n)
    model.compile(optimizer=optimizer, loss=loss, jit_compile=JIT)
    data = batches_for_keras(batches, tokens)
    if sized:
        feed: Any = torch.utils.data.DataLoader(data, batch_size=None)
        model.fit(feed, epochs=epochs, verbose=0)
    else:  # an iterable without a length: the epoch's is unknown to the step

        class Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
            def __iter__(self) -> Any:
                return iter(data)

        model.fit(torch.utils.data.DataLoader(Stream(), batch_size=None), epochs=epochs, verbose=0)
    want_windows = ref.windows_of(batches, n) * epochs
    want = init
    for w in want_windows:
        want = ref.reference_update(*want, [w], LR)
    got = weights(inner)
    result = ref.rel_err(got, want, init)
    if how == "bigbatch":
        steps = int(keras.ops.convert_to_numpy(optimizer.iterations))
        assert steps == len(want_windows), (steps, len(want_windows))
    return result


def custom_loop(name: str) -> float:
    """The seeds' hand-written loop: gradients of the batch's mean loss, in the backend's own
    terms, handed to AccumulatingOptimizer with the batch's count."""
    batches, n = ref.SCENARIOS[name]
    tokens = name == "tokens"
    model = build(tokens)
    init = weights(model)
    opt = AccumulatingOptimizer(keras.optimizers.SGD(learning_rate=LR), micro_batches=n)
    variables = model.trainable_variables
    for x, y in batches:
        count = float((y != -100).sum())
        grads = _grads(model, x.numpy(), y.numpy(), count)
        opt.apply(grads, variables, count=count)
    opt.flush(variables)
    want = ref.reference_update(*init, ref.windows_of(batches, n), LR)
    return ref.rel_err(weights(model), want, init)


def _grads(model: Any, x: np.ndarray, y: np.ndarray, count: float) -> list[Any]:
    """The mean cross-entropy over the labelled samples or tokens, in float64."""
    mask = (y != -100).astype("float64")
    labels = np.where(y == -100, 0, y)
    if backend == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            per = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)
            loss = tf.reduce_sum(per * mask) / count
        return tape.gradient(loss, model.trainable_variables)
    if backend == "jax":
        import jax
        import jax.numpy as jnp

        trainable = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]

        def loss_fn(tv: list[Any]) -> Any:
            logits, _ = model.stateless_call(tv, non_trainable, x, training=True)
            logp = jax.nn.log_softmax(logits, axis=-1)
            per = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
            return jnp.sum(per * mask) / count

        return jax.grad(loss_fn)(trainable)
    for v in model.trainable_variables:
        v.value.grad = None
    logits = model(torch.as_tensor(x), training=True)
    per = torch.nn.functional.cross_entropy(
        logits.reshape(-1, ref.CLASSES), torch.as_tensor(labels).reshape(-1), reduction="none"
    )
    (per * torch.as_tensor(mask).reshape(-1)).sum().div(count).backward()
    return [v.value.grad for v in model.trainable_variables]


def misuse() -> dict[str, str]:
    """What the wrapper refuses, in one line each, and a window of weight 0 (skipped, warned)."""
    said: dict[str, str] = {}
    inner = build(False)
    for name, make in {
        "micro_batches=0": lambda: AccumulatingOptimizer(keras.optimizers.SGD(), micro_batches=0),
        "keras's own accumulation": lambda: AccumulatingModel(inner, micro_batches=2).compile(
            optimizer=keras.optimizers.SGD(gradient_accumulation_steps=2), loss="mse"
        ),
        "loss scaling": lambda: AccumulatingModel(inner, micro_batches=2).compile(
            optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()), loss="mse"
        ),
    }.items():
        try:
            make()
            said[name] = ""
        except (ValueError, TypeError) as exc:
            said[name] = str(exc)
    said["distributed"] = distributed(inner)
    said["compiled"] = compiled_misuse()
    model = AccumulatingModel(build(True), micro_batches=2, count="weights")
    optimizer = keras.optimizers.SGD(learning_rate=LR)
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="mean_with_sample_weight"
        ),
    )
    (x, y), _ = ref.SCENARIOS["tokens"][0][0], None
    x, y = x.numpy(), y.clamp(min=0).numpy()
    ones, zeros = np.ones(y.shape), np.zeros(y.shape)
    batches = [(x, y, ones), (x, y, ones), (x, y, zeros), (x, y, zeros)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(torch.utils.data.DataLoader(batches, batch_size=None), epochs=1, verbose=0)
    said["zero window"] = " ".join(str(w.message) for w in caught if "bigbatch" in str(w.message))
    said["steps after a zero window"] = str(int(keras.ops.convert_to_numpy(optimizer.iterations)))
    return said


def compiled_misuse() -> str:
    """apply() inside jax.jit, flush() inside tf.function: one line with the fix (they failed
    with the frameworks' tracer errors)."""
    w = keras.Variable(np.ones(2, "float32"))
    acc = AccumulatingOptimizer(keras.optimizers.SGD(0.1), micro_batches=2)
    try:
        if backend == "jax":
            import jax

            jax.jit(lambda g: acc.apply([g], [w], count=2))(np.ones(2, "float32"))
        elif backend == "tensorflow":
            import tensorflow as tf

            acc.apply([tf.ones(2)], [w], count=2)
            tf.function(lambda: acc.flush([w]))()
        return ""
    except Exception as exc:
        return str(exc).strip().splitlines()[-1]


def made_in_scope_compiled_outside() -> str:
    """The wrapper made inside a strategy's scope keeps the strategy: refused at compile
    although no strategy is current there (it failed inside fit with a merge_call error)."""
    import tensorflow as tf

    with tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():
        model = AccumulatingModel(build(False), micro_batches=2)
    try:
        model.compile(optimizer="sgd", loss="mse")
        return ""
    except ValueError as exc:
        return str(exc)


def distributed(inner: Any) -> str:
    """A strategy with two replicas (tensorflow) or a keras.distribution (jax): refused."""
    try:
        if backend == "tensorflow":
            import tensorflow as tf

            strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
            with strategy.scope():
                AccumulatingModel(build(False), micro_batches=2).compile(
                    optimizer="sgd", loss="mse"
                )
        elif backend == "jax":
            keras.distribution.set_distribution(keras.distribution.DataParallel())
            try:
                AccumulatingModel(inner, micro_batches=2).compile(optimizer="sgd", loss="mse")
            finally:
                keras.distribution.set_distribution(None)
        return ""
    except ValueError as exc:
        return str(exc)


def callbacks_and_saving() -> dict[str, Any]:
    """Keras's most common callbacks around a wrapped fit (ModelCheckpoint of the whole model
    crashed the first epoch; BackupAndRestore refused the wrapper as unbuilt on tensorflow),
    and what the saved files hold."""
    import tempfile

    batches, n = ref.SCENARIOS["uneven"]
    data = batches_for_keras(batches, False)
    x = data[0][0]
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        inner = build(False)
        model = AccumulatingModel(inner, micro_batches=n)
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))  # fmt: skip
        model.fit(
            torch.utils.data.DataLoader(data, batch_size=None), epochs=2, verbose=0,
            callbacks=[
                keras.callbacks.ModelCheckpoint(f"{tmp}/ck.keras"),
                keras.callbacks.ModelCheckpoint(f"{tmp}/ck.weights.h5", save_weights_only=True),
                keras.callbacks.BackupAndRestore(f"{tmp}/backup"),
            ],
        )  # fmt: skip
        plain = keras.models.load_model(f"{tmp}/ck.keras")  # no bigbatch needed to read it
        out["checkpoint_is_the_plain_model"] = bool(np.allclose(
            keras.ops.convert_to_numpy(plain.predict(x, verbose=0)),
            keras.ops.convert_to_numpy(model.predict(x, verbose=0)), rtol=0, atol=1e-12,
        ))  # fmt: skip
        # A new wrapper of a built model takes the wrapper's weights file before any call.
        again = AccumulatingModel(build(False), micro_batches=n)
        again.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))  # fmt: skip
        again.load_weights(f"{tmp}/ck.weights.h5")
        out["weights_file_into_a_new_wrapper"] = bool(np.allclose(
            keras.ops.convert_to_numpy(again.predict(x, verbose=0)),
            keras.ops.convert_to_numpy(model.predict(x, verbose=0)), rtol=0, atol=1e-12,
        ))  # fmt: skip
        # The docs' resume recipe (compile, then load_weights): Adam's state and its step
        # count come back too (Keras skipped them into an unbuilt optimizer, with a warning,
        # and the resumed run went 0.648 off), so one more epoch of each run agrees.
        loader = torch.utils.data.DataLoader(data, batch_size=None)
        model.fit(loader, epochs=1, verbose=0)
        again.fit(loader, epochs=1, verbose=0)
        out["resumed_adam_continues_exactly"] = bool(
            int(keras.ops.convert_to_numpy(again.optimizer.iterations))
            == int(keras.ops.convert_to_numpy(model.optimizer.iterations))
            and all(
                np.allclose(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b),
                            rtol=0, atol=1e-12)
                for a, b in zip(model.get_weights(), again.get_weights(), strict=True)
            )
        )  # fmt: skip
        out["get_weights_is_the_models"] = len(model.get_weights()) == len(inner.get_weights())
    try:
        AccumulatingModel(build(False))
        out["no_size"] = ""
    except ValueError as exc:
        out["no_size"] = str(exc)
    return out


def keras_own_parts() -> dict[str, Any]:
    """Validation, predict, save and load_model around a wrapped fit: Keras's own."""
    import tempfile

    batches, n = ref.SCENARIOS["uneven"]
    inner = build(False)
    model = AccumulatingModel(inner, micro_batches=n)
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate=LR),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    data = batches_for_keras(batches, False)
    history = model.fit(
        torch.utils.data.DataLoader(data, batch_size=None),
        validation_data=torch.utils.data.DataLoader(data[:1], batch_size=None),
        epochs=1,
        verbose=0,
    )
    x = data[0][0]
    with tempfile.TemporaryDirectory() as tmp:
        inner.save(f"{tmp}/m.keras")
        loaded = keras.models.load_model(f"{tmp}/m.keras")
    same = np.allclose(
        keras.ops.convert_to_numpy(loaded.predict(x, verbose=0)),
        keras.ops.convert_to_numpy(model.predict(x, verbose=0)),
        rtol=0,
        atol=1e-12,
    )
    return {"val_loss": "val_loss" in history.history, "saved_and_loaded": bool(same)}


def main() -> None:
    setup()
    out: dict[str, Any] = {"backend": keras.backend.backend(), "jit": JIT}
    for name in sorted(ref.SCENARIOS):
        batches, n = ref.SCENARIOS[name]
        out[name] = {
            "bigbatch": fit(name, "bigbatch"),
            "keras": fit(name, "keras"),
            "custom_loop": custom_loop(name),
            "float32_roundoff": ref.roundoff_tol(
                weights(build(name == "tokens")), ref.windows_of(batches, n), LR
            ),
        }
    out["two_epochs_partial_window"] = fit("uneven", "bigbatch", epochs=2, n=3)
    batches, _ = ref.SCENARIOS["uneven"]
    out["two_epochs_float32_roundoff"] = ref.roundoff_tol(
        weights(build(False)), ref.windows_of(batches, 3) * 2, LR
    )
    out["unknown_epoch_length"] = fit("uneven", "bigbatch", epochs=2, n=3, sized=False)
    out["misuse"] = misuse()
    out["keras_own_parts"] = keras_own_parts()
    out["callbacks_and_saving"] = callbacks_and_saving()
    if backend == "tensorflow":
        out["made_in_scope"] = made_in_scope_compiled_outside()
    print(json.dumps(out))


if __name__ == "__main__":
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        main()
