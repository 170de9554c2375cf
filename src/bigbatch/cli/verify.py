"""``bigbatch verify``: accumulated vs big-batch gradients, on built-in cases or your model."""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
import torch.nn.functional as F

from bigbatch.batching import even_sizes
from bigbatch.cli import UserError, fill_defaults, flags_typed
from bigbatch.user_code import call_factory, load_object
from bigbatch.verify import (
    CaseResult,
    LossFn,
    Method,
    run_builtin_cases,
    token_cross_entropy,
    verify,
)

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
LOSSES: dict[str, LossFn] = {
    "cross_entropy": F.cross_entropy,
    "mse": F.mse_loss,
    "token_cross_entropy": token_cross_entropy,
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", help="module:factory returning your nn.Module (default: built-in cases)"
    )
    p.add_argument(
        "--trainer",
        help="module:factory returning your built Hugging Face Trainer (or TRL's SFTTrainer): "
        "one window of its training set through its own training_step (the hf extra)",
    )
    p.add_argument("--data", help="module:factory returning (inputs, targets) for one whole window")
    p.add_argument(
        "--micro",
        help="micro-batch sizes splitting the window, e.g. 16,16,4 (default: 4 near-equal parts; "
        "with --trainer, one of its micro-batches' rows split into all but one, then one)",
    )
    p.add_argument(
        "--loss",
        help=f"{', '.join(LOSSES)} (default cross_entropy), or module:function(output, target) "
        "-> mean loss",
    )
    p.add_argument(
        "--tokens", action="store_true", help="count tokens (targets != -100), not samples"
    )
    p.add_argument(
        "--dtype", help="comma-separated: float64,float32,bfloat16 (default float64,float32)"
    )
    p.add_argument(
        "--naive", action="store_true", help="also run the naive loss / N for comparison"
    )
    p.add_argument(
        "--eval", action="store_true", help="put the model in eval mode (BatchNorm, dropout off)"
    )
    p.add_argument(
        "--seed",
        type=int,
        help="the random state both runs start from (dropout's masks, the built-in cases' "
        "data); default 0",
    )
    p.add_argument(
        "--distributed",
        type=int,
        metavar="N",
        help="run the distributed cases on N CPU processes (gloo on 127.0.0.1; N=2)",
    )
    p.add_argument(
        "--json", action="store_true", help="print a JSON list, one object per case/method/dtype"
    )


def _dtypes(text: str) -> list[torch.dtype]:
    out = []
    for name in filter(None, (t.strip() for t in text.split(","))):
        if name not in DTYPES:
            raise UserError(f"--dtype: unknown {name!r}; choose from {', '.join(DTYPES)}")
        out.append(DTYPES[name])
    if not out:
        raise UserError("--dtype: give at least one of " + ", ".join(DTYPES))
    return out


def _parsed_sizes(text: str) -> list[int]:
    try:
        sizes = [int(t) for t in text.split(",") if t.strip()]
    except ValueError as exc:
        raise UserError(
            f"--micro must be comma-separated integers, e.g. 16,16,4; got {text!r}"
        ) from exc
    if not sizes or any(s < 1 for s in sizes):
        raise UserError(f"--micro sizes must be >= 1, got {text!r}")
    return sizes


def _sizes(text: str, n: int) -> list[int]:
    if not text:
        return even_sizes(n, 4)
    sizes = _parsed_sizes(text)
    if sum(sizes) != n:
        raise UserError(f"--micro sizes add up to {sum(sizes)} but --data returned {n} samples")
    return sizes


def _user_results(
    args: argparse.Namespace, methods: list[Method], dtypes: list[torch.dtype]
) -> list[CaseResult]:
    if not args.data:
        raise UserError(
            "--model needs --data module:factory returning (inputs, targets) for one window"
        )
    model = call_factory(args.model, "--model")
    if not isinstance(model, torch.nn.Module):
        raise UserError(
            f"--model: {args.model}() returned {type(model).__name__}, not a torch.nn.Module"
        )
    data = call_factory(args.data, "--data")
    if not (
        isinstance(data, tuple | list) and len(data) == 2 and isinstance(data[1], torch.Tensor)
    ):
        raise UserError(
            f"--data: {args.data}() must return (inputs, targets) with targets a tensor"
        )
    inputs, targets = data
    loss_fn: LossFn = LOSSES.get(args.loss) or load_object(args.loss, "--loss")
    model.eval() if args.eval else model.train()
    try:
        return verify(
            model,
            inputs,
            targets,
            _sizes(args.micro, int(targets.shape[0])),
            loss_fn,
            case=args.model,
            methods=methods,
            dtypes=dtypes,
            count_by="tokens" if args.tokens else "samples",
            seed=args.seed,
        )
    except (ValueError, TypeError, RuntimeError) as exc:
        raise UserError(f"running your model failed: {type(exc).__name__}: {exc}") from exc


def _trainer_results(args: argparse.Namespace) -> list[CaseResult]:
    # Imported when the command runs: transformers is the hf extra's, and slow to import.
    try:
        from bigbatch.integrations.hf import verify_trainer
    except ImportError as exc:  # the line names the extra to install
        raise UserError(f"--trainer: {exc}") from exc

    trainer = call_factory(args.trainer, "--trainer")
    if not all(hasattr(trainer, name) for name in ("training_step", "get_train_dataloader")):
        raise UserError(
            f"--trainer: {args.trainer}() returned {type(trainer).__name__}, not a "
            "transformers Trainer: return the Trainer (or SFTTrainer) you would call .train() on"
        )
    sizes = _parsed_sizes(args.micro) if args.micro else None
    try:
        return [verify_trainer(trainer, sizes)]
    except ValueError as exc:  # verify_trainer's refusals: one line, with the fix
        raise UserError(str(exc)) from exc
    except (TypeError, RuntimeError) as exc:
        raise UserError(f"running your trainer failed: {type(exc).__name__}: {exc}") from exc


