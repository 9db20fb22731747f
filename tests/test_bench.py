"""The bench scripts (bench/) are deliverables: each must still run as its docstring says.

A full run takes minutes; these run a script with its smallest arguments, for the
paths a refactor broke before without any test noticing.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def free_ports(count: int) -> int:
    """The first of `count` consecutive free ports (bench/generate.py serves policy i on
    --port + i)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first: int = s.getsockname()[1]
        try:
            for port in range(first, first + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return first
    raise RuntimeError(f"no {count} consecutive free ports on 127.0.0.1")


def test_generate_tracing_serves_the_traced_policy(demo_models: Path) -> None:
    # --tracing adds a policy of its own, which once had no spec and stopped the run
    # at a KeyError before any slice.
    args = ["--policies", "continuous", "--tracing", "--levels", "1", "--repeats", "1"]
    args += ["--seconds", "0.2", "--warm", "0", "--port", str(free_ports(2))]
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "generate.py"), *args],
        cwd=ROOT,
        env={**os.environ, "LANES_MODELS_DIR": str(demo_models)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "tracing at 1 clients: tokens/s on/off" in run.stdout, run.stdout
