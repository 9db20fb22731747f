"""Each module of the core's lower floors imports first, alone: no import cycle waits
for the one module that happens to be imported before it (a CLI command, the SDK or
a worker may import any of them first)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import pytest

import lanes.generation
import lanes.protocols


def modules_of(package: object) -> list[str]:
    path = package.__path__  # type: ignore[attr-defined]
    prefix = f"{package.__name__}."  # type: ignore[attr-defined]
    return sorted(module.name for module in pkgutil.iter_modules(path, prefix))


@pytest.mark.parametrize("module", modules_of(lanes.protocols) + modules_of(lanes.generation))
def test_a_module_imports_first_in_a_fresh_interpreter(module: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", f"import {module}"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr.strip().splitlines()[-1]
