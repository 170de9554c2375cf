"""Exactness across processes (2 CPU ranks, gloo on 127.0.0.1) against one process computing the
big batch over all ranks' data; plain DDP with loss / N is the negative control."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from bigbatch.verify.distributed import run_distributed, verify_distributed
from distributed_scenarios import (
    fails,
    net,
    oom_on_one_rank,
    port_taken_once,
    rank_data,
    sgd,
    uneven_data,
)

TOL64 = 1e-12

# Every test here starts gloo processes (a few seconds each).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ddp_rows() -> list:
    return verify_distributed(2)


def test_exact_across_ranks_with_uneven_sizes_and_tokens(ddp_rows: list) -> None:
    ours = [r for r in ddp_rows if r.method == "bigbatch"]
    # 3 cases x DDP sync last/step, FSDP2 sync every; FSDP2 sync last where windows fill.
    assert len(ours) == 11
    assert sum("fsdp" in r.dtype for r in ours) == 5
    for r in ours:
        assert r.passed and r.max_rel <= TOL64, (r.case, r.dtype, r.max_rel)
        assert "ranks equal after the step: True" in r.explanation


def test_plain_ddp_with_loss_over_n_fails_the_same_check(ddp_rows: list) -> None:
    for r in (r for r in ddp_rows if r.method == "naive"):
        assert not r.passed and r.max_rel > 0.1, r.case


def test_gradients_sync_once_per_window_not_mid_window(ddp_rows: list) -> None:
    by = {(r.case, r.dtype): r.explanation for r in ddp_rows}
    last = by[("ddp_uneven_ranks", "float64/sync_last")]
    assert "synchronised mid-window: False" in last
    assert last.startswith("1 DDP bucket all-reduce(s) + 2 bigbatch")  # DDP once; count; epoch end
    step = by[("ddp_uneven_ranks", "float64/sync_step")]
    assert step.startswith("0 DDP bucket all-reduce(s) + 3 bigbatch")  # count, gradients, epoch end
    naive = next(
        r.explanation for r in ddp_rows if r.case == "ddp_uneven_ranks" and r.method == "naive"
    )
    assert "2 DDP bucket all-reduce(s)" in naive and "synchronised mid-window: True" in naive


def _big_batch(windows: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> torch.nn.Module:
    model = net()
    opt = sgd(model)
    for window in windows:
        x = torch.cat([b[0] for b in window])
        y = torch.cat([b[1] for b in window])
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model


def _load(tmp: Path, name: str) -> list[dict]:
    return [torch.load(tmp / f"{name}-{r}.pt", weights_only=True) for r in (0, 1)]


def _rel(params: list[torch.Tensor], model: torch.nn.Module) -> float:
    return max(
        float((p - q.detach()).abs().max() / q.detach().abs().max())
        for p, q in zip(params, model.parameters(), strict=True)
    )


def test_a_taken_port_is_retried_and_failed_workers_leave_no_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A port taken between finding and binding it is retried on another; any other failure is
    raised; either way the files torch's workers write their tracebacks to are removed."""
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # where torch puts those files
    run_distributed(port_taken_once, 2, str(tmp_path))
    ports = (tmp_path / "ports.txt").read_text().split()
    assert len(ports) == 2  # the second run, on a port found again, went through
    with pytest.raises(torch.multiprocessing.ProcessRaisedException, match="not a port problem"):
        run_distributed(fails, 2, str(tmp_path))
    assert list(temp.iterdir()) == []


def test_oom_on_one_rank_shrinks_every_rank_without_deadlock(tmp_path: Path) -> None:
    run_distributed(oom_on_one_rank, 2, str(tmp_path))
    r0, r1 = _load(tmp_path, "oom")
    assert r0["extra"][0] == r1["extra"][0] == [(16, 8)]  # both ranks backed off, together
    assert r0["extra"][1] == r1["extra"][1] == [1, 10]  # maxima_over_ranks: on every rank
    assert all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"], strict=True))
    d0, d1 = rank_data(0, [24, 24, 24]), rank_data(1, [24, 24, 24])
    reference = _big_batch([[d0[k], d1[k]] for k in range(3)])
    assert _rel(r0["params"], reference) <= TOL64


def test_ranks_that_run_out_of_data_at_different_times(tmp_path: Path) -> None:
    run_distributed(uneven_data, 2, str(tmp_path))
    r0, r1 = _load(tmp_path, "uneven")
    assert r0["extra"] == r1["extra"] == 3  # the same optimizer steps on both ranks
    assert all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"], strict=True))
    d0, d1 = rank_data(0, [4, 6, 8, 2, 5]), rank_data(1, [7, 3, 9])
    # Global windows: both ranks' first pair; rank 0's second pair with rank 1's last; rank 0's last.
    reference = _big_batch([[d0[0], d0[1], d1[0], d1[1]], [d0[2], d0[3], d1[2]], [d0[4]]])
    assert _rel(r0["params"], reference) <= TOL64
    # Negative control: dropping the lone micro-batches (what drop_last would do) differs.
    assert _rel(r0["params"], _big_batch([[d0[0], d0[1], d1[0], d1[1]], [d0[2], d0[3]]])) > 1e-3


def test_cli_verify_distributed(capsys: pytest.CaptureFixture[str]) -> None:
    from bigbatch.cli.main import main

    assert main(["verify", "--distributed", "2"]) == 0
    out = capsys.readouterr().out
    assert "ddp_tokens" in out and "DIFFERS" in out
    assert main(["verify", "--distributed", "3"]) == 2


def test_cached_contrastive_across_ranks_equals_one_process_big_batch(tmp_path: Path) -> None:
    from distributed_scenarios import CONTRASTIVE_SIZES, cached_contrastive, contrastive_views
    from distributed_scenarios import info_nce as loss_fn

    run_distributed(cached_contrastive, 2, str(tmp_path))
    r0, r1 = [torch.load(tmp_path / f"cached-{r}.pt", weights_only=True) for r in (0, 1)]
    assert all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"], strict=True))
    # One process: all of rank 0's rows, then rank 1's, in one InfoNCE over the 18 pairs.
    model = net()
    opt = sgd(model)
    views = [v for r in (0, 1) for v in contrastive_views(r, CONTRASTIVE_SIZES[r])]
    z1 = model(torch.cat([v[0] for v in views]))
    z2 = model(torch.cat([v[1] for v in views]))
    loss_fn(z1, z2).backward()
    opt.step()
    assert _rel(r0["params"], model) <= TOL64
    # Negative control: each rank's own InfoNCE (its rows' negatives only), averaged.
    local = net()
    opt = sgd(local)
    total = 0
    for r in (0, 1):
        rows = contrastive_views(r, CONTRASTIVE_SIZES[r])
        a = local(torch.cat([v[0] for v in rows]))
        b = local(torch.cat([v[1] for v in rows]))
        total = total + len(a) * loss_fn(a, b)
    (total / 18).backward()
    opt.step()
    assert _rel(r0["params"], local) > 1e-3
