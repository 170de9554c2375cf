"""Lightning's Trainer.fit with ExactAccumulation equals the big batch; its own
accumulate_grad_batches does not (the negative control)."""

from __future__ import annotations

import warnings

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

L = pytest.importorskip("lightning.pytorch")
from bigbatch.integrations.lightning import ExactAccumulation, exact_backward  # noqa: E402

LR = 0.5


class Lit(L.LightningModule):
    def __init__(self, batches: list[Batch], exact: bool, scheduler: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(FEATURES, CLASSES)
        self.batches = batches
        self.exact = exact
        self.scheduler = scheduler
        self.automatic_optimization = not exact

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = loss_of(self.net(x), y)
        if self.exact:
            exact_backward(self, loss, labels=y)
        return loss

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        # Each item is a whole micro-batch, of the size the scenario gives.
        return torch.utils.data.DataLoader(self.batches, batch_size=None)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        opt = torch.optim.SGD(self.parameters(), lr=LR)
        if not self.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def fit(module: Lit, epochs: int = 1, **trainer_kwargs: object) -> L.Trainer:
    trainer = L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=trainer_kwargs.pop("devices", 1),
        precision=trainer_kwargs.pop("precision", "64-true"),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        warnings.filterwarnings("ignore", ".*smaller than the logging interval.*")
        trainer.fit(module)
    return trainer


def init_params() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    net = nn.Linear(FEATURES, CLASSES)
    return net.weight.detach().double(), net.bias.detach().double()


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_fit_equals_big_batch_and_accumulate_grad_batches_does_not(name: str) -> None:
    batches, n = SCENARIOS[name]
    init = init_params()
    want = reference_update(*init, windows_of(batches, n), LR)

    exact = Lit(batches, exact=True)
    trainer = fit(exact, callbacks=[ExactAccumulation(n)])
    got = (exact.net.weight, exact.net.bias)
    assert rel_err(got, want, init) < 1e-12
    assert trainer.global_step == len(windows_of(batches, n))  # optimizer steps

    builtin = Lit(batches, exact=False)
    fit(builtin, accumulate_grad_batches=n)
    assert rel_err((builtin.net.weight, builtin.net.bias), want, init) > 0.1


def test_epoch_schedule_clipping_and_step_scheduler() -> None:
    batches = sample_batches([5, 9, 3], seed=4)
    init = init_params()
    # epoch 0: windows of 2 -> [5, 9], [3]; epoch 1: windows of 4 -> [5, 9, 3]
    windows = [*windows_of(batches, 2), batches]
    module = Lit(batches, exact=True, scheduler=True)
    callback = ExactAccumulation({0: 2, 1: 4}, clip_grad_norm=0.05, log_window_loss=True)
    trainer = fit(module, epochs=2, callbacks=[callback])
    assert trainer.global_step == 3
    # the last window's exact mean loss is logged
    assert callback.last_step is not None
    assert float(trainer.callback_metrics["window_loss"]) == pytest.approx(callback.last_step.loss)
    assert module.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(LR / 8)
    # the reference: clipped big-batch SGD with the LR halved after each optimizer step
    w, b = init
    for i, window in enumerate(windows):
        w, b = reference_update(w, b, [window], LR * 0.5**i, clip=0.05)
    assert rel_err((module.net.weight, module.net.bias), (w, b), init) < 1e-12


def test_bf16_mixed_precision_equals_the_core_accumulator_under_the_same_autocast() -> None:
    from bigbatch import Accumulator

    batches, n = SCENARIOS["short_last"]
    batches = [(x.float(), y) for x, y in batches]
    module = Lit(batches, exact=True)
    fit(module, precision="bf16-mixed", callbacks=[ExactAccumulation(n)])
    got = (module.net.weight, module.net.bias)

    # bf16 rounds each micro-batch's weight gradient (a bf16 matmul output), so the sharp check
    # is against bigbatch's own loop with the same micro-batches and autocast ...
    core = Lit(batches, exact=False)
    acc = Accumulator(torch.optim.SGD(core.parameters(), lr=LR), micro_batches=n)
    for x, y in acc.iterate(batches):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_of(core.net(x), y)
        acc.backward(loss, labels=y)
        if acc.window_full:
            acc.step()
    init = init_params()
    assert rel_err(got, (core.net.weight, core.net.bias), init) == 0.0  # the same computation
    # ... and the big batch agrees to the round-off of the big batch itself under bf16 autocast,
    # the check Lightning's own accumulation fails.
    want = reference_update(*init, [batches], LR)
    tol = roundoff_tol(init, [batches], LR, autocast=torch.bfloat16)
    assert rel_err(got, want, init) <= tol
    builtin = Lit(batches, exact=False)
    fit(builtin, precision="bf16-mixed", accumulate_grad_batches=n)
    assert rel_err((builtin.net.weight, builtin.net.bias), want, init) > tol


def test_misuse_is_refused_with_the_fix() -> None:
    batches, n = SCENARIOS["uneven"]
    with pytest.raises(RuntimeError, match="automatic_optimization = False"):
        fit(Lit(batches, exact=False), callbacks=[ExactAccumulation(n)])
    # Lightning itself refuses accumulate_grad_batches with manual optimisation, naming the fix.
    with pytest.raises(Exception, match="Remove `Trainer\\(accumulate_grad_batches"):
        fit(Lit(batches, exact=True), accumulate_grad_batches=2, callbacks=[ExactAccumulation(n)])
    with pytest.raises(RuntimeError, match="callbacks=\\[ExactAccumulation"):
        fit(Lit(batches, exact=True))
    with pytest.raises(ValueError, match="how big a window"):
        ExactAccumulation()


def test_a_checkpointed_batchnorm_counts_each_micro_batch_once() -> None:
    """Through ``exact_backward``, a checkpointed block's recomputation in backward does not
    move BatchNorm's running statistics again: one count a micro-batch, as without."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    batches, n = SCENARIOS["uneven"]
    module = Lit(batches, exact=True)
    norm = nn.BatchNorm1d(CLASSES).double()
    module.net = nn.Sequential(checkpoint_wrapper(nn.Sequential(module.net.double(), norm)))
    fit(module, callbacks=[ExactAccumulation(n)])
    assert int(norm.num_batches_tracked) == len(batches)


class StepsItself(Lit):
    """Manual optimisation misused: no exact_backward, or an optimizer step of its own."""

    def __init__(self, batches: list[Batch], mode: str) -> None:
        super().__init__(batches, exact=True)
        self.mode = mode

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = loss_of(self.net(x), y)
        opt = self.optimizers()
        if self.mode == "exact_and_step":
            exact_backward(self, loss, labels=y)
            opt.step()
        elif self.mode == "manual_backward":
            self.manual_backward(loss)
        else:  # plain manual optimisation, as Lightning's docs show it
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        return loss


@pytest.mark.parametrize("mode", ["manual_backward", "plain_step", "exact_and_step"])
def test_manual_optimisation_that_bypasses_the_window_is_refused(mode: str) -> None:
    """Without exact_backward the fit used to end with global_step 0 and untouched weights; with
    an optimizer.step() of its own it stepped on partial windows (off by 1.6-2.3)."""
    batches, n = SCENARIOS["uneven"]
    fix = "did not call exact_backward" if mode == "manual_backward" else "remove optimizer.step"
    with pytest.raises(RuntimeError, match=fix):
        fit(StepsItself(batches, mode), callbacks=[ExactAccumulation(n)])


class RankLit(Lit):
    """Each rank trains on its own micro-batches (uneven sizes, a partial last window)."""

    def __init__(self, per_rank: list[list[Batch]]) -> None:
        super().__init__(per_rank[0], exact=True)
        self.per_rank = per_rank

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.per_rank[self.global_rank], batch_size=None)


RANK_SIZES = {0: [4, 12, 5], 1: [16, 3, 7]}


def rank_batches(rank: int) -> list[Batch]:
    return sample_batches(RANK_SIZES[rank], seed=7 + rank)


def ddp_worker(rank: int, world: int, port: int, out: str, exact: bool) -> None:
    """One of 2 gloo processes that bigbatch's own launcher started (it ends them with os._exit:
    torch 2.14's gloo can abort a finished process in interpreter teardown, as Lightning's
    ddp_spawn workers do). Lightning takes the process group as a torchelastic launch."""
    import os

    os.environ.update(
        TORCHELASTIC_RUN_ID="bigbatch-test", RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    module = RankLit([rank_batches(0), rank_batches(1)])
    kwargs: dict[str, object] = {"callbacks": [ExactAccumulation(2)]}
    if not exact:
        module.automatic_optimization, module.exact = True, False
        kwargs = {"accumulate_grad_batches": 2}
    fit(module, devices=world, strategy="ddp", use_distributed_sampler=False, **kwargs)
    if rank == 0:
        torch.save([module.net.weight.detach(), module.net.bias.detach()], out)


@pytest.mark.slow
def test_ddp_two_processes_equals_the_big_batch_over_both_ranks(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from bigbatch.verify.distributed import run_distributed

    rank0, rank1 = rank_batches(0), rank_batches(1)
    # window 1: both ranks' first two micro-batches; window 2 (at the epoch's end): the rest
    windows = [[*rank0[:2], *rank1[:2]], [rank0[2], rank1[2]]]
    init = init_params()
    want = reference_update(*init, windows, LR)
    for exact in (True, False):
        out = tmp_path / f"exact-{exact}.pt"
        run_distributed(ddp_worker, 2, str(out), exact)
        got = tuple(torch.load(out, weights_only=True))
        if exact:
            assert rel_err(got, want, init) < 1e-12  # float64 all the way
        else:  # Lightning's own accumulate_grad_batches under DDP
            assert rel_err(got, want, init) > 0.1
