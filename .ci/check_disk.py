"""Stop before a venv's install when the disk cannot hold it, with the numbers and the fix.

pip's own failure comes minutes in, as `OSError: [Errno 28] No space left on device`, and leaves
a half-installed venv behind; this says up front what is needed and what is free.
"""

from __future__ import annotations

import argparse
import shutil
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--need-gib", type=float, required=True, help="GiB the step needs")
    parser.add_argument("--for", dest="purpose", required=True, help="what needs the space")
    parser.add_argument("--path", default=".", help="a folder on the disk that is checked")
    args = parser.parse_args()
    free_gib = shutil.disk_usage(args.path).free / 2**30
    if free_gib >= args.need_gib:
        return 0
    print(
        f"error: {args.purpose} need about {args.need_gib:g} GiB of disk, and "
        f"{free_gib:.1f} GiB are free under {args.path}: free some (old clones and venvs, "
        "/tmp/pytest-of-$USER, ~/.cache/pip) and run make again.",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
