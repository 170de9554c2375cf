"""Time per window: each framework adapter against the framework's own accumulation.

Same framework, same model (an MLP, 512 -> 1024 -> 1024 -> 10), same batches (4 per window), in
one process; only the accumulation differs. Keras runs on its torch backend here, and on
tensorflow and jax each in a process of its own (``keras-tensorflow``, ``keras-jax``: Keras fixes
its backend at import). Each run trains two epochs and times the second
(warm) one; runs alternate between the two sides, and the ratio printed is the median over rounds
of adapter time / built-in time (1.00 = no overhead; the target is <= 1.03).

    python benchmarks/integrations.py                 # lightning, fastai, keras (3 backends), hf
    python benchmarks/integrations.py --json --rounds 5
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
import warnings
from collections.abc import Callable

os.environ.setdefault("KERAS_BACKEND", "torch")

import torch
import torch.nn.functional as F
from torch import nn

WINDOW = 4


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )


def data(batches: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(batch, 512, generator=g), torch.randint(0, 10, (batch,), generator=g))
        for _ in range(batches)
    ]


class EpochTimer:
    """Seconds of the last epoch's training."""

    def __init__(self) -> None:
        self.start = 0.0
        self.seconds = 0.0

    def begin(self) -> None:
        self.start = time.perf_counter()

    def end(self) -> None:
        self.seconds = time.perf_counter() - self.start


def lightning_run(batches: list, exact: bool) -> float:
    import lightning.pytorch as L

    from bigbatch.integrations.lightning import ExactAccumulation, exact_backward

    timer = EpochTimer()

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()
            self.automatic_optimization = not exact

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            if exact:
                exact_backward(self, loss, count=len(y))
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Timing(L.Callback):
        def on_train_epoch_start(self, trainer, pl_module):  # type: ignore[no-untyped-def]
            timer.begin()

        def on_train_epoch_end(self, trainer, pl_module):  # type: ignore[no-untyped-def]
            timer.end()

    callbacks: list = [Timing()]
    kwargs: dict = {}
    if exact:
        callbacks.append(ExactAccumulation(WINDOW))
    else:
        kwargs["accumulate_grad_batches"] = WINDOW
    trainer = L.Trainer(
        max_epochs=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **kwargs,
    )
    trainer.fit(Lit(), torch.utils.data.DataLoader(batches, batch_size=None))
    return timer.seconds


def fastai_run(batches: list, exact: bool) -> float:
    from fastai.callback.core import Callback
    from fastai.callback.training import GradientAccumulation
    from fastai.data.core import DataLoaders
    from fastai.learner import Learner
    from fastai.optimizer import SGD

    from bigbatch.integrations.fastai import ExactGradientAccumulation

    timer = EpochTimer()

    class Timing(Callback):
        def before_train(self) -> None:
            timer.begin()

        def after_train(self) -> None:
            timer.end()

    n_acc = WINDOW * len(batches[0][1])
    accumulate = ExactGradientAccumulation(n_acc) if exact else GradientAccumulation(n_acc)
    train = torch.utils.data.DataLoader(batches, batch_size=None)
    valid = torch.utils.data.DataLoader(batches[:1], batch_size=None)
    learn = Learner(
        DataLoaders(train, valid), mlp(), loss_func=F.cross_entropy, opt_func=SGD,
        cbs=[accumulate, Timing()],
    )  # fmt: skip
    with learn.no_bar(), learn.no_logging():
        learn.fit(2, lr=0.01)
    return timer.seconds


