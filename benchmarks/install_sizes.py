"""The disk a bigbatch install takes: per extra, what pip would add besides torch, measured from
an environment that has them all (the development venv).

    python benchmarks/install_sizes.py [--json]

Each package's size is the files its installed RECORD lists; an extra's size is the closure of
its requirements (what `pip install "bigbatch[extra]"` pulls in), without torch and its own
dependencies, which you install first for your hardware."""

from __future__ import annotations

import argparse
import json
import re
import sys
from importlib import metadata
from pathlib import Path


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _dists() -> dict[str, metadata.Distribution]:
    return {_norm(d.metadata["Name"]): d for d in metadata.distributions()}


def _size(dist: metadata.Distribution) -> int:
    total = 0
    for f in dist.files or []:
        path = Path(str(dist.locate_file(f)))
        if path.is_file():
            total += path.stat().st_size
    return total


def _closure(names: list[str], dists: dict[str, metadata.Distribution]) -> set[str]:
    seen: set[str] = set()
    todo = [_norm(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen or name not in dists:
            continue
        seen.add(name)
        for req in dists[name].requires or []:
            if "extra ==" in req:
                continue
            todo.append(_norm(re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0]))
    return seen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    dists = _dists()
    if "bigbatch" not in dists:
        print("bigbatch is not installed here: run it in the venv of `make venv`", file=sys.stderr)
        return 2
    bigbatch = dists["bigbatch"]
    reqs = bigbatch.requires or []
    extras = sorted({m.group(1) for r in reqs if (m := re.search(r'extra == "([^"]+)"', r))})
    core = _closure(["torch", "numpy"], dists)
    rows = {"torch (+ its dependencies)": sum(_size(dists[n]) for n in core)}
    for extra in extras:
        names = [
            re.split(r"[ ;<>=!~\[(]", r, maxsplit=1)[0]
            for r in reqs
            if f'extra == "{extra}"' in r and "python_version" not in r
        ]
        rows[f"[{extra}] besides torch"] = sum(
            _size(dists[n]) for n in _closure(names, dists) - core
        )
    venv = Path(sys.prefix)
    rows["this whole venv"] = sum(p.stat().st_size for p in venv.rglob("*") if p.is_file())
    mib = {k: round(v / 2**20) for k, v in rows.items()}
    if args.json:
        print(json.dumps(mib, indent=2))
    else:
        for k, v in mib.items():
            print(f"{k:40s} {v:8,d} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