def _print_table(results: list[CaseResult]) -> None:
    # Columns as wide as their longest entry (a case's name, "float64/fsdp_every"), counts cut.
    counts = [",".join(str(c) for c in r.micro_batch_counts)[:24] for r in results]
    w_case = max([4, *(len(r.case) for r in results)])
    w_method = max([6, *(len(r.method) for r in results)])
    w_dtype = max([5, *(len(r.dtype) for r in results)])
    w_counts = max([6, *map(len, counts)])
    header = (
        f"{'case':<{w_case}} {'method':<{w_method}} {'dtype':<{w_dtype}} "
        f"{'counts':<{w_counts}} {'max_abs':>9} {'max_rel':>9} {'tol':>7}  verdict"
    )
    print(header)
    print("-" * len(header))
    for r, said in zip(results, counts, strict=True):
        verdict = "EXACT" if r.passed else "DIFFERS"
        print(
            f"{r.case:<{w_case}} {r.method:<{w_method}} {r.dtype:<{w_dtype}} {said:<{w_counts}} "
            f"{r.max_abs:9.1e} {r.max_rel:9.1e} {r.tolerance:7.1e}  {verdict}"
        )
    # One paragraph per distinct explanation, naming the rows it explains.
    explained: dict[str, list[str]] = {}
    for r in results:
        if r.explanation and f"{r.case}/{r.method}" not in explained.get(r.explanation, []):
            explained.setdefault(r.explanation, []).append(f"{r.case}/{r.method}")
    for text, rows in explained.items():
        print(f"\n{', '.join(rows)}: {text}")


# Options that only describe a user model: typed without --model they would be ignored.
_MODEL_ONLY = dict.fromkeys(("micro", "data", "eval", "tokens", "loss"))
# What a trainer brings itself (its data, loss, precision and seed): typed with --trainer, refused.
_NOT_TRAINER = dict.fromkeys(("data", "eval", "tokens", "loss", "dtype", "naive", "seed"))
# The options with defaults, filled in once the typed ones are checked (--distributed's cases
# have their own dtype and data, and compare bigbatch with the naive loss / N always).
_DEFAULTS = {"micro": "", "loss": "cross_entropy", "dtype": "float64,float32", "seed": 0}
_NOT_DISTRIBUTED = dict.fromkeys(("dtype", "seed", "naive"))


def run(args: argparse.Namespace) -> int:
    distributed = args.distributed is not None  # --distributed 0 is refused, not ignored
    if distributed and args.model:
        raise UserError(
            "--distributed runs bigbatch's own distributed cases, not --model: verify your "
            "model without --distributed, or the distributed cases without --model"
        )
    if args.trainer and (args.model or distributed):
        raise UserError(
            f"--trainer verifies your Trainer, {'--model' if args.model else '--distributed'} "
            "something else: run them as two commands"
        )
    if args.trainer and (given := flags_typed(args, _NOT_TRAINER)):
        raise UserError(
            f"{', '.join(given)}: --trainer brings its own data, loss, precision and seed (its "
            f"arguments'): drop {'them' if len(given) > 1 else 'it'} (--micro sets the window)"
        )
    if not (args.model or args.trainer) and (given := flags_typed(args, _MODEL_ONLY)):
        raise UserError(
            f"{', '.join(given)} describe(s) your model's window: add --model module:factory "
            "(the built-in cases have their own sizes)"
        )
    if distributed and (given := flags_typed(args, _NOT_DISTRIBUTED)):
        raise UserError(
            f"{', '.join(given)}: --distributed's cases run in float64 on their own data, "
            f"bigbatch beside the naive loss / N: drop {'them' if len(given) > 1 else 'it'}"
        )
    fill_defaults(args, _DEFAULTS)
    dtypes = _dtypes(args.dtype)
    if distributed:
        # Imported when the command runs: `bigbatch --help` must not load torch and the libraries.
        from bigbatch.verify.distributed import verify_distributed

        try:
            results = verify_distributed(args.distributed)
        except ValueError as exc:
            raise UserError(str(exc)) from exc
    elif args.trainer:
        results = _trainer_results(args)
    elif args.model:
        methods: list[Method] = ["bigbatch", "naive"] if args.naive else ["bigbatch"]
        results = _user_results(args, methods, dtypes)
    else:
        # Imported when the command runs: `bigbatch --help` must not load torch and the libraries.
        from bigbatch.verify.coupled import run_coupled_cases

        results = run_builtin_cases(methods=("bigbatch", "naive"), dtypes=dtypes, seed=args.seed)
        # Losses that couple the samples: plain accumulation against gradient caching.
        results += run_coupled_cases([d for d in dtypes if d != torch.bfloat16])
    if args.json:
        print(json.dumps([r.to_dict() for r in results], indent=1))
    else:
        _print_table(results)
    ours: list[Any] = [r for r in results if r.method in ("bigbatch", "cached", "trainer")]
    return 0 if all(r.passed for r in ours) else 1
