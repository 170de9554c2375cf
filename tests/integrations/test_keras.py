"""Keras 3 fit with AccumulatingModel equals the big batch on every backend; Keras's own
gradient_accumulation_steps does not (the negative control). The torch backend in this process,
each backend (torch, tensorflow, jax) in its own as well (keras_backend_script.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from reference import (
    CLASSES,
    FEATURES,
    SCENARIOS,
    SEQ,
    Batch,
    reference_update,
    rel_err,
    roundoff_tol,
    windows_of,
)

os.environ.setdefault("KERAS_BACKEND", "torch")
keras = pytest.importorskip("keras")
if keras.backend.backend() != "torch":
    pytest.skip("Keras runs another backend in this process", allow_module_level=True)
from bigbatch.integrations.keras import AccumulatingModel  # noqa: E402

LR = 0.5


@pytest.fixture(autouse=True)
def float64_keras():  # type: ignore[no-untyped-def]
    """Keras computes losses in the global dtype policy (float32) whatever the layers' dtype."""
    before = keras.config.dtype_policy()
    keras.config.set_dtype_policy("float64")
    yield
    keras.config.set_dtype_policy(before)


def build(tokens: bool) -> keras.Model:
    keras.utils.set_random_seed(0)
    shape = (SEQ, FEATURES) if tokens else (FEATURES,)
    return keras.Sequential(
        [keras.Input(shape, dtype="float64"), keras.layers.Dense(CLASSES, dtype="float64")]
    )


def keras_batches(batches: list[Batch], tokens: bool) -> list[tuple[torch.Tensor, ...]]:
    """Padding (-100) becomes label 0 with sample weight 0: Keras's way to mask a token loss."""
    if not tokens:
        return [(x, y) for x, y in batches]
    return [(x, y.clamp(min=0), (y != -100).double()) for x, y in batches]


def run(name: str, exact: bool, epochs: int = 1, n: int | None = None) -> tuple[tuple, tuple]:
    batches, window = SCENARIOS[name]
    n = n or window
    tokens = name == "tokens"
    inner = build(tokens)
    kernel, bias = (torch.as_tensor(v.numpy()).clone() for v in inner.weights)
    init = (kernel.T.double(), bias.double())
    loss = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True,
        reduction="mean_with_sample_weight" if tokens else "sum_over_batch_size",
    )
    if exact:
        model = AccumulatingModel(inner, micro_batches=n, count="weights" if tokens else "samples")
        optimizer = keras.optimizers.SGD(learning_rate=LR)
    else:
        model = inner
        optimizer = keras.optimizers.SGD(learning_rate=LR, gradient_accumulation_steps=n)
    model.compile(optimizer=optimizer, loss=loss)
    loader = torch.utils.data.DataLoader(keras_batches(batches, tokens), batch_size=None)
    model.fit(loader, epochs=epochs, verbose=0)
    got = tuple(torch.as_tensor(v.numpy()) for v in inner.weights)
    return (got[0].T, got[1]), init


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_fit_equals_big_batch_and_gradient_accumulation_steps_does_not(name: str) -> None:
    batches, n = SCENARIOS[name]
    got, init = run(name, exact=True)
    want = reference_update(*init, windows_of(batches, n), LR)
    # On the torch backend Keras computes float64 arithmetic in float32 (its loss reduction, its
    # optimizer's update: keras.backend.result_type maps 64 bits to 32 off tensorflow): float32
    # round-off. tensorflow and jax reach 1e-12 (test_each_backend_in_its_own_process).
    assert rel_err(got, want, init) <= roundoff_tol(init, windows_of(batches, n), LR)

    got, _ = run(name, exact=False)
    assert rel_err(got, want, init) > 0.1


