"""GPU cards by name, for planning from a machine that does not have them: ``budget=t4``.

A card's budget is the memory its driver reports (``nvidia-smi``'s ``memory.total``, which is
``torch.cuda.mem_get_info()``'s total), and the plan keeps that card's CUDA context out of it as
the overhead, as it keeps the measured context out on a GPU at hand. The totals are readings
from such cards (the source of each is listed); the context was measured on an H100 and an H200
(CUDA 13.0, torch 2.11: :data:`bigbatch.memory.cuda_runtime.CUDA_CONTEXT_BYTES`) and is taken as
the estimate for the others, whose driver and CUDA version may differ: on the card itself,
``overhead=`` (or ``--overhead``) sets what ``nvidia-smi`` shows a CUDA process holding before it
allocates. A card that also drives a display holds that display's memory too (hundreds of MiB).

>>> card = find_card("Kaggle T4")
>>> card.name, card.total_bytes // 2**20
('NVIDIA T4 16 GB', 15360)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from bigbatch.device import AMPERE
from bigbatch.memory.cuda_runtime import CUDA_CONTEXT_BYTES

__all__ = ["CARDS", "Card", "find_card"]

MiB = 2**20
_MODAL = "nvidia-smi in modal-labs/modal-client#2797, a cloud's GPUs"


@dataclass(frozen=True)
class Card:
    """A GPU as a budget: what its driver reports, the CUDA context a training process holds
    on it, where each figure comes from, and its compute capability (bf16 in hardware or not).

    >>> t4 = find_card("Kaggle T4")
    >>> t4.key, t4.compute_capability, t4.emulates_bf16
    ('t4', (7, 5), True)
    """

    key: str  # what budget= takes (aliases below too)
    name: str
    total_bytes: int
    source: str  # of the total
    context_bytes: int = CUDA_CONTEXT_BYTES
    context_measured: bool = False  # measured on this card (else the H100's, as an estimate)
    aliases: tuple[str, ...] = ()
    # NVIDIA's compute capability (its CUDA GPUs table): bfloat16 units and FlashAttention 2
    # from Ampere's (bigbatch.device.AMPERE). Every card below gives its own.
    compute_capability: tuple[int, int] = (0, 0)

    @property
    def emulates_bf16(self) -> bool:
        """Whether torch runs bfloat16 here in float32 emulation, several times slower than
        float16 (a T4, a P100: before Ampere), though ``torch.cuda.is_bf16_supported()`` says
        True there.

        >>> find_card("t4").emulates_bf16, find_card("l4").emulates_bf16
        (True, False)
        """
        return self.compute_capability < AMPERE

    @property
    def auto_precision(self) -> str:
        """What ``precision=auto`` trains in on this card: bf16, or fp16 where it only
        emulates bf16 (:func:`bigbatch.device.auto_precision` on the card itself).

        >>> find_card("t4").auto_precision, find_card("a100-80gb").auto_precision
        ('fp16', 'bf16')
        """
        return "fp16" if self.emulates_bf16 else "bf16"

    @property
    def short_name(self) -> str:
        """``NVIDIA T4 16 GB`` as ``T4``: the model alone."""
        return re.sub(r" \d+ GB.*", "", self.name.removeprefix("NVIDIA ").removeprefix("GeForce "))

    def bf16_note(self, fix: str) -> str:
        """What a plan in bfloat16 for this card says where the card only emulates it, with
        ``fix``, the way to train in float16 instead."""
        major, minor = self.compute_capability
        return (
            f"the {self.short_name} (compute capability {major}.{minor}) has no bfloat16 units: "
            f"torch emulates bf16 there, several times slower than fp16 in the same memory; {fix}"
        )

    @property
    def context_note(self) -> str:
        how = "measured on it" if self.context_measured else "estimated: the H100's measured one"
        return f"CUDA context {self.context_bytes / MiB:.0f} MiB ({how})"


CARDS: tuple[Card, ...] = (
    Card(
        "t4",
        "NVIDIA T4 16 GB",
        15360 * MiB,
        _MODAL,
        aliases=("kaggle-t4", "colab-t4", "tesla-t4"),
        compute_capability=(7, 5),
    ),
    Card(
        "p100",
        "NVIDIA P100 16 GB",
        16 * 1024 * MiB,
        "nominal 16 GiB of HBM2 (no reading at hand: check nvidia-smi on the card)",
        aliases=("kaggle-p100", "tesla-p100"),
        compute_capability=(6, 0),
    ),
    Card("l4", "NVIDIA L4 24 GB", 23034 * MiB, _MODAL, compute_capability=(8, 9)),
    Card(
        "a10g",
        "NVIDIA A10G 24 GB",
        23028 * MiB,
        _MODAL + ", as the A10",
        aliases=("a10",),
        compute_capability=(8, 6),
    ),
    Card("l40s", "NVIDIA L40S 48 GB", 46068 * MiB, _MODAL, compute_capability=(8, 9)),
    Card(
        "rtx3060",
        "NVIDIA GeForce RTX 3060 12 GB",
        12 * 1024 * MiB,
        "nominal 12 GiB of GDDR6 (no reading at hand: check nvidia-smi on the card)",
        aliases=("3060",),
        compute_capability=(8, 6),
    ),
    Card(
        "rtx3090",
        "NVIDIA GeForce RTX 3090 24 GB",
        24576 * MiB,
        "nvidia-smi in noonghunna/club-3090#1128",
        aliases=("3090",),
        compute_capability=(8, 6),
    ),
    Card(
        "rtx4090",
        "NVIDIA GeForce RTX 4090 24 GB",
        24564 * MiB,
        "nvidia-smi in RLinf/RLinf#255",
        aliases=("4090",),
        compute_capability=(8, 9),
    ),
    Card(
        "rtx5090",
        "NVIDIA GeForce RTX 5090 32 GB",
        32607 * MiB,
        "nvidia-smi in noonghunna/club-3090#1261",
        aliases=("5090",),
        compute_capability=(12, 0),
    ),
    Card(
        "a100-40gb",
        "NVIDIA A100 40 GB",
        40960 * MiB,
        _MODAL,
        aliases=("a100-40",),
        compute_capability=(8, 0),
    ),
    Card(
        "a100-80gb",
        "NVIDIA A100 80 GB",
        81920 * MiB,
        _MODAL,
        aliases=("a100-80", "a100"),
        compute_capability=(8, 0),
    ),
    Card(
        "h100",
        "NVIDIA H100 80 GB HBM3",
        81559 * MiB,
        "measured by bigbatch (tests/memory/data/gpu_truth)",
        context_measured=True,
        aliases=("h100-80gb",),
        compute_capability=(9, 0),
    ),
    Card(
        "h200",
        "NVIDIA H200 141 GB",
        143771 * MiB,
        "measured by bigbatch (benchmarks/results/h200-*)",
        context_measured=True,
        compute_capability=(9, 0),
    ),
)


def _normal(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-").removeprefix("nvidia-")


def find_card(text: str) -> Card | None:
    """The card ``text`` names (its key or an alias, case and spaces aside: ``T4``, ``Kaggle
    T4``, ``rtx-4090``, ``a100-80gb``), else None."""
    wanted = _normal(str(text))
    for card in CARDS:
        if wanted in (card.key, *card.aliases):
            return card
    return None
