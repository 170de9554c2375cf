"""The Accumulator's update equals the big-batch update; the naive ``loss / N`` fails the same check.

Runs are in float64, so "equal" means 1e-12 relative on the update: anything else is a bug,
not rounding. float32 is covered in test_verify.py on gradients.
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
import torch.nn.functional as F

from bigbatch import Accumulator, EmptyWindowWarning, NonFiniteGradientWarning
from helpers import (
    big_batch_run,
    bigbatch_run,
    make_data,
    make_model,
    naive_run,
    sgd,
    split,
    update_rel_diff,
    windows_of,
)

TOL64 = 1e-12
NAIVE_FAILS = 1e-3  # the naive runs below miss by far more than this

# (micro-batch sizes of one epoch, micro-batches per window, windows as numbers of micro-batches)
CASES = {
    "equal": ([8, 8, 8, 8], 4, [4]),
    "uneven_last": ([8, 8, 8, 8, 4], 3, [3, 2]),
    "mixed": ([2, 6, 12, 16], 4, [4]),
    "half_window": ([8, 8], 4, [2]),
}


def _epoch(sizes: list[int], seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = make_data(sum(sizes), seed=seed)
    return split(x, y, sizes)


@pytest.mark.parametrize("name", list(CASES))
def test_update_equals_big_batch_and_naive_does_not(name: str) -> None:
    sizes, n, windows = CASES[name]
    epochs = [_epoch(sizes, seed=1), _epoch(sizes, seed=2)]
    start = make_model()
    ref = big_batch_run(copy.deepcopy(start), [w for e in epochs for w in windows_of(e, windows)])
    ours, acc = bigbatch_run(copy.deepcopy(start), epochs, micro_batches=n)
    naive = naive_run(copy.deepcopy(start), [w for e in epochs for w in windows_of(e, windows)], n)

    assert update_rel_diff(start, ours, ref) <= TOL64
    assert acc.optimizer_step == 2 * len(windows)
    if name == "equal":
        # The harness agrees with the naive method exactly where the naive method is right.
        assert update_rel_diff(start, naive, ref) <= TOL64
    else:
        assert update_rel_diff(start, naive, ref) > NAIVE_FAILS


class TokenModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(30, 8)
        self.head = torch.nn.Linear(8, 30)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(t)))


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, 30), labels.reshape(-1), ignore_index=-100)


def _token_batches(real: list[int], seed: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Micro-batches of 4 sequences x 128 slots, with `real` labels that are not padding."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in real:
        t = torch.randint(0, 30, (4, 128), generator=g)
        lab = torch.randint(0, 30, (4, 128), generator=g)
        keep = torch.zeros(4 * 128, dtype=torch.bool)
        keep[torch.randperm(4 * 128, generator=g)[:r]] = True
        lab[~keep.view(4, 128)] = -100
        out.append((t, lab))
    return out


def test_token_loss_with_padding() -> None:
    batches = _token_batches([8, 40, 120, 420])
    start = TokenModel().double()
    ref = big_batch_run(copy.deepcopy(start), [batches], loss_fn=token_loss)
    ours, acc = bigbatch_run(
        copy.deepcopy(start),
        [batches],
        loss_fn=token_loss,
        count=lambda b: {"labels": b[1]},
        micro_batches=4,
    )
    naive = naive_run(copy.deepcopy(start), [batches], 4, loss_fn=token_loss)
    assert update_rel_diff(start, ours, ref) <= TOL64
    assert update_rel_diff(start, naive, ref) > NAIVE_FAILS
    assert acc.tokens_seen == 8 + 40 + 120 + 420
    assert acc.samples_seen == 16


def test_target_count_window_in_tokens() -> None:
    batches = _token_batches([100, 100, 300, 50, 60])
    start = TokenModel().double()
    # target 250 tokens: the first window closes at 500 (100+100+300), the rest is a partial window.
    ref = big_batch_run(copy.deepcopy(start), [batches[:3], batches[3:]], loss_fn=token_loss)
    ours, acc = bigbatch_run(
        copy.deepcopy(start),
        [batches],
        loss_fn=token_loss,
        count=lambda b: {"labels": b[1]},
        target_count=250,
    )
    assert acc.optimizer_step == 2
    assert update_rel_diff(start, ours, ref) <= TOL64


def test_sum_reduced_loss() -> None:
    epoch = _epoch([2, 6, 12, 16])
    start = make_model()
    ref = big_batch_run(copy.deepcopy(start), [epoch])  # mean over all 36 samples

    def sum_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y, reduction="sum")

    ours, _ = bigbatch_run(
        copy.deepcopy(start), [epoch], loss_fn=sum_loss, micro_batches=4, reduction="sum"
    )
    naive = naive_run(copy.deepcopy(start), [epoch], 4, loss_fn=sum_loss)
    assert update_rel_diff(start, ours, ref) <= TOL64
    assert update_rel_diff(start, naive, ref) > NAIVE_FAILS


def test_per_sample_weights() -> None:
    x, y = make_data(36)
    w = torch.rand(36, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 3
    sizes = [4, 8, 24]
    xs, ys, ws = (torch.split(t, sizes) for t in (x, y, w))
    batches = [(xi, (yi, wi)) for xi, yi, wi in zip(xs, ys, ws, strict=True)]

    def weighted(out: torch.Tensor, target: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        labels, weights = target
        return (F.cross_entropy(out, labels, reduction="none") * weights).sum() / weights.sum()

    start = make_model()
    ref = copy.deepcopy(start)
    opt = sgd(ref.parameters())
    weighted(ref(x), (y, w)).backward()
    opt.step()
    ours, _ = bigbatch_run(
        copy.deepcopy(start),
        [batches],
        loss_fn=weighted,
        count=lambda b: {"weight": b[1][1].sum(), "count": len(b[1][1])},
        micro_batches=3,
    )
    naive = copy.deepcopy(start)
    nopt = sgd(naive.parameters())
    for xb, target in batches:
        (weighted(naive(xb), target) / 3).backward()
    nopt.step()
    assert update_rel_diff(start, ours, ref) <= TOL64
    assert update_rel_diff(start, naive, ref) > NAIVE_FAILS


def test_clipping_applies_once_to_the_normalised_gradient() -> None:
    epoch = _epoch([2, 6, 12, 16])
    start = make_model()
    # A max norm well below the gradient norm, so clipping is active in every step.
    ref = big_batch_run(copy.deepcopy(start), [epoch], clip=0.05)
    ours, _ = bigbatch_run(copy.deepcopy(start), [epoch], micro_batches=4, clip_grad_norm=0.05)
    naive = naive_run(copy.deepcopy(start), [epoch], 4, clip=0.05)
    assert update_rel_diff(start, ours, ref) <= TOL64
    assert update_rel_diff(start, naive, ref) > NAIVE_FAILS


def test_lr_scheduler_counts_optimizer_steps() -> None:
    sizes, n, windows = CASES["uneven_last"]
    epochs = [_epoch(sizes, seed=s) for s in (1, 2, 3)]

    def sched(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))

    start = make_model()
    flat = [w for e in epochs for w in windows_of(e, windows)]
    ref = big_batch_run(copy.deepcopy(start), flat, scheduler_factory=sched)
    ours, acc = bigbatch_run(copy.deepcopy(start), epochs, micro_batches=n, scheduler_factory=sched)
    naive = naive_run(copy.deepcopy(start), flat, n, scheduler_factory=sched)
    assert acc.optimizer_step == 6
    assert acc.scheduler.last_epoch == 6
    assert update_rel_diff(start, ours, ref) <= TOL64
    assert update_rel_diff(start, naive, ref) > NAIVE_FAILS


def test_epoch_schedule_of_window_sizes() -> None:
    sizes = [8, 8, 8, 8, 4]
    e0, e1 = _epoch(sizes, seed=1), _epoch(sizes, seed=2)
    start = make_model()
    # {0: 3, 1: 2}: epoch 0 has windows of 3 and 2 micro-batches, epoch 1 of 2, 2 and 1.
    flat = windows_of(e0, [3, 2]) + windows_of(e1, [2, 2, 1])
    ref = big_batch_run(copy.deepcopy(start), flat)
    ours, acc = bigbatch_run(copy.deepcopy(start), [e0, e1], micro_batches={0: 3, 1: 2})
    naive = copy.deepcopy(start)
    opt = sgd(naive.parameters())
    for window, n in zip(flat, [3, 3, 2, 2, 2], strict=True):
        for x, y in window:
            (F.cross_entropy(naive(x), y) / n).backward()
        opt.step()
        opt.zero_grad()
    assert acc.optimizer_step == 5
    assert update_rel_diff(start, ours, ref) <= TOL64
    assert update_rel_diff(start, naive, ref) > NAIVE_FAILS


def test_last_window_drop_and_carry() -> None:
    e0, e1 = _epoch([8, 8, 8, 8, 4], seed=1), _epoch([8, 8, 8, 8, 4], seed=2)
    start = make_model()
    # drop: the partial window [8, 4] of each epoch is discarded.
    ref_drop = big_batch_run(copy.deepcopy(start), [e0[:3], e1[:3]])
    ours_drop, acc = bigbatch_run(
        copy.deepcopy(start), [e0, e1], micro_batches=3, last_window="drop"
    )
    assert acc.optimizer_step == 2
    assert update_rel_diff(start, ours_drop, ref_drop) <= TOL64
    # carry: windows run across the epoch boundary: [0..2], [3, 4, 0'], [1'..3'], then [4'] at the end.
    flat = e0 + e1
    ref_carry = big_batch_run(copy.deepcopy(start), [flat[0:3], flat[3:6], flat[6:9], flat[9:]])
    ours_carry, acc = bigbatch_run(
        copy.deepcopy(start), [e0, e1], micro_batches=3, last_window="carry"
    )
    acc.last_window = "renorm"
    acc.end_epoch()  # the training's very end: settle what is carried
    assert acc.optimizer_step == 4
    # end_epoch ran after bigbatch_run returned, so compare with the model it stepped.
    assert update_rel_diff(start, ours_carry, ref_carry) <= TOL64


def test_counters_advance_once_per_window_including_the_partial_one() -> None:
    model = make_model()
    acc = Accumulator(sgd(model.parameters()), micro_batches=3)
    steps = []
    for x, y in _epoch([8, 8, 8, 8, 4]):
        acc.backward(F.cross_entropy(model(x), y), count=len(y))
        if acc.window_full:
            steps.append(acc.step().optimizer_step)
    assert steps == [1]
    assert acc.micro_in_window == 2
    last = acc.end_epoch()
    assert (
        last is not None
        and last.optimizer_step == 2
        and last.micro_batches == 2
        and last.count == 12
    )
    assert (acc.micro_step, acc.optimizer_step, acc.samples_seen, acc.epoch) == (5, 2, 36, 1)
    assert acc.end_epoch() is None  # nothing open: no extra step
    assert acc.optimizer_step == 2


def test_logged_loss_is_the_exact_window_mean() -> None:
    model = make_model()
    epoch = _epoch([2, 6, 12, 16])
    x = torch.cat([b[0] for b in epoch])
    y = torch.cat([b[1] for b in epoch])
    expected = float(F.cross_entropy(model(x), y).detach())
    acc = Accumulator(sgd(model.parameters()), micro_batches=4)
    for xb, yb in epoch:
        acc.backward(F.cross_entropy(model(xb), yb), count=len(yb))
    result = acc.step()
    assert result.loss == pytest.approx(expected, rel=1e-13)
    mean_of_means = sum(float(F.cross_entropy(model(xb), yb).detach()) for xb, yb in epoch) / 4
    assert result.loss != pytest.approx(mean_of_means, rel=1e-3)


def _autocast_loss(out_model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = out_model(x)
    return F.cross_entropy(out.float(), y)


def test_bf16_autocast_matches_big_batch_within_bf16_tolerance() -> None:
    # bf16 matmuls round differently for different batch shapes, so the tolerance is bf16's.
    tol = 2e-2
    x, y = make_data(36, dtype=torch.float32)
    sizes = [2, 6, 12, 16]
    start = make_model(dtype=torch.float32)

    def one_window(model: torch.nn.Module, method: str) -> torch.nn.Module:
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        if method == "big":
            _autocast_loss(model, x, y).backward()
            opt.step()
            return model
        acc = Accumulator(opt, micro_batches=4)
        for xb, yb in split(x, y, sizes):
            loss = _autocast_loss(model, xb, yb)
            if method == "bigbatch":
                acc.backward(loss, count=len(yb))
            else:
                (loss / 4).backward()
        if method == "bigbatch":
            acc.step()
        else:
            opt.step()
        return model

    ref = one_window(copy.deepcopy(start), "big")
    assert update_rel_diff(start, one_window(copy.deepcopy(start), "bigbatch"), ref) <= tol
    assert update_rel_diff(start, one_window(copy.deepcopy(start), "naive"), ref) > 10 * tol


def test_fp16_grad_scaler_is_exact_and_skips_inf_steps() -> None:
    epoch = _epoch([2, 6, 12, 16])
    start = make_model()
    ref = big_batch_run(copy.deepcopy(start), [epoch])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    ours, acc = bigbatch_run(copy.deepcopy(start), [epoch], micro_batches=4, scaler=scaler)
    assert update_rel_diff(start, ours, ref) <= TOL64  # power-of-two scaling is exact

    # A window with an inf gradient: GradScaler skips the step; so do the counters and scheduler.
    model = copy.deepcopy(start)
    opt = sgd(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    acc = Accumulator(opt, micro_batches=2, scaler=torch.amp.GradScaler("cpu"), scheduler=sched)
    x, y = epoch[0]
    acc.backward(F.cross_entropy(model(x), y), count=len(y))
    acc.backward(F.cross_entropy(model(x), y) * math.inf, count=len(y))
    result = acc.step()
    assert result.skipped
    assert acc.optimizer_step == 0 and sched.last_epoch == 0
    assert all(
        torch.equal(p, q) for p, q in zip(model.parameters(), start.parameters(), strict=True)
    )
    assert all(p.grad is None for p in model.parameters())


def _resumable_run(
    stop_after: int | None, state: bytes | None = None
) -> tuple[torch.nn.Module, bytes | None]:
    """AdamW + cosine over 2 epochs of uneven micro-batches; optionally stop and checkpoint."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)
    acc = Accumulator(opt, micro_batches=3, scheduler=sched)
    epochs = [_epoch([8, 8, 8, 8, 4], seed=1), _epoch([8, 8, 8, 8, 4], seed=2)]
    done = 0
    if state is not None:
        ckpt = torch.load(io.BytesIO(state), weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        acc.load_state_dict(ckpt["acc"])
        done = ckpt["done"]
    i = 0
    for epoch in epochs:
        for x, y in epoch:
            i += 1
            if i <= done:
                continue
            acc.backward(F.cross_entropy(model(x), y), count=len(y))
            if acc.window_full:
                acc.step()
            if stop_after is not None and i == stop_after:
                buf = io.BytesIO()
                torch.save(
                    {
                        "model": model.state_dict(),
                        "opt": opt.state_dict(),
                        "sched": sched.state_dict(),
                        "acc": acc.state_dict(),
                        "done": i,
                    },
                    buf,
                )
                return model, buf.getvalue()
        if i >= done:  # a checkpoint is taken before its epoch's end_epoch()
            acc.end_epoch()
    return model, None


@pytest.mark.parametrize("stop_after", [4, 5, 7])
def test_resume_mid_window_is_bit_identical(stop_after: int) -> None:
    # 4: one micro-batch into a window; 5: the epoch's partial window still open; 7: next epoch.
    uninterrupted, _ = _resumable_run(None)
    _, ckpt = _resumable_run(stop_after=stop_after)
    assert ckpt is not None
    resumed, _ = _resumable_run(None, state=ckpt)
    for p, q in zip(resumed.parameters(), uninterrupted.parameters(), strict=True):
        assert torch.equal(p, q)


def test_resume_without_the_partial_gradient_would_differ() -> None:
    # Negative control: dropping the window's saved gradient changes the result.
    uninterrupted, _ = _resumable_run(None)
    _, ckpt = _resumable_run(stop_after=4)
    assert ckpt is not None
    state = torch.load(io.BytesIO(ckpt), weights_only=True)
    state["acc"]["grads"] = [None for _ in state["acc"]["grads"]]
    buf = io.BytesIO()
    torch.save(state, buf)
    resumed, _ = _resumable_run(None, state=buf.getvalue())
    assert not all(
        torch.equal(p, q)
        for p, q in zip(resumed.parameters(), uninterrupted.parameters(), strict=True)
    )


# ------------------------------------------------------------------ bad input
def _acc(**kw: object) -> tuple[torch.nn.Module, Accumulator]:
    model = make_model()
    kw.setdefault("micro_batches", 2)
    return model, Accumulator(sgd(model.parameters()), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [0, -1, 1.5, True])
def test_window_size_must_be_a_positive_integer(n: object) -> None:
    with pytest.raises(ValueError, match="micro_batches must be an integer >= 1"):
        _acc(micro_batches=n)


def test_window_takes_one_size_or_none() -> None:
    model = make_model()
    with pytest.raises(ValueError, match="not both"):
        Accumulator(sgd(model.parameters()), micro_batches=2, target_count=10)
    manual = Accumulator(sgd(model.parameters()))  # windows end when the caller steps
    x, y = make_data(4)
    manual.backward(F.cross_entropy(model(x), y), count=4)
    assert not manual.window_full
    assert manual.step().count == 4


def test_schedule_must_start_at_epoch_zero() -> None:
    with pytest.raises(ValueError, match="from epoch 0"):
        _acc(micro_batches={2: 4})


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"count": -3}, ValueError, "count must be >= 0"),
        ({"count": 2.5}, TypeError, "weight="),
        ({"count": torch.tensor(2.0)}, TypeError, "weight="),
        ({"weight": -1.0}, ValueError, "weight must be >= 0"),
        ({}, ValueError, "count=len"),
    ],
)
def test_bad_counts_are_rejected_with_the_fix(kwargs: dict, error: type, match: str) -> None:
    model, acc = _acc()
    x, y = make_data(4)
    with pytest.raises(error, match=match):
        acc.backward(F.cross_entropy(model(x), y), **kwargs)
    assert acc.micro_step == 0