def test_windows_continue_over_epochs_with_the_partial_window_applied() -> None:
    batches, _ = SCENARIOS["uneven"]  # [4, 12, 16, 32], windows of 3: [4, 12, 16], [32]
    got, init = run("uneven", exact=True, epochs=2, n=3)
    w, b = init
    for window in windows_of(batches, 3) * 2:
        w, b = reference_update(w, b, [window], LR)
    assert rel_err(got, (w, b), init) <= roundoff_tol(init, windows_of(batches, 3) * 2, LR)


def test_misuse_is_refused() -> None:
    inner = build(tokens=False)
    model = AccumulatingModel(inner, micro_batches=2)
    with pytest.raises(ValueError, match="remove it"):
        model.compile(optimizer=keras.optimizers.SGD(gradient_accumulation_steps=2), loss="mse")
    with pytest.raises(ValueError, match="'samples' or 'weights'"):
        AccumulatingModel(inner, micro_batches=2, count="tokens")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"wrap a keras\.Model"):
        AccumulatingModel(torch.nn.Linear(2, 2), micro_batches=2)


SCRIPT = Path(__file__).with_name("keras_backend_script.py")


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend,jit", [("tensorflow", False), ("tensorflow", True), ("jax", False), ("torch", False)]
)
def test_each_backend_in_its_own_process(backend: str, jit: bool) -> None:
    """fit over uneven batches (a short last one, an epoch ending mid-window, with and without
    sample_weight) and the custom-loop wrapper equal the big batch: to 1e-12 in float64 on
    tensorflow (also with jit_compile) and jax; on torch to float32's round-off, Keras's own
    floor there. Keras's gradient_accumulation_steps fails the same check."""
    if importlib.util.find_spec({"torch": "torch"}.get(backend, backend)) is None:
        pytest.skip(f"{backend} is not installed")
    env = {**os.environ, "KERAS_BACKEND": backend}
    argv = [sys.executable, str(SCRIPT), *(["--jit"] if jit else [])]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["backend"] == backend
    for name in SCENARIOS:
        row = out[name]
        floor = 1e-12 if backend != "torch" else row["float32_roundoff"]
        assert row["bigbatch"] <= floor and row["custom_loop"] <= floor, (name, row)
        assert row["keras"] > 0.1, (name, row)  # the negative control
    bound = 1e-12 if backend != "torch" else out["two_epochs_float32_roundoff"]
    assert out["two_epochs_partial_window"] <= bound
    assert out["unknown_epoch_length"] <= bound  # applied at the epoch's end
    said = out["misuse"]
    assert said["micro_batches=0"] == "micro_batches must be >= 1, got 0"
    assert "remove it" in said["keras's own accumulation"]
    if backend != "torch":
        assert "mixed_bfloat16" in said["loss scaling"]
        assert "is not supported by bigbatch's Keras wrapper" in said["distributed"]
        inside = {"jax": "apply() cannot run inside jax.jit", "tensorflow": "flush() cannot run inside tf.function"}  # fmt: skip
        assert inside[backend] in said["compiled"], said["compiled"]
    assert "count of 0" in said["zero window"] and said["steps after a zero window"] == "1"
    assert out["keras_own_parts"] == {"val_loss": True, "saved_and_loaded": True}
    saving = out["callbacks_and_saving"]
    assert saving.pop("no_size").endswith("n_acc=C (samples or tokens per optimizer step)")
    assert saving == dict.fromkeys(
        ("checkpoint_is_the_plain_model", "weights_file_into_a_new_wrapper",
         "resumed_adam_continues_exactly", "get_weights_is_the_models"), True,
    )  # fmt: skip
    if backend == "tensorflow":
        assert "is not supported by bigbatch's Keras wrapper" in out["made_in_scope"]


def test_a_float16_model_without_loss_scaling_is_refused() -> None:
    """Built under mixed_float16, wrapped and compiled after the policy was reset: it ran in
    float16 with no loss scaling, silently."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    model = AccumulatingModel(inner, micro_batches=2)
    with pytest.raises(ValueError, match=r"computes in float16 .*LossScaleOptimizer"):
        model.compile(optimizer="adam", loss="mse")
    model.compile(
        optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()), loss="mse"
    )
