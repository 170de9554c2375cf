"""The CUDA caching-allocator model against allocation sequences with known layouts.

No GPU here: each expected layout is PyTorch's documented behaviour or a layout users recorded
with torch.cuda.memory_snapshot() (cited per test); whole training steps recorded on a GPU are
replayed in test_gpu_truth.py."""

from __future__ import annotations

from bigbatch.memory.cuda_allocator import (
    CachingAllocatorModel,
    round_size,
    segment_size,
    simulate,
)

MiB = 2**20


def test_rounding_and_segment_sizes() -> None:
    assert [round_size(n) for n in (1, 512, 513, 40_000)] == [512, 512, 1024, 40_448]
    assert segment_size(40_448) == 2 * MiB  # small pool
    assert segment_size(8_519_680) == 20 * MiB  # large, under 10 MiB
    assert segment_size(30 * MiB + 1) == 32 * MiB  # large: rounded up to 2 MiB


def test_matmul_snapshot_recorded_by_a_user() -> None:
    """`y = X @ W + b` with W 1000x10, b 10, X 1000 (fp32): the small segment a user recorded
    (discuss.pytorch.org/t/178671): blocks 40448 W, 512 b, 4096 X, 512 free (the matmul's
    result, freed after the add), 512 y, then the free rest; allocated 45568 of 2097152."""
    m = CachingAllocatorModel()
    m.malloc("W", 40_000)
    m.malloc("b", 40)
    m.malloc("X", 4_000)
    m.malloc("XW", 40)
    m.malloc("y", 40)
    m.free("XW")
    assert m.segment_layout(0) == [
        (40_448, True),
        (512, True),
        (4_096, True),
        (512, False),
        (512, True),
        (2_097_152 - 46_080, False),
    ]
    assert (m.allocated, m.reserved) == (45_568, 2_097_152)
    # The same user's cuBLAS workspace: 8519680 bytes in a 20 MiB large segment.
    m.malloc("cublas", 8_519_680)
    assert m.segment_layout(1) == [(8_519_680, True), (20 * MiB - 8_519_680, False)]
    assert m.reserved == 2 * MiB + 20 * MiB


def test_fragmentation_reserves_more_than_is_allocated() -> None:
    """Two 6 MiB blocks share a 20 MiB segment; freeing the first leaves a 6 MiB hole a 7 MiB
    request cannot use: the first 7 MiB takes the 8 MiB tail whole (a 1 MiB rest is not split
    off a large block), the second a new segment. 40 MiB reserved for 21 MiB allocated."""
    m = CachingAllocatorModel()
    for key in ("a", "b"):
        m.malloc(key, 6 * MiB)
    m.free("a")
    m.malloc("c", 7 * MiB)
    assert m.reserved == 20 * MiB
    m.malloc("d", 7 * MiB)
    assert m.reserved == 40 * MiB and m.allocated == 21 * MiB
    assert m.peak_reserved == 40 * MiB


def test_freed_neighbours_merge_and_are_reused() -> None:
    """Best fit after merging: freeing two adjacent 4 MiB blocks makes one 8 MiB block that
    an 8 MiB request reuses: nothing new is reserved."""
    m = CachingAllocatorModel()
    for key in ("a", "b", "c"):
        m.malloc(key, 4 * MiB)
    m.free("a")
    m.free("b")
    m.malloc("d", 8 * MiB)
    assert m.reserved == 20 * MiB and m.segment_layout(0)[0] == (8 * MiB, True)


def test_large_blocks_split_only_above_one_mebibyte() -> None:
    """A large-pool remainder of 1 MiB or less stays with the block (counted as allocated)."""
    m = CachingAllocatorModel()
    m.malloc("a", 19 * MiB + 512)  # remainder just under 1 MiB: not split
    assert m.allocated == 20 * MiB
    m = CachingAllocatorModel()
    m.malloc("a", 18 * MiB)  # remainder 2 MiB: split
    assert m.allocated == 18 * MiB


def test_simulate_replays_events_and_small_pool_is_separate() -> None:
    peak = simulate([("malloc", i, 1000) for i in range(3)] + [("malloc", "big", 2 * MiB)])
    assert peak.segments == 2 and peak.reserved_bytes == 2 * MiB + 20 * MiB
    assert peak.allocated_bytes == 3 * 1024 + 2 * MiB


