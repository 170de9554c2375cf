#!/usr/bin/env bash
# The wheels a GPU machine without a network may lack, for its Python and platform, into .whl/
# (ignored by git): `make gpu-evidence` installs them from there, offline. Run it here, where
# the package index is reachable, before the GPU session:
#
#     bash benchmarks/prepare_gpu_wheels.sh            # Python 3.12, manylinux x86-64
#     GPU_PYTHON=3.11 bash benchmarks/prepare_gpu_wheels.sh
#
# Only what such an image (torch, timm, transformers, numpy, pillow ... already there) lacks:
# MONAI and nibabel (3D rows), segmentation_models_pytorch (2D segmentation rows), peft and
# bitsandbytes (the language-model rows' LoRA adapters, 4-bit layers, 8-bit optimizers; 43 MB of
# the 64 MiB a device call carries), and for the nnU-Net rows nnunetv2's losses and network
# builder with dynamic_network_architectures and batchgenerators (0.4 MB: the rows import none of
# nnU-Net's other dependencies, tests/test_gpu_evidence.py). Versions from
# constraints.txt, so the GPU runs the code the tests ran. Each is pure Python: --no-deps keeps
# the image's own torch and numpy.
set -euo pipefail
cd "$(dirname "$0")/.."
py="${GPU_PYTHON:-3.12}"
pin() { grep -i "^$1==" constraints.txt; }
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux2014_x86_64 \
    --platform any -d .whl \
    "$(pin monai)" "$(pin segmentation-models-pytorch)" "$(pin nibabel)" "$(pin peft)" \
    "$(pin bitsandbytes)"
# Published as sources: built into pure-Python wheels (the pip cache's, where it has them).
python3 -m pip wheel -q --no-deps -w .whl \
    "$(pin nnunetv2)" "$(pin dynamic-network-architectures)" "$(pin batchgenerators)"
ls .whl
