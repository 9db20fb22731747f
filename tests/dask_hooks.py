"""A handler for tests/test_dask_cluster.py: it notes which Dask worker ran each shard
and holds shards from 2 on at the FileGate (tests/gates.py), so a test can kill a
worker while it holds a shard, with no timing window."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tests.gates import FileGate

SHARD_LOG_ENV = "TESTS_SHARD_LOG"
# Each `dask worker` process of the test gets its own name here.
WORKER_NAME_ENV = "TESTS_WORKER_NAME"
HELD_FROM = 2


def worker_name() -> str:
    """The test's name of the process running this code ("local" outside a worker)."""
    return os.environ.get(WORKER_NAME_ENV, "local")


def started(log: Path) -> list[tuple[int, str]]:
    """(shard, worker) of every shard start noted in `log`, sorted."""
    found = []
    for marker in log.glob("shard-*"):
        _, shard, worker = marker.name.split("-", 2)
        found.append((int(shard), worker))
    return sorted(found)


class _WhereShardsRun:
    """`pre` notes `shard-S-WORKER` (S is `x[0][1]`) under $TESTS_SHARD_LOG, then holds
    shards from HELD_FROM on at the FileGate."""

    @staticmethod
    def pre(item: Any) -> Any:
        shard = int(item["x"][0][1])
        (Path(os.environ[SHARD_LOG_ENV]) / f"shard-{shard}-{worker_name()}").touch()
        if shard >= HELD_FROM:
            FileGate.wait()
        return item


where_shards_run = _WhereShardsRun()