def test_non_scalar_loss_is_rejected() -> None:
    model, acc = _acc()
    x, y = make_data(4)
    with pytest.raises(ValueError, match=r"scalar.*reduction='sum'"):
        acc.backward(F.cross_entropy(model(x), y, reduction="none"), count=4)


def test_step_without_backward_is_rejected() -> None:
    model, acc = _acc()
    with pytest.raises(RuntimeError, match="no backward"):
        acc.step()
    x, y = make_data(4)
    acc.backward(F.cross_entropy(model(x), y), count=4)
    acc.step()
    with pytest.raises(RuntimeError, match="no backward"):
        acc.step()


def test_zero_grad_inside_a_window_is_caught() -> None:
    model, acc = _acc()
    x, y = make_data(4)
    acc.backward(F.cross_entropy(model(x), y), count=4)
    acc.optimizer.zero_grad()
    with pytest.raises(RuntimeError, match="zero_grad"):
        acc.step()


def test_all_padding_window_is_skipped_with_a_warning() -> None:
    model = TokenModel().double()
    acc = Accumulator(sgd(model.parameters()), micro_batches=1)
    before = copy.deepcopy(model)
    t, labels = _token_batches([0])[0]
    acc.backward(token_loss(model(t), labels), labels=labels)  # mean over 0 tokens is nan
    with pytest.warns(EmptyWindowWarning, match="total count is 0"):
        result = acc.step()
    assert result.skipped and acc.optimizer_step == 0
    assert all(
        torch.equal(p, q) for p, q in zip(model.parameters(), before.parameters(), strict=True)
    )
    # The next window trains normally.
    t, labels = _token_batches([50])[0]
    acc.backward(token_loss(model(t), labels), labels=labels)
    assert not acc.step().skipped


