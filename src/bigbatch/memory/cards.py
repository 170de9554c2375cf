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

import difflib
import re
from dataclasses import dataclass

from bigbatch.device import AMPERE
from bigbatch.memory.cuda_runtime import CUDA_CONTEXT_BYTES

__all__ = ["CARDS", "Card", "card_hint", "find_card"]

MiB = 2**20
_MODAL = "nvidia-smi in modal-labs/modal-client#2797, a cloud's GPUs"
_PUBLIC = "nvidia-smi readings, the same in several public logs"


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
        16280 * MiB,
        _PUBLIC + " (Tesla P100-PCIE-16GB, as Kaggle and Colab lend it)",
        aliases=("kaggle-p100", "tesla-p100"),
        compute_capability=(6, 0),
    ),
    Card(
        "v100-16gb",
        "NVIDIA V100 16 GB",
        16160 * MiB,
        _PUBLIC + " (Tesla V100-SXM2-16GB and V100-PCIE-16GB)",
        aliases=("v100-16",),
        compute_capability=(7, 0),
    ),
    Card(
        "v100-32gb",
        "NVIDIA V100 32 GB",
        32510 * MiB,
        _PUBLIC + " (Tesla V100-SXM2-32GB and V100-PCIE-32GB)",
        aliases=("v100-32",),
        compute_capability=(7, 0),
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
        12288 * MiB,
        _PUBLIC + " (GeForce RTX 3060, the 12 GB one)",
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
    T4``, ``rtx-4090``, ``a100-80gb``), else None.

    >>> find_card("Kaggle P100").key, find_card("16GB")
    ('p100', None)
    """
    wanted = _normal(str(text))
    for card in CARDS:
        if wanted in (card.key, *card.aliases):
            return card
    return None


def card_hint(text: str) -> str:
    """The error for a budget that starts with a letter yet names no card: the cards whose
    names are closest (``v100``: which memory?) and where the list is. Empty for a card's
    name, ``auto``, and text that starts with a digit, which meant a size
    (:func:`bigbatch.memory.budget.parse_bytes` says what is wrong with it).

    >>> card_hint("v100")
    "'v100' is no card's name (nor a size: 8GB, 16GiB, auto): did you mean v100-16gb, v100-32gb? bigbatch plan --list-cards lists them all"
    """
    wanted = _normal(str(text))
    if not wanted or wanted[0].isdigit() or wanted == "auto" or find_card(wanted):
        return ""
    names = [n for card in CARDS for n in (card.key, *card.aliases)]
    close = [n for n in names if n.startswith(wanted)] or difflib.get_close_matches(wanted, names)
    keys = dict.fromkeys(c.key for c in CARDS for n in close if n in (c.key, *c.aliases))
    guess = f"did you mean {', '.join(keys)}? " if keys else ""
    return (
        f"{str(text).strip()!r} is no card's name (nor a size: 8GB, 16GiB, auto): {guess}"
        "bigbatch plan --list-cards lists them all"
    )
