"""The package users import: small, sorted, complete, and cheap to import."""

from __future__ import annotations

import subprocess
import sys

import lanes


def test_all_is_sorted_and_complete() -> None:
    assert lanes.__all__ == sorted(lanes.__all__)
    for name in lanes.__all__:
        assert hasattr(lanes, name), name
    public = {n for n in vars(lanes) if not n.startswith("_") and n[0].isupper()}
    assert public <= set(lanes.__all__) | {"Settings", "Spec"}


def test_import_pulls_no_onnxruntime_torch_or_prefect() -> None:
    probe = "import sys, lanes; print(sorted(m for m in ('onnxruntime', 'torch', 'prefect') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_serving_imports_neither_prefect_nor_torch() -> None:
    probe = (
        "import sys, serving.app, serving.server; "
        "print(sorted(m for m in ('torch', 'prefect') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