def test_reduce_on_plateau_is_refused_as_a_per_step_scheduler() -> None:
    model = make_model()
    opt = sgd(model.parameters())
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    with pytest.raises(TypeError, match=r"scheduler.step\(val_loss\)"):
        Accumulator(opt, micro_batches=2, scheduler=plateau)


def test_loss_without_grad_is_rejected() -> None:
    model, acc = _acc()
    x, y = make_data(4)
    with torch.no_grad():
        loss = F.cross_entropy(model(x), y)
    with pytest.raises(ValueError, match="does not require grad"):
        acc.backward(loss, count=4)


# ---------------------------------------------------------------- misuse is never silent


def _zero_grad_in_loop_run(set_to_none: bool, before: str) -> torch.nn.Module:
    """A loop that kept its optimizer.zero_grad() after switching to the Accumulator."""
    model, acc = _acc(micro_batches=3)
    for xb, yb in _epoch([8, 4, 8]):
        if before == "backward":
            acc.optimizer.zero_grad(set_to_none=set_to_none)
        acc.backward(F.cross_entropy(model(xb), yb), count=len(yb))
    if before == "step":
        acc.optimizer.zero_grad(set_to_none=set_to_none)
    acc.step()
    return model


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("before", ["backward", "step"])
def test_zero_grad_left_in_the_loop_is_caught(set_to_none: bool, before: str) -> None:
    if before == "step" and set_to_none:
        match = "cleared"
    else:
        match = "cleared" if set_to_none else "changed in place"
    with pytest.raises(RuntimeError, match=match):
        _zero_grad_in_loop_run(set_to_none, before)


