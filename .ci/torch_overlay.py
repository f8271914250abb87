"""Lets a second virtual environment use this interpreter's torch without installing it again.

Run with the python of the torch-line venv:  python .ci/torch_overlay.py TARGET_VENV
It links torch and the distributions torch requires (recursively, markers evaluated here) into
TARGET_VENV/torch-line/ and adds that folder to TARGET_VENV's sys.path through a .pth file, i.e.
AFTER the target's own site-packages: pip in the target sees torch as installed (and leaves it
alone: it is outside that environment), and whatever the target installs itself shadows the
linked copies. Nothing else of this interpreter's site-packages (transformers, trl, ...) is
visible there. The same files are loaded, so an extension built against this torch loads there.
"""

from __future__ import annotations

import os
import re
import sys
import sysconfig
from importlib import metadata

try:
    from packaging.requirements import Requirement
except ImportError:  # a bare venv: pip's own copy
    from pip._vendor.packaging.requirements import Requirement


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(root: str) -> dict[str, metadata.Distribution]:
    """The installed distributions `root` needs, following the extras it asks for (torch asks
    for cuda-toolkit[cublas,cudart,...], whose extras bring the nvidia-* libraries)."""
    found: dict[str, metadata.Distribution] = {}
    seen: set[tuple[str, str]] = set()
    todo = [(root, "")]
    while todo:
        name, extra = todo.pop()
        name = _norm(name)
        if (name, extra) in seen:
            continue
        seen.add((name, extra))
        try:
            dist = found.get(name) or metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional requirement that is not installed
        found[name] = dist
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": extra}):
                todo += [(req.name, e) for e in ("", *sorted(req.extras))]
    return found


def main() -> None:
    target = os.path.abspath(sys.argv[1])
    purelib = sysconfig.get_paths()["purelib"]
    farm = os.path.join(target, "torch-line")
    os.makedirs(farm, exist_ok=True)
    for entry in os.listdir(farm):  # relink from scratch (the torch line may have changed)
        os.unlink(os.path.join(farm, entry))
    names: set[str] = set()
    for dist in closure("torch").values():
        base = str(dist.locate_file(""))
        if os.path.realpath(base) != os.path.realpath(purelib):
            continue  # installed elsewhere (a system package): already reachable or not ours
        for path in dist.files or []:
            top = path.parts[0]
            if top in ("..", "__pycache__") or top.endswith(".pth"):
                continue
            names.add(top)
    for top in sorted(names):
        src = os.path.join(purelib, top)
        if os.path.exists(src):
            os.symlink(src, os.path.join(farm, top))
    site = sysconfig.get_paths(vars={"base": target, "platbase": target})["purelib"]
    with open(os.path.join(site, "_torch_line.pth"), "w") as f:
        f.write(farm + "\n")
    print(f"linked {len(names)} entries of torch's distributions into {farm}")


if __name__ == "__main__":
    main()
