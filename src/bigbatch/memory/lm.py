"""Language models from their ``config.json``: the fine-tune a user describes (full, LoRA,
QLoRA; checkpointing, attention, packing; one card, DDP or FSDP2) as the planner's
:class:`~bigbatch.memory.step.StepSpec`, and the plan per rank.

The model is built by transformers itself (``AutoModelForCausalLM.from_config``) on the meta
device, its adapters by peft (``get_peft_model``), its 4-bit or 8-bit base by
:mod:`bigbatch.memory.bnb`'s stand-ins for bitsandbytes' layers, and its step (the causal-LM
loss over ``labels``, padded ``[B, L]`` or packed ``[1, B*L]`` with ``position_ids``) is
traced on fake tensors like any other: no weights are read, no memory is allocated.

Across processes: FSDP2 is traced as one rank, the model under ``fully_shard`` on a fake
process group of N ranks (:mod:`bigbatch.memory.fsdp`), so the trace holds the rank's shards
and its all-gather and reduce-scatter buffers while they live. DDP's memory (and FSDP2's,
where this process already has a process group, under torchrun) is composed from one
process's trace (:func:`per_rank_bytes`): DDP adds its gradient buckets; FSDP2 keeps ``1/N``
of the weights, gradients and optimizer state and adds its gather buffers.

The fine-tune as described and checked is :mod:`bigbatch.memory.lm_setup`'s, its model and
step :mod:`bigbatch.memory.lm_model`'s; this module plans, and imports both.

>>> setup = LMSetup(seq_len=512, lora_r=8)
>>> setup.describe()
'LoRA r=8 (all-linear), 512 tokens, padded'
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bigbatch.device import AMPERE, compute_capability, device_kind
from bigbatch.io import atomic_write_text
from bigbatch.memory.budget import format_bytes
from bigbatch.memory.cards import Card, find_card
from bigbatch.memory.evaluate import (
    STATE_COPIES,
    EvaluationPlan,
    plan_evaluation_batch,
    predict_evaluation_peak,
)
from bigbatch.memory.fsdp import (
    fake_ranks,
    trainer_sharding,
)
from bigbatch.memory.lm_model import (
    ModelSizes,
    _sizes_and_paged_state,
    lm_factory,
    lm_spec_at,
    lora_config,
    model_sizes,
    per_rank_bytes,
)
from bigbatch.memory.lm_setup import (
    ATTENTIONS,
    LOSSES,
    QLORA_PREPS,
    QUANT_STORAGES,
    LMSetup,
    _config_dtype,
    _model_name,
    _named,
    _remote,
    _text_config,
    check_setup,
    dtype_flag,
    load_lm_config,
    quant_compute_dtype,
    quant_storage_dtype,
    quant_storage_for,
    weights_dtype,
    with_chosen_attention,
)
from bigbatch.memory.plan import (
    DEFAULT_MARGIN,
    DoesNotFitError,
    Plan,
    default_overhead,
    plan_micro_batch,
    resolve_budget,
    usable_bytes,
)
from bigbatch.memory.predict import MemoryPrediction, predict_peak
from bigbatch.memory.step import StepSpec

__all__ = [
    "ATTENTIONS",
    "LOSSES",
    "QLORA_PREPS",
    "QUANT_STORAGES",
    "LMPlan",
    "LMSetup",
    "ModelSizes",
    "dtype_flag",
    "lm_factory",
    "lm_spec_at",
    "load_lm_config",
    "lora_config",
    "model_sizes",
    "per_rank_bytes",
    "plan_lm",
    "quant_compute_dtype",
    "quant_storage_dtype",
    "quant_storage_for",
    "with_chosen_attention",
]
# torchrun's variables, which the process tracing an FSDP2 rank apart must not see (_run_apart).
_TORCHRUN = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
_TORCHRUN |= {"GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME"}
_APART_S = 1800  # a plan apart that takes half an hour is stuck: composed instead


@dataclass
class LMPlan:
    """A language-model plan: the micro-batch and accumulation per rank for a global batch of
    sequences, and the per-rank peak with its parts (:func:`plan_lm`).

    >>> import transformers
    >>> cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    ...                                num_attention_heads=4, vocab_size=100)
    >>> p = plan_lm(cfg, LMSetup(seq_len=32, lora_r=4), 8, "64MB", device="cpu", precision="fp32",
    ...             overhead=0)
    >>> (p.micro_batch, p.accumulation), p.sizes.trainable_count, p.peak_bytes <= p.usable_bytes
    ((8, 1), 8704, True)
    >>> list(p.parts())[:4]
    ['weights', 'adapters', 'gradients', 'optimizer_state']
    """

    setup: LMSetup
    model_type: str
    global_batch: int  # sequences per optimizer step, all ranks together
    plan: Plan  # one rank's plan (its target: global_batch / world_size)
    sizes: ModelSizes
    fsdp_traced: bool = False  # one FSDP2 rank traced (else one process, the ranks composed)
    per_rank_extra_bytes: int = 0
    paged_bytes: int = 0
    vocab: int = 0
    notes: list[str] = field(default_factory=list)
    source: str = ""  # the config's name or path, as load_lm_config was given it
    # Trainer's evaluation batch a rank (per_device_eval_batch_size); None: not planned
    evaluation: EvaluationPlan | None = None
    # The weights' dtype as planned ("bfloat16"; --dtype auto resolved from the config), what
    # the model is loaded in; "" in plans saved before it was recorded.
    weights_dtype: str = ""

    @property
    def micro_batch(self) -> int:
        return self.plan.micro_batch

    @property
    def accumulation(self) -> int:
        return self.plan.micro_batches

    @property
    def peak_bytes(self) -> int:
        """One rank's predicted peak (on CUDA: reserved memory and handles)."""
        return self.plan.predicted_peak_bytes + self.per_rank_extra_bytes

    @property
    def usable_bytes(self) -> int:
        """What one rank's peak may reach: the budget less margin and overhead (the one-process
        plan's usable memory is this less what a rank holds beyond its trace)."""
        return self.plan.usable_bytes + self.per_rank_extra_bytes

    def parts(self) -> dict[str, int]:
        """The peak's parts: the base and adapter weights, gradients, optimizer state,
        activations, temporaries (of which ``logits``: the micro-batch's logits and the
        float32 copy the loss makes; none through TRL's fused LM head, which never makes them
        whole), the allocator's cache; per rank."""
        p = self.plan.prediction
        parts = p.parts()
        weights = parts.pop("parameters")
        ranks = self.setup.world_size if self.fsdp_traced else 1  # a rank holds its shard
        adapters = min(weights, self.sizes.trainable // ranks) if self.setup.lora_r else 0
        tokens = self.micro_batch * self.setup.seq_len
        logits = tokens * self.vocab * (2 + 4 if p.precision != "fp32" else 4)
        if self.setup.loss == "trl" and not self.setup.label_smoothing:
            logits = 0
        return {
            "weights": weights - adapters,
            "adapters": adapters,
            **parts,
            "logits": logits,
            "per_rank": self.per_rank_extra_bytes,
        }

    def logits_a_fused_head_frees(self) -> int:
        """The bytes of logits this plan of the model's own loss holds (unsmoothed) that TRL's
        ``SFTTrainer``, through its fused LM head, never makes, where they are a tenth of the
        peak or more, else 0: what a plan with ``--loss trl`` would give the micro-batch. Such
        a plan holds for ``SFTTrainer`` too, with that much unused."""
        if self.setup.loss != "model" or self.setup.label_smoothing:
            return 0
        logits = self.parts()["logits"]
        return logits if logits >= 0.1 * self.peak_bytes else 0

    def save(self, path: str | Path) -> Path:
        """Write the plan to ``path`` as JSON (whole or not at all, readable by all), for
        :meth:`load` where the model trains: plan once, on any machine, and let the training
        job start without tracing the step again (half a minute for an 8B model on 2 CPU cores).
        ``bigbatch plan --hf ... --save PATH`` writes the same file.

        >>> import tempfile, transformers
        >>> cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
        ...     num_hidden_layers=2, num_attention_heads=4, vocab_size=100)
        >>> plan = plan_lm(cfg, LMSetup(seq_len=32, lora_r=4), 8, "64MB", device="cpu",
        ...                precision="fp32", overhead=0)
        >>> path = plan.save(Path(tempfile.mkdtemp()) / "plan.json")
        >>> LMPlan.load(path) == plan
        True
        """
        path = Path(path)
        # The CPU's workspace calibration describes this machine, not the card: left out.
        body = asdict(replace(self, plan=replace(self.plan, calibration=None)))
        head = {"format": PLAN_FORMAT, "version": PLAN_FORMAT_VERSION, "bigbatch": _version()}
        atomic_write_text(path, json.dumps(head | body, indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> LMPlan:
        """The plan :meth:`save` wrote to ``path``. A file that is not one, or one a newer
        bigbatch wrote, is refused in one line with the fix; nothing in it is executed (JSON).

        >>> LMPlan.load("missing.json")
        Traceback (most recent call last):
        ...
        FileNotFoundError: missing.json: no plan there; write one with `bigbatch plan --hf NAME_OR_PATH ... --save missing.json` (or LMPlan.save)
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"{path}: no plan there; write one with `bigbatch plan --hf NAME_OR_PATH ... "
                f"--save {path}` (or LMPlan.save)"
            )
        try:
            data = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError):
            data = None
        if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
            raise ValueError(
                f"{path} is not a bigbatch language-model plan (`bigbatch plan --hf ... --save` "
                "and LMPlan.save write them)"
            )
        # The header off: what is left is the plan's own fields.
        del data["format"]
        version, written_by = data.pop("version", None), data.pop("bigbatch", "?")
        if not isinstance(version, int) or version > PLAN_FORMAT_VERSION:
            raise ValueError(
                f"{path} was written by bigbatch {written_by} in plan format {version}, newer "
                f"than this bigbatch {_version()} reads ({PLAN_FORMAT_VERSION}): upgrade bigbatch "
                "(pip install -U bigbatch), or plan again with this one"
            )
        try:
            p = data["plan"]
            p["prediction"] = _dataclass_from(MemoryPrediction, p["prediction"])
            p["curve"] = [(int(b), int(peak)) for b, peak in p["curve"]]
            p["samples_per_s"] = {int(b): float(v) for b, v in p["samples_per_s"].items()}
            data["plan"] = _dataclass_from(Plan, p)
            data["setup"] = _dataclass_from(LMSetup, data["setup"])
            data["sizes"] = _dataclass_from(ModelSizes, data["sizes"])
            if data.get("evaluation") is not None:
                evaluation = data["evaluation"] | {"shape": tuple(data["evaluation"]["shape"])}
                data["evaluation"] = _dataclass_from(EvaluationPlan, evaluation)
            return _dataclass_from(cls, data)
        except _UnknownFields as exc:  # a newer bigbatch's plan: fields added, same format
            raise ValueError(
                f"{path} was written by bigbatch {written_by}, with {exc} that this bigbatch "
                f"{_version()} does not know: upgrade bigbatch (pip install -U bigbatch), or plan "
                "again with this one"
            ) from None
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(
                f"{path} is an incomplete or damaged plan ({type(exc).__name__}: {exc}): write "
                "it again with `bigbatch plan --hf ... --save`"
            ) from None

    def to_dict(self) -> dict[str, Any]:
        s = self.setup
        return {
            "model_type": self.model_type,
            "setup": s.describe(),
            "dtype": s.dtype,  # the weights' (auto: the config's)
            "seq_len": s.seq_len,
            "world_size": s.world_size,
            "fsdp": s.fsdp,
            "global_batch": self.global_batch,
            "micro_batch": self.micro_batch,
            "accumulation": self.accumulation,
            "tokens_per_step": self.global_batch * s.seq_len,
            "peak_bytes_per_rank": self.peak_bytes,
            "budget_bytes": self.plan.budget_bytes,
            "usable_bytes": self.usable_bytes,
            "parameters": self.sizes.parameter_count,
            "trainable_parameters": self.sizes.trainable_count,
            "parts": self.parts(),
            "paged_optimizer_bytes": self.paged_bytes,
            "eval_batch": self.eval_batch,
            "eval_peak_bytes_per_rank": self.eval_peak_bytes,
            "notes": [*self.notes, *self.plan.prediction.notes],
        }

    @property
    def eval_batch(self) -> int | None:
        """Trainer's evaluation batch a rank (``per_device_eval_batch_size``); None: not
        planned."""
        return self.evaluation.batch if self.evaluation else None

    @property
    def eval_peak_bytes(self) -> int | None:
        """One rank's predicted peak while evaluating at :attr:`evaluation`'s batch."""
        if self.evaluation is None:
            return None
        return self.evaluation.predicted_peak_bytes + self.per_rank_extra_bytes

    def summary(self) -> str:
        s = self.setup
        ranks = f" on each of {s.world_size} ranks" if s.world_size > 1 else ""
        parts = ", ".join(
            f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in self.parts().items() if v > 0
        )
        last = self.plan.last_micro_batch
        text = (
            f"{self.global_batch} sequences of {s.seq_len} tokens a step = micro-batch "
            f"{self.micro_batch} x {self.accumulation} accumulation"
            + (f" (the last {last})" if last != self.micro_batch else "")
            + f"{ranks}; predicted peak "
            f"{format_bytes(self.peak_bytes)} of {format_bytes(self.usable_bytes)} usable "
            f"(budget {format_bytes(self.plan.budget_bytes)}); {parts}"
        )
        if self.paged_bytes:
            text += f"; paged optimizer state {format_bytes(self.paged_bytes)} outside the budget"
        if self.evaluation is not None and self.eval_peak_bytes is not None:
            n = self.evaluation.batch
            text += (
                f"; evaluation {n} sequence{'s' if n > 1 else ''} a forward pass{ranks} (no "
                f"gradients), predicted peak {format_bytes(self.eval_peak_bytes)}"
            )
            if not self.evaluation.fits:
                text += " (over the budget even at 1: evaluate on a bigger card)"
        return text + "".join(f"; note: {n}" for n in self.notes)


PLAN_FORMAT = "bigbatch language-model plan"
PLAN_FORMAT_VERSION = 1  # raised when a field changes meaning; new fields with defaults keep it


def _version() -> str:
    from bigbatch import __version__

    return __version__


class _UnknownFields(ValueError):
    """A saved plan's fields that this bigbatch's classes lack (a newer one wrote them)."""


def _dataclass_from(cls: Any, data: dict[str, Any]) -> Any:
    """``cls(**data)``, refusing fields ``cls`` does not have (a newer plan's) by name.

    >>> _dataclass_from(LMSetup, {"seq_len": 512, "lora_r": 8}).describe()
    'LoRA r=8 (all-linear), 512 tokens, padded'
    """
    unknown = set(data) - {f.name for f in fields(cls)}
    if unknown:
        raise _UnknownFields(f"{cls.__name__}'s field(s) {', '.join(sorted(unknown))}")
    return cls(**data)


# Over 80 lines: a plan's steps in the order they run, read top to bottom (the setup, the
# floor, the plan, evaluation), each a call of its own.
def plan_lm(
    config: Any,
    setup: LMSetup,
    global_batch: int,
    budget: str | int,
    *,
    device: str = "cuda",
    precision: str = "bf16",
    optimizer: str = "adamw",
    margin: float = DEFAULT_MARGIN,
    overhead: int | None = None,
    evaluation: bool = True,
    apart: bool = True,
) -> LMPlan:
    """Plan a fine-tune of ``config``'s model: the largest micro-batch (sequences per rank)
    under ``budget`` and the accumulation that makes ``global_batch`` sequences a step over
    ``setup.world_size`` ranks, never changing that batch; with ``evaluation``, Trainer's
    evaluation batch too (:attr:`LMPlan.evaluation`).

    An FSDP2 rank is traced on a fake process group. Where this process has a process group
    already (under torchrun, once ``TrainingArguments`` is made), that happens in a process of
    its own (:mod:`bigbatch.memory.lm_apart`, a few seconds more); with ``apart=False``, or
    where that cannot run, the ranks are composed onto this process's trace instead (quicker,
    but no bound: over a traced rank on CPU ranks, up to 15 % under one on CUDA).

    >>> import transformers
    >>> cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    ...                                num_attention_heads=4, vocab_size=100)
    >>> p = plan_lm(cfg, LMSetup(seq_len=32, lora_r=4), 8, "64MB", device="cpu", precision="fp32",
    ...             overhead=0)
    >>> p.micro_batch * p.accumulation
    8
    """
    check_setup(config, setup, global_batch, precision)
    _check_flash_attention(config, setup, budget, device, precision)
    kwargs: dict[str, Any] = {"device": device, "precision": precision, "optimizer": optimizer}
    # FSDP2 is traced as one rank on a fake process group, where this process has none of its
    # own (under torchrun it has: traced apart, else composed, as DDP always is).
    n, fsdp = setup.world_size, setup.sharded
    per_rank, traced, not_apart = global_batch // n, fsdp and not dist.is_initialized(), ""
    budget_bytes = resolve_budget(budget, device)
    if fsdp and not traced and apart:
        # A card's name goes as it is (the plan's notes name the card); any other budget in
        # bytes, as this process resolved it ("auto": its card's free memory), and so does
        # the overhead (its CUDA context, or on a CPU its size).
        sent = budget if isinstance(budget, str) and find_card(budget) else budget_bytes
        held = default_overhead(budget, device) if overhead is None else overhead
        options = {**kwargs, "margin": margin, "overhead": held, "evaluation": evaluation}
        got = _plan_apart(config, setup, global_batch, sent, options)
        if isinstance(got, LMPlan):
            return got
        not_apart = f"; not traced apart: {got}"
    setup = _named(config, setup, precision)
    notes = _setup_notes(config, setup, budget, precision)
    spec_at = lm_spec_at(config, setup, sharded=traced, **kwargs)
    with _refused_in_one_line(config, setup):
        sizes, paged = _sizes_and_paged_state(lm_spec_at(config, setup, **kwargs)(1), setup)
    overhead = default_overhead(budget, device) if overhead is None else overhead
    usable = usable_bytes(budget_bytes, overhead, device, margin)
    with fake_ranks(n) if traced else contextlib.nullcontext():
        # Composed: from the floor's weights, gradients and state, the same at every micro-batch.
        with _refused_in_one_line(config, setup):
            floor = predict_peak(spec_at(1).in_window(per_rank))
        extra, note = _beyond_the_trace(
            traced, sizes, floor.parts(), setup, precision, optimizer, evaluation_planned=evaluation
        )
        try:
            plan = plan_micro_batch(
                spec_at,
                per_rank,
                budget_bytes,
                device=device,
                margin=margin,
                overhead=overhead,
                extra_bytes=extra,
                known={1: floor},
            )
        except DoesNotFitError as exc:
            why = _does_not_fit(
                config, setup, floor, extra, (usable, budget_bytes, margin, overhead)
            )
            raise DoesNotFitError(why, exc.floor) from None
        beyond = _composed_evaluation(sizes, setup, precision, optimizer, extra, traced)
        evaluated = _plan_evaluation(spec_at, plan, per_rank, beyond) if evaluation else None
    return LMPlan(
        setup=setup,
        model_type=config.model_type,
        global_batch=global_batch,
        plan=plan,
        sizes=sizes,
        fsdp_traced=traced,
        per_rank_extra_bytes=extra,
        paged_bytes=paged,
        vocab=int(_text_config(config).vocab_size),
        notes=_plan_notes(note + not_apart, setup, device) + notes,
        source=str(getattr(config, "_name_or_path", "") or ""),
        evaluation=evaluated,
        weights_dtype=str(weights_dtype(config, setup)).removeprefix("torch."),
    )


def _plan_apart(
    config: Any, setup: LMSetup, global_batch: int, budget: str | int, options: dict[str, Any]
) -> LMPlan | str:
    """``plan_lm(config, setup, global_batch, budget, **options)`` in a process of its own, with
    no process group (:mod:`bigbatch.memory.lm_apart`); or, where it cannot run there, why (a
    line for the composed plan's notes). A plan that does not fit raises as here. What only
    this process can measure (an ``"auto"`` budget, the overhead) comes resolved in
    ``budget`` and ``options``; a model built by its own code (trusted here) is built there by
    the same code, copied beside its config."""
    request = {**options, "setup": asdict(setup), "global_batch": global_batch, "budget": budget}
    request["trust_remote_code"] = _remote(config)
    with tempfile.TemporaryDirectory(prefix="bigbatch-plan-") as folder:
        where = Path(folder)
        config.save_pretrained(where / "config")
        if _remote(config):
            try:
                _own_code_beside(config, where / "config")
            except (OSError, ImportError, ValueError) as exc:
                return f"its own code could not be copied for it ({type(exc).__name__}: {exc})"
        (where / "request.json").write_text(json.dumps(request))
        done = _run_apart(folder)
        if (where / "does_not_fit.json").is_file():
            said = json.loads((where / "does_not_fit.json").read_text())
            raise DoesNotFitError(said["message"], _dataclass_from(MemoryPrediction, said["floor"]))
        if not (where / "plan.json").is_file():
            return done or "it wrote no plan"
        plan = LMPlan.load(where / "plan.json")
    notes = list(plan.notes)
    notes[0] += " (in a process of its own: this one has a process group already)"
    return replace(plan, source=str(getattr(config, "_name_or_path", "") or ""), notes=notes)


def _own_code_beside(config: Any, folder: Path) -> None:
    """Copies the code that builds a trusted model (the files of what its ``auto_map`` names
    for its config and its causal-LM head, with what they import) into ``folder``, beside its
    saved ``config.json``, where transformers looks for it when loading from that folder."""
    import shutil

    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    named = config.auto_map
    for key in ("AutoConfig", "AutoModelForCausalLM"):
        refs = named.get(key)
        for ref in refs if isinstance(refs, list | tuple) else [refs]:
            if not ref:
                continue
            built_by = get_class_from_dynamic_module(ref, config._name_or_path)
            code = Path(str(sys.modules[built_by.__module__].__file__)).parent
            for source in code.glob("*.py"):
                if source.name != "__init__.py":
                    shutil.copyfile(source, folder / source.name)


def _run_apart(folder: str) -> str:
    """Runs ``python -m bigbatch.memory.lm_apart folder`` as no rank of torchrun's job, on no
    GPU, with this bigbatch; what went wrong, in a line, or nothing."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in _TORCHRUN and not key.startswith("TORCHELASTIC_")
    }
    env["CUDA_VISIBLE_DEVICES"] = ""  # never a context on a card the job trains on
    here = str(Path(__file__).resolve().parents[2])  # wherever the script found bigbatch
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    argv = [sys.executable, "-m", "bigbatch.memory.lm_apart", folder]
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=_APART_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"the process did not finish ({type(exc).__name__}: {exc})"
    lines = done.stderr.strip().splitlines()
    return (
        f"the process failed ({lines[-1] if lines else done.returncode})" if done.returncode else ""
    )


def _plan_evaluation(
    spec_at: Callable[[int], StepSpec],
    plan: Plan,
    largest: int,
    beyond: Callable[[MemoryPrediction], int] | None = None,
) -> Any:
    """Trainer's evaluation batch a rank, up to ``largest``: forward passes without gradients
    at the plan's sequence length (the logits and their float32 copy for the loss: at long
    sequences and large vocabularies more than training's micro-batch holds), beside what
    training keeps meanwhile: the weights and the optimizer state (the gradients are freed at
    each optimizer step) and, on CUDA, the cuBLAS workspace and handle of autograd's thread,
    under the training plan's usable memory. An FSDP2 rank is traced as its training is, on
    the fake process group: its shards, each layer's gathered weights until FSDP2 frees them;
    ``beyond(prediction)``: what a rank composed onto one process's trace holds beyond it,
    less what training's rank does (the plan's usable memory has that taken off already)."""
    trained = plan.prediction

    def peak_at(b: int) -> int:
        p = predict_evaluation_peak(spec_at(b), state_copies=0, held_bytes=trained.optimizer_state)
        kept = max(0, trained.library_workspace_bytes - p.library_workspace_bytes)
        kept += max(0, trained.cuda_handle_bytes - p.cuda_handle_bytes)
        return p.planning_bytes + kept + (beyond(p) if beyond else 0)

    return plan_evaluation_batch(peak_at, largest, plan.usable_bytes, (spec_at(1).input_shape[0],))


def _check_flash_attention(
    config: Any, setup: LMSetup, budget: str | int, device: str, precision: str
) -> None:
    """Refuse flash_attention_2 where flash-attn cannot run: off CUDA, on a card older than
    Ampere, or on float32 inputs (float32 weights without autocast; transformers' wrapper
    casts a quantized base's float32 inputs to its config's dtype, these weights')."""
    if setup.attn != "flash_attention_2":
        return
    if not device_kind(device).flash_attention:
        raise ValueError(
            f"flash_attention_2 runs on CUDA GPUs alone (flash-attn's kernels), and this plan is "
            f"for {device}: plan with --attn sdpa, or for the GPU with --device cuda"
        )
    # The card the budget names, else under "auto" this process's GPU.
    card = _card_for(budget)
    capability: tuple[int, int] | None
    if card is not None:
        capability, name = card.compute_capability, f"the {card.short_name}"
    else:
        capability = compute_capability(torch.device(device)) if budget == "auto" else None
        name = "this GPU"
    if capability is not None and capability < AMPERE:
        raise ValueError(
            f"flash_attention_2 runs on Ampere or newer (compute capability {AMPERE[0]}.{AMPERE[1]}"
            f"), and {name} is {capability[0]}.{capability[1]}: plan with --attn sdpa"
        )
    if precision == "fp32" and weights_dtype(config, setup) == torch.float32:
        raise ValueError(
            "flash_attention_2 computes in float16 or bfloat16 alone, and this plan has float32 "
            "weights without autocast: plan with --precision bf16 (Trainer's bf16=True), or "
            "--dtype bf16, or --attn sdpa"
        )


def _card_for(budget: str | int) -> Card | None:
    """The card ``budget`` names, if any."""
    return find_card(budget) if isinstance(budget, str) else None


@contextlib.contextmanager
def _refused_in_one_line(config: Any, setup: LMSetup) -> Iterator[None]:
    """What transformers or torch refuse while the model is built and its step traced, which
    the same model would refuse on the card, as one line with the fix."""
    name = _model_name(config)
    # Fake tensors log the traceback of a kernel that refused its arguments at ERROR before
    # raising: what is refused here is said below in one line (anything else still raises).
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)
    try:
        yield
    except AssertionError as exc:  # torch's own checks of a layer's arguments
        raise ValueError(
            f"transformers cannot build {name} from this config ({exc}): check its values"
        ) from None
    except ValueError as exc:
        if "scaled_dot_product_attention" not in str(exc):
            raise
        raise ValueError(
            f"{name} has no SDPA attention in this transformers: plan it with --attn eager"
        ) from None
    except AttributeError as exc:
        wrapped = _lora_over_a_tuple(exc) if setup.lora_r else None  # peft's: with LoRA only
        if wrapped is None:
            raise
        culprit, kind, others = wrapped
        raise ValueError(
            f"peft's LoRA cannot wrap {name}'s {culprit!r} modules ({kind}, an nn.Linear whose "
            f"forward returns a tuple), which --lora-targets {setup.lora_targets} includes: the "
            f"step fails in peft ({exc}) as training would; name the targets without them, e.g. "
            f"--lora-targets {','.join(others)} (LMSetup(lora_targets=...) in Python)"
        ) from None
    except RuntimeError as exc:
        # transformers 5 runs a mixture of experts' weights through torch's grouped_mm, which
        # takes 16-bit weights only.
        if "to be BFloat16 or supported Float16" not in str(exc):
            raise
        if setup.quant:
            raise ValueError(
                f"--qlora quantizes linear layers only: {name}'s experts are none, and are left "
                "in float32 as peft's prepare_model_for_kbit_training leaves what is not "
                "quantized, which torch's grouped_mm that runs them refuses: plan LoRA without "
                "--qlora"
            ) from None
        raise ValueError(
            f"{name}'s experts run through torch's grouped_mm, which takes bfloat16 or float16 "
            "weights, and these are float32 (--dtype, or the config's): plan with --dtype bf16, "
            "as the model trains"
        ) from None
    finally:
        fake_log.setLevel(level)


def _lora_over_a_tuple(exc: BaseException) -> tuple[str, str, list[str]] | None:
    """The module peft's LoRA wrapped whose forward returned a tuple (Llama 4's router, an
    nn.Linear), found in the failed step's frames, and the other wrapped modules' names; None
    where ``exc`` came from anything else."""
    from peft.tuners.lora import LoraLayer

    frames = [frame for frame, _ in traceback.walk_tb(exc.__traceback__)]
    for frame in frames:
        layer = frame.f_locals.get("self")
        if isinstance(layer, LoraLayer) and isinstance(frame.f_locals.get("result"), tuple):
            break
    else:
        return None
    # The outermost module of the step holds every wrapped layer, under its own name.
    model = next(
        f.f_locals["self"] for f in frames if isinstance(f.f_locals.get("self"), nn.Module)
    )
    wrapped = [(n.rsplit(".", 1)[-1], m) for n, m in model.named_modules()]
    culprit = next((n for n, m in wrapped if m is layer), None)
    if culprit is None:  # a step run outside the model (a wrapper's): not said here
        return None
    kind = type(layer.get_base_layer()).__name__
    others = {n for n, m in wrapped if isinstance(m, LoraLayer) and n != culprit}
    return culprit, kind, sorted(others)


def _plan_notes(note: str, setup: LMSetup, device: str) -> list[str]:
    """The plan's notes: how the ranks were planned, and what the prediction leaves out."""
    flash = setup.attn == "flash_attention_2"
    nccl = setup.world_size > 1 and device_kind(device).distributed_backend == "nccl"
    return [m for m in (note, _FLASH_NOTE if flash else "", _NCCL_NOTE if nccl else "") if m]


def _setup_notes(config: Any, setup: LMSetup, budget: str | int, precision: str) -> list[str]:
    """What the plan says of the card and the weights' dtype."""
    card = _card_for(budget)
    return _bf16_notes(card, config, setup, precision) + _dtype_notes(config, setup)


def _bf16_notes(card: Card | None, config: Any, setup: LMSetup, precision: str) -> list[str]:
    """Where the card only emulates bfloat16 and the plan computes in it (autocast, the weights,
    or a quantized base's compute dtype, which follows the weights): how to train in fp16."""
    if card is None or not card.emulates_bf16:
        return []
    if precision != "bf16" and weights_dtype(config, setup) != torch.bfloat16:
        return []
    # GradScaler cannot unscale float16 gradients: a full fine-tune keeps float32 weights.
    weights = "--dtype fp16 for the frozen base" if setup.lora_r else "--dtype fp32 weights"
    return [
        card.bf16_note(f"plan and train in fp16: --precision fp16 (Trainer's fp16=True), {weights}")
    ]


def _dtype_notes(config: Any, setup: LMSetup) -> list[str]:
    """Where the config names no dtype and the plan takes the config's: the weights were
    planned in float32, twice a 16-bit checkpoint's bytes (transformers' default configs, and
    a config written by hand, often name none)."""
    if setup.dtype != "auto" or _config_dtype(config) is not None:
        return []
    return [
        "the config names no dtype: the weights are planned in float32 (as from_pretrained "
        "loads them without one); plan a 16-bit checkpoint with --dtype bf16 or --dtype fp16"
    ]


_FLASH_NOTE = (
    "flash_attention_2 traced as transformers' wrapper (its copies of padded inputs) around "
    "SDPA's flash kernel (flash-attn's memory)"
)
# NCCL's communicators take device memory of their own, outside PyTorch's allocator: by the
# node's topology, hundreds of MiB a rank and more (NVIDIA/nccl#864, #964), which no trace on
# a CPU can see.
_NCCL_NOTE = (
    "NCCL's own buffers (outside PyTorch's allocator; hundreds of MiB a rank or more, by the "
    "node's topology) are not in the prediction: add them to --overhead"
)


def _does_not_fit(
    config: Any, setup: LMSetup, floor: Any, extra: int, limits: tuple[int, int, float, int]
) -> str:
    usable, budget_bytes, margin, overhead = limits
    return (
        f"{config.model_type} ({setup.describe()}) does not fit even at micro-batch 1: "
        f"predicted {format_bytes(floor.planning_bytes + extra)} a rank of "
        f"{format_bytes(usable)} usable (budget {format_bytes(budget_bytes)} less "
        f"{margin:.0%} margin and {format_bytes(overhead)} overhead; {floor.breakdown()}). Try "
        + _what_to_try(setup, weights_dtype(config, setup))
    )


def _beyond_the_trace(
    traced: bool,
    sizes: ModelSizes,
    parts: dict[str, int],
    setup: LMSetup,
    precision: str,
    optimizer: str,
    *,
    evaluation_trace: bool = False,
    evaluation_planned: bool = False,
) -> tuple[int, str]:
    """What a rank holds beyond the trace (with ``evaluation_trace``, an evaluation trace), and
    the note: nothing for a traced FSDP2 rank, else :func:`per_rank_bytes`'s composition, which
    names evaluation's composition only where evaluation is planned too."""
    if traced:
        return 0, _traced_note(setup, sizes, precision)
    extra, note = per_rank_bytes(
        sizes,
        parts,
        setup,
        mixed_precision=precision in ("bf16", "fp16"),
        state_copies=STATE_COPIES.get(optimizer, 2),
        evaluation=evaluation_trace,
    )
    if setup.sharded and evaluation_planned:
        note += "; evaluation's forward passes composed the same way, without gradients"
    return extra, note


def _composed_evaluation(
    sizes: ModelSizes,
    setup: LMSetup,
    precision: str,
    optimizer: str,
    training_extra: int,
    traced: bool,
) -> Callable[[MemoryPrediction], int] | None:
    """For composed FSDP2 ranks (not ``traced``): what a rank holds beyond an evaluation trace
    of one process (:func:`per_rank_bytes` without gradients), less ``training_extra``, which
    the plan's usable memory and :attr:`LMPlan.eval_peak_bytes` count already. None for one
    process, DDP's ranks (their buckets stay as in training) and a traced FSDP2 rank."""
    if traced or not setup.sharded:
        return None

    def beyond(prediction: MemoryPrediction) -> int:
        parts = prediction.parts()
        extra, _ = _beyond_the_trace(
            False, sizes, parts, setup, precision, optimizer, evaluation_trace=True
        )
        return extra - training_extra

    return beyond


def _traced_note(setup: LMSetup, sizes: ModelSizes, precision: str) -> str:
    how = (
        "prepared as accelerate prepares it for Trainer"
        if trainer_sharding()
        else "each decoder layer and the root under fully_shard (accelerate is not installed)"
    )
    whole = (
        f"; the quantized weights ({format_bytes(sizes.unsharded)}) whole on each rank, as "
        "accelerate leaves bitsandbytes' default uint8 storage out of the sharding"
        if sizes.unsharded
        else ""
    )
    masters = (
        f"; float32 masters of the weights that train, gathered in {precision} (accelerate's "
        "mixed precision)"
        if trainer_sharding()
        and precision in ("bf16", "fp16")
        and sizes.trainable_half
        and not setup.quant
        else ""
    )
    return (
        f"FSDP2 over {setup.world_size} ranks, traced as one rank on a fake process group, "
        f"{how}: its shards of the weights, gradients and optimizer state, each unit's "
        f"all-gather and reduce-scatter buffers while they live, on FSDP2's own CUDA streams"
        f"{whole}{masters}"
    )


def _what_to_try(setup: LMSetup, weights: torch.dtype) -> str:
    tries = []
    if not setup.gradient_checkpointing:
        tries.append("--gradient-checkpointing")
    if not setup.lora_r:
        tries.append("--lora 16")
    elif not setup.quant:
        if weights == torch.float32:  # a frozen base needs no float32 copy
            tries.append("--dtype bf16 or fp16 (the frozen base is float32 now)")
        tries.append("--qlora")
    tries.append(f"a shorter --seq-len than {setup.seq_len}")
    if not setup.fsdp:
        tries.append("--fsdp over more ranks")
    tries.append("a bigger card")
    return ", ".join(tries)


def plan_table(
    config: Any,
    setup: LMSetup,
    global_batch: int,
    budget: str | int,
    *,
    seq_lens: list[int],
    world_sizes: list[int],
    **kwargs: Any,
) -> list[LMPlan | str]:
    """One plan per sequence length and rank count (a ``str``, why, where none fits), for
    choosing one: their evaluation is left unplanned (plan the row chosen with
    :func:`plan_lm`)."""
    rows: list[LMPlan | str] = []
    setup = with_chosen_attention(config, setup)  # once, not a model build a row
    for length in seq_lens:
        for ranks in world_sizes:
            row = replace(setup, seq_len=length, world_size=ranks, fsdp=setup.fsdp and ranks > 1)
            if global_batch % ranks:
                rows.append(f"{length} tokens, {ranks} ranks: {global_batch} is no multiple")
                continue
            try:
                rows.append(plan_lm(config, row, global_batch, budget, evaluation=False, **kwargs))
            except DoesNotFitError as exc:
                rows.append(f"{length} tokens, {ranks} rank(s): {str(exc).split(' (budget')[0]}")
    return rows