def test_zero_grad_in_the_loop_would_use_only_the_last_micro_batch() -> None:
    """Why the check above exists: the same loop, run on a plain optimizer, steps on the last
    micro-batch alone (0.8 relative error here) instead of the window."""
    start = make_model()
    mbs = _epoch([8, 4, 8])
    ref = big_batch_run(copy.deepcopy(start), [mbs])
    model = copy.deepcopy(start)
    opt = sgd(model.parameters())
    total = sum(len(y) for _, y in mbs)
    for xb, yb in mbs:
        opt.zero_grad()
        (F.cross_entropy(model(xb), yb) * len(yb) / total).backward()
    opt.step()
    assert update_rel_diff(start, model, ref) > 0.1


def test_replaced_gradients_are_caught() -> None:
    model, acc = _acc()
    x, y = make_data(4)
    acc.backward(F.cross_entropy(model(x), y), count=4)
    for p in model.parameters():
        p.grad = p.grad.clone()  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="replaced"):
        acc.backward(F.cross_entropy(model(x), y), count=4)


def test_reading_gradients_between_micro_batches_is_allowed() -> None:
    model, acc = _acc()
    x, y = make_data(4)
    acc.backward(F.cross_entropy(model(x), y), count=4)
    norm = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))  # type: ignore[misc]
    assert norm > 0
    acc.backward(F.cross_entropy(model(x), y), count=4)
    assert not acc.step().skipped


