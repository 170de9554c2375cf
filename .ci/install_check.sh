#!/usr/bin/env bash
# The install a user gets, checked outside the checkout (run by `make test`):
#  1. the wheel and the sdist build; the sdist carries the tests and the docs;
#  2. the wheel with [train] runs `bigbatch demo --epochs 1` from another folder;
#  3. the core alone: each command that needs an extra exits 2 with one line naming it.
# No download: both environments take their dependencies from the development venv, the core
# one only torch's and numpy's. With a folder argument, the demo's output and log stay there
# (tests/cli/test_cli_demo.py checks them).
set -euo pipefail
cd "$(dirname "$0")/.."
DEV=$(realpath -s "${DEV_PYTHON:-.venv/bin/python}")
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
DEMO=${1:-$T/demo}
mkdir -p "$DEMO"
DEMO=$(realpath "$DEMO")
SITE=$($DEV -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

$DEV -m build --no-isolation --outdir "$T/dist" . >"$T/build.log" 2>&1 || { tail -20 "$T/build.log"; exit 1; }
WHEEL=$(ls "$T"/dist/bigbatch-*.whl)
SDIST=$(ls "$T"/dist/bigbatch-*.tar.gz)
tar -tzf "$SDIST" >"$T/sdist.txt"
for f in tests/helpers.py tests/memory/real_oom_timm_script.py docs/index.md mkdocs.yml; do
    grep -q "/$f\$" "$T/sdist.txt" || { echo "install check: the sdist lacks $f"; exit 1; }
done

# An environment whose only bigbatch is the wheel: a .pth line puts the given folder on its
# path (its own .pth files, the editable install's among them, are not read from there).
env_with() {  # env_with NAME FOLDER
    "$(command -v python3.11 || command -v python3)" -m venv --without-pip "$T/$1"
    local site
    site=$("$T/$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$2" >"$site/_deps.pth"
    $DEV -m pip --python "$T/$1/bin/python" install -q --no-deps --no-index "$WHEEL"
}

env_with full "$SITE"
cd "$T"
full/bin/python -c 'import bigbatch, sys; print(bigbatch.__file__); sys.exit("/site-packages/" not in bigbatch.__file__)'
# The package data the wheel must carry: the CUDA model's cuDNN profile (read without a GPU).
full/bin/python -c 'import sys, torch; from bigbatch.memory.cuda_cudnn import profile_for_target as p
sys.exit(not torch.cuda.is_available() and p() is None)'
full/bin/bigbatch --version
full/bin/bigbatch demo --epochs 1 --out "$DEMO" >"$DEMO/demo.log" 2>&1 || { tail -30 "$DEMO/demo.log"; exit 1; }
test -s "$DEMO/runs/submission.csv"
echo "install check: the wheel with [train] ran bigbatch demo --epochs 1 outside the checkout"

# The core: torch, numpy and what they need; none of the extras' libraries.
mkdir "$T/core-deps"
for entry in "$SITE"/*; do
    name=$(basename "$entry" | tr '[:upper:]' '[:lower:]')
    case "$name" in
        timm* | pil | pillow* | torchvision* | safetensors* | rich* | torchmetrics* | \
        matplotlib* | monai* | nibabel* | einops* | scipy* | pydicom* | sklearn* | \
        scikit_learn* | lightning* | fastai* | keras* | tensorflow* | jax* | transformers* | \
        bigbatch* | \
        __editable__* | *.pth) ;;
        *) ln -s "$entry" "$T/core-deps/" ;;
    esac
done
env_with core "$T/core-deps"
mkdir -p "$T/images/a" "$T/images/b"
for c in a b; do for i in 1 2; do printf '\x89PNG\r\n' >"$T/images/$c/$i.png"; done; done
mkdir -p "$T/volumes/images" "$T/volumes/masks"
core/bin/python -c "
import numpy as np
for i in range(4):
    m = np.zeros((16, 16, 16), dtype=np.int64); m[4:8, 4:8, 4:8] = 1
    np.save('$T/volumes/images/%d.npy' % i, m.astype(np.float32) + i)
    np.save('$T/volumes/masks/%d.npy' % i, m)"
# A finished run's folder as train writes it (its config checked once the extra is there).
mkdir -p "$T/run" && echo '{}' >"$T/run/config.json" && echo '{}' >"$T/run/done.json"
core/bin/bigbatch --help >/dev/null
for command in "plan --arch resnet18 --batch 8 --budget 1GB" "train data=$T/images --out $T/r" \
    "demo --out $T/d" "predict $T/run $T/images" \
    "train data=$T/volumes task=segmentation arch=segresnet size=16 --out $T/s"; do
    set +e
    core/bin/bigbatch $command >"$T/stdout.txt" 2>"$T/stderr.txt"
    code=$?
    set -e
    want="'train' extra"
    case "$command" in *segmentation*) want="'seg' extra" ;; esac
    # One error line naming the extra, no traceback (predict says its device before it).
    if [ $code -ne 2 ] || [ "$(grep -c 'error:' "$T/stderr.txt")" -ne 1 ] \
        || grep -q Traceback "$T/stderr.txt" || ! grep -q "error:.*$want" "$T/stderr.txt"; then
        echo "install check: core 'bigbatch $command' exited $code with:"; cat "$T/stderr.txt"; exit 1
    fi
done
echo "install check: a core install's commands that need an extra exit 2 naming it"
