"""A handler for the Batch API's tests: a text that says HOLD waits at the FileGate
(tests/gates.py) in the worker's process, so a test holds one shard of a batch open
while the others commit."""

from __future__ import annotations

from typing import Any

from tests.gates import FileGate

MARK = "HOLD"


class HoldMarked:
    @staticmethod
    def pre(item: Any) -> Any:
        if isinstance(item, str) and MARK in item:
            FileGate.wait()
        return item


hold = HoldMarked()
