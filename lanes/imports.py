"""The user's own code named in workloads.yaml (`handler:`, `guard: {handler:}`), imported
from beside the spec.

The spec's folder goes first on the import path, as uvicorn's `--app-dir` and Prefect's
entrypoints do, so `handler: myhooks:handler` finds `myhooks.py` next to workloads.yaml
in every command and every worker process, without PYTHONPATH. It stays there: a hook
may import more of the user's modules when it runs, not only when it loads.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

from lanes.errors import HandlerError


def add_import_root(folder: Path) -> None:
    """Put `folder` first on `sys.path` unless it is already there."""
    path = str(folder)
    if path not in sys.path:
        sys.path.insert(0, path)


def import_object(ref: str, root: Path | None, what: str) -> Any:
    """The object `module:attr` names (attr may be dotted), imported with `root` on the
    path. `what` names the spec key in messages ("handler", "guard"). Raises
    `HandlerError` saying what failed and where it looked."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise HandlerError(f"{what} {ref!r}: expected 'module:attr', e.g. 'myhooks:handler'")
    if root is not None:
        add_import_root(root)
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as err:  # any failure while importing user code is the user's to fix
        where = f" (looked beside the spec in {root} and on sys.path)" if root else ""
        raise HandlerError(
            f"{what} {ref}: cannot import module {module_name!r}{where}: "
            f"{type(err).__name__}: {err}"
        ) from err
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise HandlerError(
                f"{what} {ref}: module {module_name!r} has no attribute {attr!r}"
            ) from None
        except Exception as err:  # a property of the user's that raises
            raise HandlerError(f"{what} {ref}: reading {part!r} failed: {err!r}") from err
    return target
