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


def test_generate_prints_no_nan_for_slices_without_a_first_token(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Slices too short for any request's first token have no TTFT: the tables, checks
    and ratios print `-` (and say what it means), never nan. Fabricated runs: the
    printing alone, no server."""
    from bench.generate import (
        NONE_NOTE,
        STEERED,
        TRACED,
        Run,
        burst_tables,
        checks,
        results_table,
        tracing_costs,
    )

    def run(policy: str, clients: int, ttft: list[float]) -> Run:
        counted = {"tokens": 100.0, "rows": 10.0, "steps": 5.0, "decode_s": 0.5}
        return Run(policy, clients, seconds=1.0, ttft=ttft, itl=[0.01], raw=[200.0], **counted)

    runs = {
        (policy, clients): run(policy, clients, [0.05] if clients == 16 else [])
        for policy in ("continuous", "static", TRACED, STEERED)
        for clients in (1, 16)
    }
    results_table(runs)
    checks(runs, 64)
    tracing_costs(runs, [1, 16])
    burst_tables(runs, [1])
    printed = capsys.readouterr().out
    assert "nan" not in printed.lower(), printed
    assert NONE_NOTE in printed
    assert "TTFT p50 at 1 client: - (not measured" in printed
    assert "TTFT p50 - vs - ms" in printed  # tracing at 1 client