def test_forgotten_end_epoch_is_caught_with_epoch_length() -> None:
    model, acc = _acc(micro_batches=3, epoch_length=5)
    for xb, yb in _epoch([8, 8, 8, 8, 4]):
        acc.backward(F.cross_entropy(model(xb), yb), count=len(yb))
        if acc.window_full:
            acc.step()
    # No end_epoch(): the next epoch's first micro-batch is the epoch's sixth.
    xb, yb = _epoch([8])[0]
    with pytest.raises(RuntimeError, match=r"end_epoch\(\) was not called"):
        acc.backward(F.cross_entropy(model(xb), yb), count=len(yb))
    acc.end_epoch()
    acc.backward(F.cross_entropy(model(xb), yb), count=len(yb))  # with it, the epoch goes on
    with pytest.raises(ValueError, match="epoch_length"):
        _acc(epoch_length=0)


def test_iterate_settles_each_epoch_and_advances_the_schedule() -> None:
    """acc.iterate(loader) calls end_epoch(): two epochs with the schedule {0: 3, 1: 2} equal
    the big batch over the same windows; the loop that forgets end_epoch() does not."""
    sizes = [8, 8, 8, 8, 4]
    epochs = [_epoch(sizes, seed=1), _epoch(sizes, seed=2)]
    start = make_model()
    windows = windows_of(epochs[0], [3, 2]) + windows_of(epochs[1], [2, 2, 1])
    ref = big_batch_run(copy.deepcopy(start), windows)

    def run(use_iterate: bool) -> torch.nn.Module:
        model = copy.deepcopy(start)
        acc = Accumulator(sgd(model.parameters()), micro_batches={0: 3, 1: 2})
        for epoch in epochs:
            for xb, yb in acc.iterate(epoch) if use_iterate else epoch:
                acc.backward(F.cross_entropy(model(xb), yb), count=len(yb))
                if acc.window_full:
                    acc.step()
        if not use_iterate:
            acc.end_epoch()  # only once, at the very end
        return model

    assert update_rel_diff(start, run(True), ref) <= TOL64
    assert update_rel_diff(start, run(False), ref) > NAIVE_FAILS


