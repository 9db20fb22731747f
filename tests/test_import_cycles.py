"""Each module of the core's lower floors imports first, alone: no import cycle waits
for the one module that happens to be imported before it (a CLI command, the SDK or
a worker may import any of them first)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import lanes.generation
import lanes.protocols

# One interpreter for all: before each module, every lanes module is forgotten, so each
# is imported first as in a fresh interpreter, while numpy and onnxruntime (no part of
# a lanes cycle) load once instead of once a module.
FIRST_EACH = """
import importlib, sys, traceback
failed = []
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m == "lanes" or m.startswith("lanes.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception:
        failed.append(name + ": " + traceback.format_exc().strip().splitlines()[-1])
print("\\n".join(failed))
"""


def modules_of(package: object) -> list[str]:
    path = package.__path__  # type: ignore[attr-defined]
    prefix = f"{package.__name__}."  # type: ignore[attr-defined]
    return sorted(module.name for module in pkgutil.iter_modules(path, prefix))


def test_each_module_imports_first() -> None:
    modules = modules_of(lanes.protocols) + modules_of(lanes.generation)
    done = subprocess.run(
        [sys.executable, "-c", FIRST_EACH, *modules], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "", done.stdout
