"""FSDP2's memory per rank on CPU ranks: each rank's tensor peak (the profiler's, as
`measure_step_peak`) over two training steps of a Llama-shaped model from its config (random
weights, each decoder layer and the root under `fully_shard` as accelerate's and torchtitan's
transformer wrapping do, AdamW), run with gloo across processes and run in this process on a
fake process group (collectives that move no data), against `bigbatch plan --hf`'s one rank
traced on that fake group (`bigbatch.memory.fsdp`) and, the older way, one process's trace with
the ranks composed onto it (`bigbatch.memory.lm.per_rank_bytes`, what `plan_lm(...,
apart=False)` does under torchrun), and evaluation's forward pass without gradients traced and
composed the same.

    python benchmarks/fsdp_ranks.py [--ranks 2] [--lora R] [--qlora [--quant-storage uint8]]
        [--json]

Each rank is prepared as Trainer's accelerate prepares it (``shard_as_trainer``); with
``--qlora`` the base's 4-bit weights (the planner's stand-ins, pure torch) are packed in
bfloat16, which FSDP2 shards as any weight, or with ``--quant-storage uint8`` (bitsandbytes'
default) stay whole on each rank, as accelerate leaves them.

gloo's all-gather and reduce-scatter each take a staging buffer of the collective's size from
the CPU allocator (8 MiB for 8 MiB collectives, measured), which NCCL on a GPU does not take from
the caching allocator: the gloo ranks hold that much more than the trace. A CPU shows the
sharding's memory, not a GPU's streams (FSDP2 communicates on streams of its own, whose blocks
the caching allocator keeps apart).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch.distributed as dist

from bigbatch.verify.distributed import run_distributed


def config(layers: int, hidden: int, vocab: int) -> Any:
    import transformers

    return transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024,
    )  # fmt: skip


def setup_of(args: argparse.Namespace, ranks: int) -> Any:
    """The fine-tune on ``ranks`` ranks, its 4-bit storage the FSDP2 ranks' (one process's
    trace, composed, has the same weights)."""
    from dataclasses import replace

    from bigbatch.memory.lm import LMSetup, quant_storage_for

    sharded = LMSetup(
        seq_len=args.seq_len,
        lora_r=args.lora or (16 if args.qlora else 0),
        quant=4 if args.qlora else 0,
        quant_storage=args.quant_storage if args.qlora else "auto",
        world_size=args.ranks,
        fsdp=args.ranks > 1,
    )
    storage = quant_storage_for(sharded, "fp32") if args.qlora else "auto"
    return replace(sharded, quant_storage=storage, world_size=ranks, fsdp=ranks > 1)


def rank_spec(args: argparse.Namespace) -> Any:
    """One rank's step as the planner traces it (``lm_spec_at(..., sharded=True)``): in the
    process group there is, gloo's across processes or the fake one in this process."""
    from bigbatch.memory.lm import lm_spec_at

    cfg = config(args.layers, args.hidden, args.vocab)
    setup = setup_of(args, args.ranks)
    return lm_spec_at(cfg, setup, device="cpu", precision="fp32", sharded=True)(args.micro_batch)


def worker(rank: int, world_size: int, port: int, args: argparse.Namespace, out: str) -> None:
    from bigbatch.memory.measure import measure_step_peak

    peak = measure_step_peak(rank_spec(args))
    Path(out, f"rank{rank}.json").write_text(json.dumps({"rank": rank, "peak_bytes": peak}))
    dist.barrier()