def keras_run(batches: list, exact: bool) -> float:
    import keras

    from bigbatch.integrations.keras import AccumulatingModel

    timer = EpochTimer()

    class Timing(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):  # type: ignore[no-untyped-def]
            timer.begin()

        def on_epoch_end(self, epoch, logs=None):  # type: ignore[no-untyped-def]
            timer.end()

    keras.utils.set_random_seed(0)
    inner = keras.Sequential(
        [
            keras.Input((512,)),
            keras.layers.Dense(1024, activation="relu"),
            keras.layers.Dense(1024, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    if exact:
        model = AccumulatingModel(inner, micro_batches=WINDOW)
        optimizer = keras.optimizers.SGD(0.01)
    else:
        model = inner
        optimizer = keras.optimizers.SGD(0.01, gradient_accumulation_steps=WINDOW)
    model.compile(
        optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    model.fit(
        torch.utils.data.DataLoader(batches, batch_size=None),
        epochs=2,
        verbose=0,
        callbacks=[Timing()],
    )
    return timer.seconds


def hf_run(batches: list, exact: bool) -> float:
    """Trainer on a model of one's own: its mean loss / steps, against bigbatch's token_loss."""
    import tempfile

    import transformers

    from bigbatch.integrations.hf import token_loss

    timer = EpochTimer()

    class Timing(transformers.TrainerCallback):
        def on_epoch_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            timer.begin()

        def on_epoch_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            timer.end()

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()

        def forward(self, x, labels=None):  # type: ignore[no-untyped-def]
            logits = self.net(x)
            out = {"logits": logits}
            if labels is not None:
                out["loss"] = F.cross_entropy(logits, labels)
            return out

    rows = [{"x": x[i], "labels": y[i]} for x, y in batches for i in range(len(y))]
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=len(batches[0][1]),
            gradient_accumulation_steps=WINDOW,
            num_train_epochs=2,
            learning_rate=0.01,
            optim="sgd",
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            use_cpu=True,
            disable_tqdm=True,
        )
        kwargs = {"compute_loss_func": token_loss()} if exact else {}
        trainer = transformers.Trainer(
            model=Model(), args=args, train_dataset=rows, callbacks=[Timing()], **kwargs
        )
        trainer.remove_callback(transformers.PrinterCallback)  # keeps stdout for --json
        trainer.train()
    return timer.seconds


FRAMEWORKS: dict[str, Callable[[list, bool], float]] = {
    "lightning": lightning_run,
    "fastai": fastai_run,
    "keras": keras_run,
    "hf": hf_run,
}
OTHER_KERAS_BACKENDS = ("keras-tensorflow", "keras-jax")


def keras_elsewhere(name: str, args: argparse.Namespace) -> dict[str, float] | None:
    """The keras row on another backend, from this script in a process of its own; None
    where that backend is not installed."""
    import importlib.util
    import subprocess
    import sys

    backend = name.removeprefix("keras-")
    if importlib.util.find_spec(backend) is None:
        return None
    argv = [sys.executable, __file__, "--frameworks", "keras", "--json"]
    argv += ["--batches", str(args.batches), "--batch", str(args.batch)]
    argv += ["--rounds", str(args.rounds)]
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, check=True)
    return dict(json.loads(done.stdout[done.stdout.index("{") :])["rows"]["keras"])


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--frameworks", default=",".join([*FRAMEWORKS, *OTHER_KERAS_BACKENDS]))
    p.add_argument("--batches", type=int, default=32, help="micro-batches per epoch")
    p.add_argument("--batch", type=int, default=64, help="samples per micro-batch")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    batches = data(args.batches, args.batch)
    windows = args.batches / WINDOW
    rows = {}
    for name in args.frameworks.split(","):
        if name in OTHER_KERAS_BACKENDS:
            if (row := keras_elsewhere(name, args)) is not None:
                rows[name] = row
            continue
        run = FRAMEWORKS[name]
        ratios, exact_s, builtin_s = [], [], []
        for r in range(args.rounds):
            # Alternate which side runs first, so drift on the machine affects both alike.
            order = (True, False) if r % 2 == 0 else (False, True)
            times = {exact: run(batches, exact) for exact in order}
            exact_s.append(times[True] / windows)
            builtin_s.append(times[False] / windows)
            ratios.append(times[True] / times[False])
        rows[name] = {
            "adapter_seconds_per_window": statistics.median(exact_s),
            "builtin_seconds_per_window": statistics.median(builtin_s),
            "ratio": statistics.median(ratios),
        }
    if args.json:
        versions = {"torch": torch.__version__, "keras_backend": os.environ["KERAS_BACKEND"]}
        print(json.dumps({"window": WINDOW, "rows": rows, **versions}, indent=1))
        return
    print(f"{'framework':<10} {'built-in s/window':>18} {'bigbatch s/window':>18} {'ratio':>7}")
    for name, row in rows.items():
        print(
            f"{name:<10} {row['builtin_seconds_per_window']:>18.4f} "
            f"{row['adapter_seconds_per_window']:>18.4f} {row['ratio']:>7.3f}"
        )


if __name__ == "__main__":
    main()
