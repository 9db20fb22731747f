"""Estimate what each image's extra adds to its base: the installed size of every
distribution the extra pulls in, read from this environment's package metadata.

    python infra/images/sizes.py [serve,batch worker ...]

Each argument is an extra of lanes (pyproject.toml), or several joined by commas as an
image's `pip install ".[serve,batch]"` names them. The figure is the venv's share of the
image (what `pip install .[EXTRA]` leaves in /opt/lanes, bytecode excluded: the images
set PYTHONDONTWRITEBYTECODE); add the base image's own size. A requirement that is not
installed here is listed as missing, not guessed.
"""

from __future__ import annotations

import re
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def lanes_requirements(extra: str) -> list[Requirement]:
    """What `pip install .[extra]` asks for, read from pyproject.toml (this tree's, not
    an installed lanes'), with lanes[...] self-references followed."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    found = [Requirement(r) for r in project["dependencies"]]
    pending, seen = extra.split(","), set()
    while pending:
        current = pending.pop()
        if current in seen:
            continue
        seen.add(current)
        for text in project["optional-dependencies"][current]:
            req = Requirement(text)
            if req.name == "lanes":
                pending += sorted(req.extras)
            else:
                found.append(req)
    return found


def _applies(req: Requirement, extras: frozenset[str]) -> bool:
    if req.marker is None:
        return True
    environment = default_environment()
    return any(req.marker.evaluate({**environment, "extra": e}) for e in extras or {""})


def closure(extra: str) -> tuple[dict[str, int], set[str]]:
    """Installed bytes per distribution that lanes[extra] pulls in, and the missing."""
    sizes: dict[str, int] = {}
    missing: set[str] = set()
    pending = [
        (r.name, frozenset(r.extras)) for r in lanes_requirements(extra) if _applies(r, frozenset())
    ]
    seen: set[tuple[str, frozenset[str]]] = set()
    while pending:
        name, wanted = pending.pop()
        key = (re.sub(r"[-_.]+", "-", name).lower(), wanted)
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            missing.add(name)
            continue
        if key[0] not in sizes:
            files = dist.files or []
            sizes[key[0]] = sum(f.size or 0 for f in files if "__pycache__" not in str(f))
        for text in dist.requires or []:
            req = Requirement(text)
            if _applies(req, wanted):
                pending.append((req.name, frozenset(req.extras)))
    return sizes, missing


def main() -> None:
    for extra in sys.argv[1:] or ["serve,batch", "worker"]:
        sizes, missing = closure(extra)
        total = sum(sizes.values())
        top = sorted(sizes.items(), key=lambda kv: -kv[1])[:6]
        print(f"lanes[{extra}]: {total / 2**20:,.0f} MiB in {len(sizes)} distributions")
        print("  largest: " + ", ".join(f"{n} {s / 2**20:,.0f}" for n, s in top))
        if missing:
            print("  not installed here (not counted): " + ", ".join(sorted(missing)))


if __name__ == "__main__":
    main()