def one_rank(args: argparse.Namespace) -> dict[str, int]:
    """One rank's step in this process on a fake process group, traced and really run, and the
    composition onto one process's trace (``plan_lm(..., apart=False)`` under torchrun); at the
    run's micro-batch. The same for evaluation's forward pass without gradients (no optimizer
    state: the forward's own memory)."""
    from bigbatch.memory.evaluate import predict_evaluation_peak
    from bigbatch.memory.fsdp import fake_ranks
    from bigbatch.memory.lm import lm_spec_at, model_sizes, per_rank_bytes
    from bigbatch.memory.measure import measure_step_peak
    from bigbatch.memory.meta import build_on_meta
    from bigbatch.memory.predict import predict_peak

    rank = rank_spec(args)
    with fake_ranks(args.ranks):
        traced, real = predict_peak(rank).peak_bytes, measure_step_peak(rank)
        evaluated = predict_evaluation_peak(rank, state_copies=0).peak_bytes
    cfg = config(args.layers, args.hidden, args.vocab)
    spec = lm_spec_at(cfg, setup_of(args, 1), device="cpu", precision="fp32")(args.micro_batch)
    one, one_evaluating = predict_peak(spec), predict_evaluation_peak(spec, state_copies=0)
    sizes = model_sizes(build_on_meta(spec.model))
    extra, _ = per_rank_bytes(sizes, one.parts(), setup_of(args, args.ranks))
    eval_extra, _ = per_rank_bytes(
        sizes, one_evaluating.parts(), setup_of(args, args.ranks), evaluation=True
    )
    return {
        "traced": traced,
        "fake_group": real,
        "composed": one.peak_bytes + extra,
        "eval_traced": evaluated,
        "eval_composed": one_evaluating.peak_bytes + eval_extra,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--lora", type=int, default=0, help="LoRA rank (0: a full fine-tune)")
    p.add_argument("--qlora", action="store_true", help="LoRA on a 4-bit base (r=16 unless --lora)")
    p.add_argument(
        "--quant-storage",
        choices=("auto", "uint8", "bf16"),
        default="auto",
        help="what --qlora packs its 4-bit values in (auto: bf16 under FSDP2)",
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as out:
        run_distributed(worker, args.ranks, args, out)
        measured = [json.loads(f.read_text()) for f in sorted(Path(out).glob("rank*.json"))]
    here = one_rank(args)
    largest = max(m["peak_bytes"] for m in measured)
    result = {
        "workload": f"Llama {args.layers} layers x {args.hidden}, vocab {args.vocab}, "
        f"{args.seq_len} tokens, micro-batch {args.micro_batch}, "
        f"{setup_of(args, args.ranks).describe().split(',')[0]}, AdamW, fp32, "
        f"FSDP2 over {args.ranks} CPU ranks",
        "gloo_per_rank_bytes": [m["peak_bytes"] for m in measured],
        "fake_group_bytes": here["fake_group"],
        "traced_bytes": here["traced"],
        "composed_bytes": here["composed"],
        "traced_over_fake_group": round(here["traced"] / here["fake_group"], 4),
        "traced_over_gloo": round(here["traced"] / largest, 4),
        "composed_over_gloo": round(here["composed"] / largest, 4),
        "composed_over_traced": round(here["composed"] / here["traced"], 4),
        "eval_traced_bytes": here["eval_traced"],
        "eval_composed_bytes": here["eval_composed"],
        "eval_composed_over_traced": round(here["eval_composed"] / here["eval_traced"], 4),
    }
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        mib = 2**20
        print(result["workload"])
        print(f"  gloo ranks, measured: {', '.join(f'{b / mib:.1f}' for b in result['gloo_per_rank_bytes'])} MiB")  # fmt: skip
        print(f"  one rank on a fake group, measured: {here['fake_group'] / mib:.1f} MiB")
        print(f"  traced: {here['traced'] / mib:.1f} MiB ({result['traced_over_fake_group']:.4f}x "
              f"the fake group's, {result['traced_over_gloo']:.3f}x gloo's largest)")  # fmt: skip
        print(f"  composed: {here['composed'] / mib:.1f} MiB ({result['composed_over_gloo']:.3f}x "
              f"gloo's largest, {result['composed_over_traced']:.3f}x traced)")  # fmt: skip
        print(f"  evaluation's forward: traced {here['eval_traced'] / mib:.1f} MiB, composed "
              f"{here['eval_composed'] / mib:.1f} MiB "
              f"({result['eval_composed_over_traced']:.3f}x)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