def test_iterate_after_a_break_asks_for_end_epoch() -> None:
    model, acc = _acc(micro_batches=4)
    epoch = _epoch([8, 8, 8])
    for xb, yb in acc.iterate(epoch):
        acc.backward(F.cross_entropy(model(xb), yb), count=len(yb))
        break
    with pytest.raises(RuntimeError, match=r"acc\.end_epoch\(\)"):
        next(iter(acc.iterate(epoch)))
    acc.end_epoch()
    assert next(iter(acc.iterate(epoch))) is not None


def test_logged_loss_ignores_an_all_padding_micro_batch() -> None:
    """A micro-batch with 0 real tokens has a mean loss of 0/0 = nan; the window's loss is the
    mean over the real tokens of the others, as the big batch computes it."""
    model = TokenModel().double()
    acc = Accumulator(sgd(model.parameters()), micro_batches=3)
    mbs = _token_batches([40, 0, 120])
    for t, labels in mbs:
        acc.backward(token_loss(model(t), labels), labels=labels)
    result = acc.step()
    with torch.no_grad():
        copy_model = TokenModel().double()
        t = torch.cat([b[0] for b in mbs])
        labels = torch.cat([b[1] for b in mbs])
        expected = float(token_loss(copy_model(t), labels))
    assert math.isfinite(result.loss)
    assert result.loss == pytest.approx(expected, rel=1e-12)


def test_a_disabled_grad_scaler_never_steps_a_non_finite_gradient() -> None:
    """GradScaler(enabled=False) checks nothing: the window's own check stops the step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    start = [p.detach().clone() for p in model.parameters()]
    acc = Accumulator(sgd(model.parameters()), scaler=torch.amp.GradScaler("cpu", enabled=False))
    x, y = torch.randn(3, 4), torch.tensor([0, 1, 0])
    acc.backward(F.cross_entropy(model(x), y) * math.inf, count=3)
    with pytest.warns(NonFiniteGradientWarning):
        result = acc.step()
    assert result.skipped and result.non_finite and acc.optimizer_step == 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), start, strict=True))
