"""A handler for tests/test_slo.py whose run time is whatever the test says: each item's
`post` moves `costly.clock` (the server's clock) on by `costly.item_s`, then waits at
`costly.gate` while a test holds it closed. So a batch of n runs n x item_s on that
clock, whatever the machine's speed, and the cost model learns exactly that (its
horizon, 300 s on that clock, holds the last 30 runs)."""

from __future__ import annotations

from typing import Any

from tests.gates import Gate, ManualClock


class Costly:
    def __init__(self) -> None:
        self.clock = ManualClock()
        self.gate = Gate()
        self.item_s = 10.0
        self.items = 0  # items run so far

    def post(self, output: Any) -> Any:
        self.clock.advance(self.item_s)
        self.items += 1
        self.gate.wait()
        return output


costly = Costly()
