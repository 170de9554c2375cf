"""fastai's Learner.fit with ExactGradientAccumulation equals the big batch; fastai's own
GradientAccumulation does not (the negative control)."""

from __future__ import annotations

import pytest
import torch
from reference import (
    CLASSES,
    FEATURES,
    SCENARIOS,
    Batch,
    loss_of,
    reference_update,
    rel_err,
    roundoff_tol,
    sample_batches,
    windows_of,
)
from torch import nn

pytest.importorskip("fastai")
from fastai.callback.training import GradientAccumulation, GradientClip
from fastai.data.core import DataLoaders
from fastai.learner import Learner
from fastai.optimizer import SGD

from bigbatch.integrations.fastai import ExactGradientAccumulation

LR = 0.5


def learner(batches: list[Batch], cbs: list) -> Learner:
    torch.manual_seed(0)
    model = nn.Linear(FEATURES, CLASSES).double()
    # Each item of the loaders is a whole micro-batch, of the size the scenario gives.
    train = torch.utils.data.DataLoader(batches, batch_size=None)
    valid = torch.utils.data.DataLoader(batches[:1], batch_size=None)
    learn = Learner(DataLoaders(train, valid), model, loss_func=loss_of, opt_func=SGD, cbs=cbs)
    # The Recorder smooths the loss in float32 and cannot take this float64 run's loss; the
    # progress bar only prints.
    learn.remove_cbs([learn.recorder, learn.progress])
    return learn


def fit(learn: Learner, epochs: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    learn.fit(epochs, lr=LR)
    return learn.model.weight, learn.model.bias


def init_params() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    net = nn.Linear(FEATURES, CLASSES)
    return net.weight.detach().double(), net.bias.detach().double()


# name -> (bigbatch's callback, fastai's own with the n_acc a user would set)
CASES = {
    # [4, 12, 16, 32] with n_acc=48: the window overshoots to 64 samples; fastai divides by 48.
    "uneven": (lambda: ExactGradientAccumulation(n_acc=48), lambda: GradientAccumulation(48)),
    # [16, 16, 4] with n_acc=64: the epoch ends first; fastai never steps the remainder.
    "short_last": (lambda: ExactGradientAccumulation(n_acc=64), lambda: GradientAccumulation(64)),
    # a padded token loss: fastai counts samples (39 of them), the loss averages over tokens.
    "tokens": (
        lambda: ExactGradientAccumulation(micro_batches=4, count="tokens"),
        lambda: GradientAccumulation(39),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_fit_equals_big_batch_and_gradient_accumulation_does_not(name: str) -> None:
    batches, n = SCENARIOS[name]
    exact_cb, builtin_cb = CASES[name]
    init = init_params()
    want = reference_update(*init, windows_of(batches, n), LR)

    cb = exact_cb()
    assert rel_err(fit(learner(batches, [cb])), want, init) < 1e-12
    assert cb.optimizer_step == 1
    assert rel_err(fit(learner(batches, [builtin_cb()])), want, init) > 0.05


def test_windows_over_epochs_with_gradient_clip() -> None:
    batches, _ = SCENARIOS["uneven"]  # [4, 12, 16, 32]
    init = init_params()
    # windows of 3 batches: [4, 12, 16], then the partial [32]; twice
    windows = windows_of(batches, 3) * 2
    w, b = init
    for window in windows:
        w, b = reference_update(w, b, [window], LR, clip=0.05)
    learn = learner(batches, [ExactGradientAccumulation(micro_batches=3), GradientClip(0.05)])
    assert rel_err(fit(learn, epochs=2), (w, b), init) < 1e-12


def test_bad_window_is_refused() -> None:
    with pytest.raises(ValueError, match="give one window size"):
        ExactGradientAccumulation()
    with pytest.raises(ValueError, match="'samples' or 'tokens'"):
        ExactGradientAccumulation(64, count="items")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"n_acc is the number of samples .* got 0"):
        ExactGradientAccumulation(n_acc=0)


def test_fastai_gradient_accumulation_beside_it_is_refused() -> None:
    """Together the two cancelled each other's steps: no update at all."""
    batches, _ = SCENARIOS["uneven"]
    learn = learner(batches, [ExactGradientAccumulation(n_acc=16), GradientAccumulation(16)])
    with pytest.raises(RuntimeError, match="remove_cb"):
        fit(learn)


def test_float32_with_recorder_and_mixed_precision_callbacks() -> None:
    """The usual setup: float32, the Recorder and MixedPrecision in place (MixedPrecision is
    CUDA-only in fastai and turns itself off on the CPU, so this checks that they compose)."""
    import warnings

    from fastai.callback.fp16 import MixedPrecision

    batches, n = SCENARIOS["short_last"]
    batches32 = [(x.float(), y) for x, y in batches]
    torch.manual_seed(0)
    model = nn.Linear(FEATURES, CLASSES)
    train = torch.utils.data.DataLoader(batches32, batch_size=None)
    valid = torch.utils.data.DataLoader(batches32[:1], batch_size=None)
    learn = Learner(
        DataLoaders(train, valid),
        model,
        loss_func=loss_of,
        opt_func=SGD,
        cbs=[ExactGradientAccumulation(micro_batches=n), MixedPrecision()],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "CUDA is not available": MixedPrecision turns off
        with learn.no_logging(), learn.no_bar():
            learn.fit(1, lr=LR)
    init = init_params()
    want = reference_update(*init, windows_of(batches, n), LR)
    assert rel_err((model.weight, model.bias), want, init) <= roundoff_tol(
        init, windows_of(batches, n), LR
    )
    assert len(learn.recorder.values) == 1  # the epoch was validated and recorded


def test_plan_learner_predicts_a_micro_batch_under_the_budget() -> None:
    from bigbatch.integrations.fastai import plan_learner

    batches = [(torch.randn(16, 3, 32, 32), torch.randint(0, CLASSES, (16,)))]
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 32 * 32, CLASSES)
    )
    train = torch.utils.data.DataLoader(batches, batch_size=None)
    learn = Learner(DataLoaders(train, train), model, loss_func=nn.CrossEntropyLoss())
    roomy = plan_learner(learn, 64, "2GB", overhead=0)
    assert (roomy.micro_batch, roomy.micro_batches) == (64, 1)
    assert roomy.prediction.device == "cpu"  # where the loaders put the batches: the default
    tight = plan_learner(learn, 64, roomy.floor_bytes * 4, overhead=0)
    assert tight.micro_batch < 64 and tight.micro_batch * tight.micro_batches >= 64
    assert tight.predicted_peak_bytes <= tight.usable_bytes


def test_a_checkpointed_batchnorm_counts_each_micro_batch_once() -> None:
    """A checkpointed block's recomputation in backward does not move BatchNorm's running
    statistics again: one count a micro-batch, as without."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    batches, n_acc = sample_batches([4, 12, 16, 32]), 48
    learn = learner(batches, [ExactGradientAccumulation(n_acc=n_acc)])
    norm = nn.BatchNorm1d(CLASSES).double()
    learn.model = nn.Sequential(checkpoint_wrapper(nn.Sequential(learn.model, norm)))
    learn.fit(1, lr=LR)
    assert int(norm.num_batches_tracked) == len(batches)