def test_a_cuda_plan_fits_what_the_allocator_reserves() -> None:
    """predict_peak for a CUDA device replays its traced allocations, the cuBLAS workspaces
    among them, through the model: the plan's number is the reserved peak plus the handle
    autograd's thread makes outside the allocator, above the allocated peak."""
    import torch

    from bigbatch.memory.predict import predict_peak
    from bigbatch.memory.step import StepSpec

    def net() -> torch.nn.Module:
        return torch.nn.Sequential(
            torch.nn.Linear(1000, 3000), torch.nn.ReLU(), torch.nn.Linear(3000, 10)
        )

    pred = predict_peak(StepSpec(net, (1000,), 64, device="cuda"))
    assert pred.reserved_bytes >= pred.peak_bytes
    # Both threads multiply matrices: two 32 MiB workspaces inside, one handle outside.
    assert pred.library_workspace_bytes == 2 * 32 * MiB and pred.cuda_handle_bytes == 64 * MiB
    assert pred.planning_bytes == pred.reserved_bytes + 64 * MiB
    assert pred.allocated_bytes >= pred.peak_bytes + 2 * 32 * MiB
    parts = pred.parts()
    assert parts["allocator_cache"] == pred.reserved_bytes - pred.peak_bytes - 64 * MiB
    assert "cuBLAS workspaces" in pred.breakdown()
    cpu = predict_peak(StepSpec(net, (1000,), 64))
    assert cpu.reserved_bytes == 0 and cpu.planning_bytes == cpu.peak_bytes


def test_under_a_limit_the_cache_is_released_before_a_request_runs_out() -> None:
    """Past the limit, the allocator releases its cached segments and tries again (a 60 MiB
    segment held free makes room for 70 MiB under 100 MiB); a request that still does not fit
    is an OOM, counted; without the limit nothing is released."""
    events = [("malloc", "a", 60 * MiB), ("free", "a", 0), ("malloc", "b", 70 * MiB)]
    capped, free = simulate(events, limit=100 * MiB), simulate(events)
    assert (capped.reserved_bytes, capped.over_limit) == (70 * MiB, 0)
    assert (free.reserved_bytes, free.over_limit) == (130 * MiB, 0)
    assert simulate([*events, ("malloc", "c", 40 * MiB)], limit=100 * MiB).over_limit == 1


def test_each_stream_reuses_only_its_own_blocks() -> None:
    """c10's CUDACachingAllocator sorts its pools by stream before size and takes a free block
    only of the requesting stream (``get_free_block``); a segment belongs to the stream that
    made it (``memory_snapshot()`` lists each segment's ``stream``). So a 30 MiB block freed
    on a side stream (FSDP2's all-gather output) is no use to the default stream, which makes a
    segment of its own (torch's FSDP2 speaks of this "inter-stream fragmentation"), while the
    side stream takes its block back; emptying the cache releases the free segments of both.
    Replayed with the streams left out, the same events reserve one segment: the control."""
    side = [("stream", 1, 0), ("malloc", "gathered", 30 * MiB), ("free", "gathered", 0)]
    default = [("stream", 0, 0), ("malloc", "activation", 30 * MiB)]
    again = [("stream", 1, 0), ("malloc", "gathered again", 30 * MiB)]
    assert simulate(side + default + again).reserved_bytes == 60 * MiB
    assert simulate(side + default + again).segments == 2
    without = [e for e in side + default + again if e[0] != "stream"]
    assert simulate(without[:-1]).reserved_bytes == 30 * MiB
    m = CachingAllocatorModel()
    m.malloc("gathered", 30 * MiB, stream=1)
    m.malloc("small", 4096, stream=1)
    m.free("gathered")
    m.free("small")
    m.malloc("activation", 4096)  # the default stream's own small segment
    assert m.reserved == 30 * MiB + 2 * 2 * MiB
    m.empty_cache()
    assert m.reserved == 2 * MiB  # only the default stream's segment is in use
    # A benchmark trial on a side stream under a limit takes only what that stream may.
    capped = CachingAllocatorModel(limit=100 * MiB)
    capped.malloc("weights", 60 * MiB)
    capped.free("weights")
    assert capped.trial("trial", 80 * MiB, stream=1) == 80 * MiB  # the cache released for it
    assert capped.reserved == 80 * MiB


def test_changing_lengths_climb_the_reserved_peak_but_not_the_need() -> None:
    """A language model's micro-steps padded to each batch's longest sequence (1024-2048
    tokens): every large tensor changes size from one micro-step to the next, the blocks each
    size left stay cached, and the reserved peak climbs to twice the same steps at one length;
    under a cap the allocator gives its cache back instead and nothing runs out, so a refit
    must not read that climb as need (``step_need_bytes``)."""
    import random

    def run(vary: bool, limit: int | None = None) -> CachingAllocatorModel:
        model = CachingAllocatorModel(limit=limit)
        model.malloc("weights", 1000 * MiB)
        lengths = random.Random(0)
        for step in range(32):
            tokens = lengths.randint(1024, 2048) if vary else 2048
            # activations, logits, their float32 copy, then its gradient (MiB per 8 tokens)
            for name, size in (("act", 128), ("logits", 256), ("up", 512)):
                model.malloc((name, step), tokens * size * 1024)
            model.free(("logits", step))
            model.malloc(("grad", step), tokens * 512 * 1024)
            for name in ("up", "act", "grad"):
                model.free((name, step))
        return model

    fixed, varied = run(vary=False), run(vary=True)
    assert varied.peak_allocated <= fixed.peak_allocated
    assert varied.peak_reserved > 1.9 * fixed.peak_reserved  # 7402 MiB against 3816
    capped = run(vary=True, limit=fixed.peak_reserved)
    assert capped.over_limit == 0 and capped.peak_reserved <= fixed.peak_reserved
