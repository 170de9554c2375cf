"""nnU-Net's plans for a BraTS-shaped dataset against their memory targets, predicted from a CPU.

nnU-Net sizes patch and batch to a GPU memory target with a proxy (feature-map sizes against a
reference standing for 8 GB at batch 2); its documentation measured the residual-encoder
presets' targets of 8 / 24 / 40 GB at 9.1 / 22.7 / 36.6 GB. This plans a BraTS-shaped dataset
(4 MRI modalities, 1 mm, about 140 x 172 x 137 voxels after cropping, 3 tumour labels) with
nnU-Net's own planners (default 8 GB, ResEnc M 8 GB, L 24 GB, XL 40 GB), then predicts each
3d_fullres plan's training step at its batch size on a CUDA card (fp16 autocast, SGD with
momentum, deep supervision, DC+CE), what the card shows for the process (the allocator's
reserved peak and the CUDA context), and prints it beside the target; ``bigbatch8`` and
``bigbatch24`` are nnU-Net's default planner asking bigbatch's prediction instead of its proxy
(``nnUNetPlannerBigBatch``):

    python benchmarks/nnunet_plans.py [--json] [--planners default,M,L]

Nothing runs on a GPU; the dataset is a fingerprint (and one tiny case, for nnU-Net's reader).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

DATASET_ID = 988
DATASET = f"Dataset{DATASET_ID}_BraTSShaped"
PLANNERS = {  # name -> (nnU-Net's planner class, its memory target in GB, its plans name)
    "default": ("ExperimentPlanner", 8, "nnUNetPlans"),
    "M": ("nnUNetPlannerResEncM", 8, "nnUNetResEncUNetMPlans"),
    "L": ("nnUNetPlannerResEncL", 24, "nnUNetResEncUNetLPlans"),
    "XL": ("nnUNetPlannerResEncXL", 40, "nnUNetResEncUNetXLPlans"),
    # nnU-Net's default planner asking bigbatch's prediction instead of its proxy.
    "bigbatch8": ("bigbatch", 8, "nnUNetBigBatch8Plans"),
    "bigbatch24": ("bigbatch", 24, "nnUNetBigBatch24Plans"),
}


def write_dataset(root: Path, cases: int = 484) -> None:
    """A raw folder (dataset.json, one tiny case per modality for the reader) and a fingerprint
    of BraTS's shapes: what nnU-Net's planners read."""
    import nibabel as nib

    raw = root / "raw" / DATASET
    (raw / "imagesTr").mkdir(parents=True, exist_ok=True)
    (raw / "labelsTr").mkdir(parents=True, exist_ok=True)
    for c in range(4):
        image = np.random.default_rng(c).normal(size=(8, 8, 8)).astype(np.float32)
        nib.save(nib.Nifti1Image(image, np.eye(4)), raw / "imagesTr" / f"case_000_{c:04d}.nii.gz")
    nib.save(
        nib.Nifti1Image(np.zeros((8, 8, 8), np.uint8), np.eye(4)),
        raw / "labelsTr" / "case_000.nii.gz",
    )
    names = {"0": "T1", "1": "T1ce", "2": "T2", "3": "FLAIR"}
    labels = {"background": 0, "edema": 1, "non_enhancing": 2, "enhancing": 3}
    # numTraining as the fingerprint has cases: nnU-Net caps the batch of a small dataset.
    dataset = {
        "channel_names": names,
        "labels": labels,
        "numTraining": cases,
        "file_ending": ".nii.gz",
    }
    (raw / "dataset.json").write_text(json.dumps(dataset))
    rng = np.random.default_rng(0)
    shapes = np.stack(
        [rng.normal(140, 6, cases), rng.normal(172, 8, cases), rng.normal(137, 6, cases)], 1
    )
    intensity = {
        "max": 5.0,
        "mean": 1.0,
        "median": 1.0,
        "min": 0.0,
        "percentile_00_5": 0.1,
        "percentile_99_5": 4.0,
        "std": 0.5,
    }
    fingerprint = {
        "foreground_intensity_properties_per_channel": {str(c): intensity for c in range(4)},
        "median_relative_size_after_cropping": 0.6,
        "shapes_after_crop": shapes.round().astype(int).tolist(),
        "spacings": [[1.0, 1.0, 1.0]] * cases,
    }
    pre = root / "preprocessed" / DATASET
    pre.mkdir(parents=True, exist_ok=True)
    (pre / "dataset_fingerprint.json").write_text(json.dumps(fingerprint))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--planners",
        default="default,M,L,bigbatch8,bigbatch24",
        help="of default, M, L, XL, bigbatch8, bigbatch24 (nnUNetPlannerBigBatch at 8 / 24 GB)",
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--root",
        type=Path,
        help="keep nnU-Net's folders there (raw, preprocessed, results: then `bigbatch nnunet "
        "plan 988 --budget rtx3060` with nnUNet_preprocessed=ROOT/preprocessed); default: a "
        "temporary one",
    )
    args = ap.parse_args()
    chosen = [p.strip() for p in args.planners.split(",") if p.strip()]
    if args.root:
        rows = _plan_all(args.root, chosen)
    else:
        with tempfile.TemporaryDirectory(prefix="nnunet-plans-") as tmp:
            rows = _plan_all(Path(tmp), chosen)
    if args.json:
        print(json.dumps(rows))
        return 0
    head = f"{'planner':<8} {'target':>7} {'patch':<14} {'batch':>5} {'step':>8} {'process':>8}"
    print(head + f" {'/target':>8}")
    for r in rows:
        patch = "x".join(map(str, r["patch_size"]))
        print(
            f"{r['planner']:<8} {r['target_gb']:>5} GB {patch:<14} {r['batch_size']:>5} "
            f"{r['predicted_step_gb']:>5} GB {r['predicted_process_gb']:>5} GB "
            f"{r['predicted_over_target']:>8}"
        )
    print(
        "nnU-Net's documentation measured M, L, XL at 9.1, 22.7, 36.6 GB for 8, 24, 40 GB targets",
        file=sys.stderr,
    )
    return 0


def _plan_all(root: Path, chosen: list[str]) -> list[dict[str, object]]:
    """nnU-Net's planners on the BraTS-shaped fingerprint, then each 3d_fullres plan's
    training step predicted on an H100-class card (what its process would hold)."""
    for name in ("raw", "preprocessed", "results"):
        (root / name).mkdir(parents=True, exist_ok=True)
        os.environ[f"nnUNet_{name}"] = str(root / name)  # before nnU-Net is imported
    write_dataset(root)
    from nnunetv2.experiment_planning.plan_and_preprocess_api import (
        plan_experiment_dataset,
        plan_experiments,
    )

    from bigbatch.integrations.nnunet import nnUNetPlannerBigBatch, plan_dataset
    from bigbatch.memory.cards import find_card

    context = find_card("h100").context_bytes  # type: ignore[union-attr]
    rows: list[dict[str, object]] = []
    for key in chosen:
        planner, target, plans_name = PLANNERS[key]
        with contextlib.redirect_stdout(sys.stderr):
            if planner == "bigbatch":
                plan_experiment_dataset(
                    DATASET_ID, nnUNetPlannerBigBatch, target, overwrite_plans_name=plans_name
                )
            else:
                plan_experiments([DATASET_ID], planner, target)
        t0 = time.perf_counter()
        for row in plan_dataset(DATASET_ID, "h100", device="cuda"):
            if row["plans"] != plans_name or row["configuration"] != "3d_fullres":
                continue
            # What nvidia-smi shows for the process: the step's reserved peak and the context.
            whole = row["whole_batch_peak_bytes"] or row["predicted_peak_bytes"]
            rows.append(
                {
                    "planner": key,
                    "target_gb": target,
                    "patch_size": row["patch_size"],
                    "batch_size": row["batch_size"],
                    "predicted_step_gb": round(whole / 1e9, 2),
                    "predicted_process_gb": round((whole + context) / 1e9, 2),
                    "predicted_over_target": round((whole + context) / 1e9 / target, 3),
                    "predict_seconds": round(time.perf_counter() - t0, 1),
                }
            )
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
