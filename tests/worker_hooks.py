"""A handler for tests/test_batching.py: it records which thread ran each item's `post`,
and makes an item whose total is over 100 "slow": it costs SLOW_S on the worker's
clock (`threads.clock`), and it waits at `threads.gate` while a test holds it closed."""

from __future__ import annotations

import threading
from typing import Any

from tests.gates import Gate, ManualClock

SLOW_S = 0.005


class Threads:
    def __init__(self) -> None:
        self.names: list[str] = []
        self.clock = ManualClock()
        self.gate = Gate()

    def post(self, output: Any) -> Any:
        self.names.append(threading.current_thread().name)
        if float(output["total"].sum()) > 100:
            self.clock.advance(SLOW_S)
            self.gate.wait()
        return output


threads = Threads()
