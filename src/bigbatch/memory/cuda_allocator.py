"""What PyTorch's CUDA caching allocator reserves for a sequence of allocations, without a GPU.

A CUDA OOM happens when the allocator cannot reserve a new segment, not when the bytes tensors
hold reach the card's size: rounding, the two pools and fragmentation make ``reserved`` larger
than ``allocated``. This replays a traced allocation sequence (from the fake-tensor prediction)
through a model of ``c10/cuda/CUDACachingAllocator.cpp``'s rules (defaults: no
``max_split_size_mb``, no expandable segments):

- every request is rounded up to a multiple of 512 bytes;
- requests up to 1 MiB come from the small pool, whose segments are 2 MiB; larger ones from the
  large pool, whose segments are 20 MiB for requests under 10 MiB, else the request rounded up
  to 2 MiB;
- a request takes the smallest cached free block of its pool that holds it (best fit), and the
  block is split when what remains is at least 512 bytes (small pool) or more than 1 MiB (large);
- a freed block merges with free neighbours of its segment and stays cached (reserved);
- each CUDA stream has blocks of its own: a segment belongs to the stream whose request made it,
  and a request takes only free blocks of its own stream (the allocator's pools are sorted by
  stream first), so what one stream frees another does not reuse until the cache is released
  (FSDP2 gathers weights and reduces gradients on streams of its own);
- among equal free blocks the lowest address is taken, so where the driver put each segment
  decides which one a request splits: :class:`DriverAddresses` places them as the CUDA driver
  does (its first reservation filled from its start, then new ones below the last).

Checked against allocation sequences whose layout PyTorch documents or users recorded with
``torch.cuda.memory_snapshot()``, and against the allocator events of whole training steps
recorded on an H100 (``tests/memory/test_gpu_truth.py``: the replay gives each recorded reserved
peak to the MiB where cuDNN's benchmark mode is off).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "AllocatorPeak",
    "CachingAllocatorModel",
    "DriverAddresses",
    "simulate",
]

MIN_BLOCK = 512
SMALL_SIZE = 2**20  # requests up to this come from the small pool
SMALL_BUFFER = 2 * 2**20  # small pool segment
LARGE_BUFFER = 20 * 2**20  # large pool segment for requests under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 * 2**20
ROUND_LARGE = 2 * 2**20
# The virtual address range the CUDA driver reserves first for a process's device memory: the
# allocator's first segments sit in it (in every trace make gpu-evidence recorded on an H100
# and an H200 with CUDA 13.0, the first 2 MiB segment at its top and the first 32 MiB one
# 510 MiB below).
FIRST_RESERVATION = 512 * 2**20


def round_size(n: int) -> int:
    """The block size a request of ``n`` bytes takes."""
    return MIN_BLOCK if n < MIN_BLOCK else MIN_BLOCK * math.ceil(n / MIN_BLOCK)


def segment_size(n: int) -> int:
    """The segment (cudaMalloc) the allocator reserves when no cached block holds ``n``."""
    if n <= SMALL_SIZE:
        return SMALL_BUFFER
    if n < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * math.ceil(n / ROUND_LARGE)


@dataclass(eq=False)
class _Block:
    segment: int
    offset: int
    size: int
    small: bool
    free: bool = True
    prev: _Block | None = None
    next: _Block | None = None
    base: int = 0  # its segment's address (the card's, or DriverAddresses' stand-in)
    stream: int = 0  # the stream whose request made its segment

    def key(self) -> tuple[int, int, int, int]:
        # The card's best fit: among its own stream's blocks, the smallest that holds the
        # request, the lowest address among equal sizes (the segment, in case two stand-in
        # addresses coincide).
        return (self.stream, self.size, self.base + self.offset, self.segment)


@dataclass
class DriverAddresses:
    """Where the CUDA driver puts each new segment (cudaMalloc), as far as the caching
    allocator's choice among equal free blocks (the lowest address) can tell: in the range it
    reserved first, in order, while a segment fits in what is left of it; past that, each below
    the last (new reservations are made downwards). Recorded traces replay to their reserved
    peaks to the byte with these addresses (``tests/memory/test_gpu_truth.py``), where taking
    equal blocks by the order their segments were made missed by up to 228 MiB.

    >>> where = DriverAddresses(first=64 * 2**20)
    >>> [(where.place(n * 2**20) - where.start) // 2**20 for n in (40, 20, 8, 2)]
    [0, 40, -8, 60]
    """

    first: int = FIRST_RESERVATION
    start: int = 1 << 62  # where the first reservation begins (only the order matters)
    used: int = 0  # bytes of the first reservation given, from its start
    below: int = 0  # the lowest address given outside it

    def place(self, nbytes: int) -> int:
        """The address of a new segment of ``nbytes``."""
        if self.used + nbytes <= self.first:
            self.used += nbytes
            return self.start + self.used - nbytes
        self.below = (self.below or self.start) - nbytes
        return self.below


@dataclass
class AllocatorPeak:
    """Peaks of one replayed sequence."""

    reserved_bytes: int  # segments held (what nvidia-smi shows, less the CUDA context)
    allocated_bytes: int  # rounded blocks in use at their peak
    segments: int
    # The reserved peak outside cuDNN's benchmark trials: what a card must hold, since a trial
    # takes only the memory that is free (CachingAllocatorModel.trial).
    settled_bytes: int = 0
    over_limit: int = 0  # requests that would OOM under the limit (simulate's)


@dataclass
class CachingAllocatorModel:
    """Replay allocations and frees; read ``reserved``/``allocated`` and their peaks.

    Under a ``limit`` (a card's memory less its context, or
    ``torch.cuda.set_per_process_memory_fraction``'s cap), a request that needs a segment past
    it first has the cache released, as the allocator does before it fails; one that still does
    not fit is an OOM (counted in ``over_limit``; the replay goes on as if it had fitted).

    >>> m = CachingAllocatorModel()
    >>> m.malloc("w", 40_000); m.reserved, m.allocated
    (2097152, 40448)
    """

    reserved: int = 0
    allocated: int = 0
    peak_reserved: int = 0
    peak_allocated: int = 0
    peak_settled: int = 0  # the reserved peak outside benchmark trials (:meth:`trial`)
    limit: int | None = None  # the bytes the allocator may reserve (None: no limit)
    over_limit: int = 0  # requests that did not fit under the limit even with the cache released
    _free: dict[bool, list[tuple[tuple[int, int, int, int], _Block]]] = field(
        default_factory=lambda: {True: [], False: []}
    )
    _live: dict[object, _Block] = field(default_factory=dict)
    _segments: list[int] = field(default_factory=list)  # sizes
    # Where the n-th segment is (its address): equal-sized free blocks are taken lowest address
    # first, as the card does, so the address decides which one a request splits, and how the
    # segments fragment. A replay of a recorded trace can give the card's own; otherwise the
    # driver's placement stands in (DriverAddresses).
    segment_address: Callable[[int], int] | None = None
    driver: DriverAddresses = field(default_factory=DriverAddresses)

    def malloc(self, key: object, nbytes: int, *, trial: bool = False, stream: int = 0) -> None:
        """Allocate ``nbytes`` under ``key`` on ``stream`` (0: the default stream); a benchmark
        ``trial``'s (:meth:`trial`) reserved bytes are left out of ``peak_settled``.

        >>> m = CachingAllocatorModel()
        >>> m.malloc("gathered", 30 * 2**20, stream=1); m.free("gathered")
        >>> m.malloc("activation", 30 * 2**20); m.reserved // 2**20  # not the freed block
        60
        """
        if nbytes <= 0:
            return  # an empty storage holds no memory
        if key in self._live:
            raise ValueError(f"allocation {key!r} is already live")
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._best_fit(small, size, stream)
        if block is None:
            seg = segment_size(size)
            self.over_limit += not self._room_for(seg)
            self._segments.append(seg)
            self.reserved += seg
            index = len(self._segments) - 1
            base = self.segment_address(index) if self.segment_address else self.driver.place(seg)
            block = _Block(index, 0, seg, small, base=base, stream=stream)
        else:
            self._remove_free(block)
        remaining = block.size - size
        if (remaining >= MIN_BLOCK) if small else (remaining > SMALL_SIZE):
            rest = _Block(
                block.segment,
                block.offset + size,
                remaining,
                small,
                True,
                block,
                block.next,
                block.base,
                block.stream,
            )
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            self._add_free(rest)
        block.free = False
        self._live[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        if not trial:
            self.peak_settled = max(self.peak_settled, self.reserved)

    def _room_for(self, segment: int) -> bool:
        """Whether a new segment of ``segment`` bytes fits under the ``limit``: where it would
        not, the cached segments are released first, as the allocator does before it fails."""
        if self.limit is None or self.reserved + segment <= self.limit:
            return True
        self.empty_cache()
        return self.reserved + segment <= self.limit

    def trial(self, key: object, nbytes: int, stream: int = 0) -> int:
        """cuDNN's benchmark-mode workspace of ``nbytes``, as PyTorch asks for it: where a new
        segment would take the reserved bytes past the ``limit``, the allocator first releases
        its cached segments, then the request fails and PyTorch halves it, until it fits (never
        an OOM); the bytes taken.

        >>> m = CachingAllocatorModel(limit=128 * 2**20)
        >>> m.malloc("weights", 60 * 2**20)
        >>> m.trial(("trial", 1), 100 * 2**20) // 2**20, m.over_limit
        (50, 0)
        """
        while nbytes:
            size = round_size(nbytes)
            fits = self._best_fit(size <= SMALL_SIZE, size, stream)
            if fits or self._room_for(segment_size(size)):
                self.malloc(key, nbytes, trial=True, stream=stream)
                break
            nbytes //= 2
        return nbytes

    def free(self, key: object) -> None:
        block = self._live.pop(key, None)
        if block is None:
            return  # an empty storage, or one allocated before the replay began
        self.allocated -= block.size
        block.free = True
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self._remove_free(neighbour)
                if neighbour is block.prev:
                    neighbour.size += block.size
                    neighbour.next = block.next
                    if block.next is not None:
                        block.next.prev = neighbour
                    block = neighbour
                else:
                    block.size += neighbour.size
                    block.next = neighbour.next
                    if neighbour.next is not None:
                        neighbour.next.prev = block
        self._add_free(block)

    def empty_cache(self) -> None:
        """Release every segment with nothing in use, as ``torch.cuda.empty_cache()`` does
        and as cuDNN's benchmark mode does after each convolution's trials (PyTorch empties the
        cache so that the trials' workspace is not kept).

        >>> m = CachingAllocatorModel()
        >>> m.malloc("trial", 300 * 2**20); m.free("trial"); m.malloc("w", 4096)
        >>> m.empty_cache(); m.reserved // 2**20, m.peak_reserved // 2**20
        (2, 302)
        """
        for small, pool in self._free.items():
            whole = [e for e in pool if e[1].prev is None and e[1].next is None]
            self._free[small] = [e for e in pool if e[1].prev is not None or e[1].next is not None]
            self.reserved -= sum(b.size for _, b in whole)

    def segment_layout(self, segment: int) -> list[tuple[int, bool]]:
        """(size, in use) of each block of a segment, in address order (as a snapshot lists)."""
        blocks = [b for _, b in self._free[True] + self._free[False] if b.segment == segment]
        blocks += [b for b in self._live.values() if b.segment == segment]
        return [(b.size, not b.free) for b in sorted(blocks, key=lambda b: b.offset)]

    def _best_fit(self, small: bool, size: int, stream: int) -> _Block | None:
        pool = self._free[small]
        i = bisect.bisect_left(pool, ((stream, size, -1, -1),))
        if i < len(pool) and pool[i][1].stream == stream:
            return pool[i][1]
        return None

    def _add_free(self, block: _Block) -> None:
        bisect.insort(self._free[block.small], (block.key(), block), key=lambda e: e[0])

    def _remove_free(self, block: _Block) -> None:
        pool = self._free[block.small]
        i = bisect.bisect_left(pool, (block.key(),), key=lambda e: e[0:1])
        if i >= len(pool) or pool[i][1] is not block:
            raise RuntimeError("allocator model: free block not found")  # a bug, not input
        del pool[i]


def simulate(events: Iterable[tuple[str, Any, int]], limit: int | None = None) -> AllocatorPeak:
    """Replay ``("malloc", key, bytes)`` and ``("free", key, 0)`` events, cuDNN's benchmark
    trials (``("trial", key, bytes)``, halved to fit ``limit`` bytes reserved), emptied
    caches (``("empty_cache", None, 0)``) and changes of the current stream
    (``("stream", number, 0)``: the requests after it are that stream's, 0 the default one);
    return the peaks (and how many requests would run out under ``limit``).

    >>> simulate([("malloc", "a", 6 * 2**20), ("malloc", "b", 6 * 2**20), ("free", "a", 0),
    ...           ("malloc", "c", 7 * 2**20), ("malloc", "d", 7 * 2**20)]).reserved_bytes // 2**20
    40
    """
    model = CachingAllocatorModel(limit=limit)
    stream = 0
    for op, key, nbytes in events:
        if op == "malloc":
            model.malloc(key, nbytes, stream=stream)
        elif op == "trial":
            model.trial(key, nbytes, stream)
        elif op == "stream":
            stream = key
        elif op == "empty_cache":
            model.empty_cache()
        else:
            model.free(key)
    return AllocatorPeak(
        model.peak_reserved,
        model.peak_allocated,
        len(model._segments),
        model.peak_settled,
        model.over_limit,
    )
