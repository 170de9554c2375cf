"""Predicted vs measured peak memory of a training step on CPU.

For each model and micro-batch, bigbatch predicts the peak on fake tensors (with the per-op CPU
workspace calibration from two real steps at micro-batch 2 and 4), then one real run is measured
with the profiler's allocation events. Prints each error, the mean and worst |error|, and the
time to predict (calibration included). Also shows the uncalibrated prediction beside it.

    python benchmarks/memory_accuracy.py          # MLP, BN CNN, transformer, resnet18, convnext_atto,
                                                  # LSTM, GRU, GPT (tied embedding, SDPA), 2D/3D U-Net,
                                                  # MONAI's 3D nets, smp's U-Net and FPN
    python benchmarks/memory_accuracy.py --json   # {"mean_abs_err_pct": ..., "worst_abs_err_pct": ..., ...}
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from bigbatch.memory.calibrate import calibrate
from bigbatch.memory.measure import measure_step_peak
from bigbatch.memory.predict import predict_peak
from bigbatch.memory.step import StepSpec
from bigbatch.models import timm_factory
from bigbatch.segmentation.decoders import smp_factory
from bigbatch.segmentation.models import UNet
from bigbatch.segmentation.networks import build_network


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )


def bn_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1, stride=2),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    )


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(64, 128)
        layer = nn.TransformerEncoderLayer(128, 4, 256, batch_first=True, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, 2)
        self.head = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)).mean(1))


class Recurrent(nn.Module):
    """A 2-layer LSTM or GRU over 64 steps (oneDNN's fused kernels on CPU), last step -> head."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.rnn = {"lstm": nn.LSTM, "gru": nn.GRU}[kind](32, 128, num_layers=2, batch_first=True)
        self.head = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


class GPT(nn.Module):
    """A small GPT: tied token embedding, causal scaled_dot_product_attention, 2 blocks."""

    def __init__(self, vocab: int = 512, dim: int = 128, heads: int = 4, blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(64, dim))
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "ln1": nn.LayerNorm(dim),
                    "qkv": nn.Linear(dim, 3 * dim),
                    "proj": nn.Linear(dim, dim),
                    "ln2": nn.LayerNorm(dim),
                    "mlp": nn.Sequential(
                        nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)
                    ),
                }
            )
            for _ in range(blocks)
        )
        self.heads = heads
        self.ln = nn.LayerNorm(dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        b, t, d = x.shape
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["ln1"](x)).split(d, dim=-1)
            q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + blk["proj"](att.transpose(1, 2).reshape(b, t, d))
            x = x + blk["mlp"](blk["ln2"](x))
        return self.ln(x) @ self.embed.weight.T  # tied output embedding


# name -> (factory, one sample's shape, input dtype)
MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], torch.dtype]] = {
    "mlp": (mlp, (512,), torch.float32),
    "bn_cnn": (bn_cnn, (3, 32, 32), torch.float32),
    "transformer": (Encoder, (32, 64), torch.float32),
    "resnet18": (timm_factory("resnet18", num_classes=10), (3, 64, 64), torch.float32),
    "convnext_atto": (timm_factory("convnext_atto", num_classes=10), (3, 64, 64), torch.float32),
    # Its constructor sizes stages with torch.unique, which meta tensors lack: built on the CPU.
    "regnetx_002": (timm_factory("regnetx_002", num_classes=10), (3, 64, 64), torch.float32),
    "lstm": (lambda: Recurrent("lstm"), (64, 32), torch.float32),
    "gru": (lambda: Recurrent("gru"), (64, 32), torch.float32),
    "gpt": (GPT, (64,), torch.long),
    # Segmentation: a 2D U-Net on 64 px images and a 3D U-Net on 4-modality 32^3 volumes.
    "unet2d": (lambda: UNet(3, 2, dims=2, width=16, depth=3), (3, 64, 64), torch.float32),
    "unet3d": (lambda: UNet(4, 3, dims=3, width=8, depth=3), (4, 32, 32, 32), torch.float32),
    # MONAI's 3D networks as bigbatch train builds them (GroupNorm SegResNet; DynUNet, whose
    # output block has two parents).
    "segresnet3d": (
        lambda: build_network("segresnet", 4, 3, dims=3, size=32, widths=(8, 16, 32)),
        (4, 32, 32, 32),
        torch.float32,
    ),
    "dynunet3d": (
        lambda: build_network("dynunet", 4, 3, dims=3, size=32, widths=(8, 16, 32, 64)),
        (4, 32, 32, 32),
        torch.float32,
    ),
    # segmentation_models_pytorch's decoders on timm encoders, as task=segmentation encoder=
    # builds them, on non-square 2D frames (4 overlapping classes, as Understanding Clouds).
    "smp_unet_effb0": (
        smp_factory("unet", "efficientnet_b0", in_channels=3, num_classes=4),
        (3, 96, 160),
        torch.float32,
    ),
    "smp_fpn_resnet18": (
        smp_factory("fpn", "resnet18", in_channels=3, num_classes=4),
        (3, 96, 160),
        torch.float32,
    ),
}


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    for name in args.models.split(","):
        factory, shape, dtype = MODELS[name]
        t0 = time.perf_counter()
        cal = calibrate(StepSpec(factory, shape, 2, input_dtype=dtype))
        calibration_s = time.perf_counter() - t0
        for b in batches:
            spec = StepSpec(factory, shape, b, input_dtype=dtype)
            t0 = time.perf_counter()
            pred = predict_peak(spec, calibration=cal)
            predict_s = time.perf_counter() - t0
            raw = predict_peak(spec)
            real = measure_step_peak(spec)
            rows.append(
                {
                    "model": name,
                    "micro_batch": b,
                    "predicted_bytes": pred.peak_bytes,
                    "measured_bytes": real,
                    "err_pct": 100 * (pred.peak_bytes - real) / real,
                    "uncalibrated_err_pct": 100 * (raw.peak_bytes - real) / real,
                    "predict_seconds": calibration_s + predict_s,
                }
            )
    errs = [abs(r["err_pct"]) for r in rows]
    raw_errs = [abs(r["uncalibrated_err_pct"]) for r in rows]
    result = {
        "mean_abs_err_pct": statistics.mean(errs),
        "worst_abs_err_pct": max(errs),
        "uncalibrated_mean_abs_err_pct": statistics.mean(raw_errs),
        "uncalibrated_worst_abs_err_pct": max(raw_errs),
        "max_predict_seconds": max(r["predict_seconds"] for r in rows),
        "rows": rows,
        "torch": torch.__version__,
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(
        f"{'model':<14} {'mb':>4} {'predicted':>12} {'measured':>12} {'error':>8} {'uncalibrated':>13} {'seconds':>8}"
    )
    for r in rows:
        print(
            f"{r['model']:<14} {r['micro_batch']:>4} {r['predicted_bytes'] / 2**20:>9.2f} MiB "
            f"{r['measured_bytes'] / 2**20:>9.2f} MiB {r['err_pct']:>+7.1f}% {r['uncalibrated_err_pct']:>+12.1f}% "
            f"{r['predict_seconds']:>8.2f}"
        )
    print(
        f"\nmean |error| {result['mean_abs_err_pct']:.1f}%, worst {result['worst_abs_err_pct']:.1f}% "
        f"(uncalibrated: mean {result['uncalibrated_mean_abs_err_pct']:.1f}%, worst "
        f"{result['uncalibrated_worst_abs_err_pct']:.1f}%); slowest prediction incl. calibration "
        f"{result['max_predict_seconds']:.2f} s"
    )


if __name__ == "__main__":
    main()
