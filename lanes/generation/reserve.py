"""Rows the offline lane leaves free for interactive arrivals.

An interactive request that finds every row taken by offline sequences preempts one
(lanes/generation/scheduler.py): the offline sequence's cache is copied out and back
in, or recomputed, and the step that admits the arrival also pays for that. When
interactive requests keep arriving, it is cheaper to keep a few rows free for them:
offline sequences never take the last `rows()` rows, so an arrival usually finds a free
one and preemption stays the exception (a burst larger than the reserve still
preempts). The reserve follows the interactive arrival rate: as many rows as
interactive requests arrived in the last `window_s`, at most `share` of the rows
(rounded down), and none once interactive traffic stops, so an offline job alone has
every row. Pure: the scheduler feeds it arrival times on its own clock.
"""

from __future__ import annotations

import math
from collections import deque

RESERVE_SHARE = 0.25  # at most this share of the rows (rounded down) is kept free
RESERVE_WINDOW_S = 2.0  # arrivals this recent count


class Reserve:
    """Free rows kept for interactive arrivals, from their recent rate."""

    def __init__(self, share: float = RESERVE_SHARE, window_s: float = RESERVE_WINDOW_S) -> None:
        if not 0 <= share < 1:
            raise ValueError(f"share: expected a number in [0, 1), found {share!r}")
        self.share = share
        self.window_s = window_s
        self._arrivals: deque[float] = deque()

    def arrived(self, at: float) -> None:
        """An interactive request arrived `at` (the scheduler's clock)."""
        self._arrivals.append(at)
        self._expire(at)

    def _expire(self, now: float) -> None:
        while self._arrivals and self._arrivals[0] <= now - self.window_s:
            self._arrivals.popleft()

    def rows(self, max_running: int, now: float) -> int:
        """Rows of `max_running` that offline sequences must leave free `now`."""
        if not self._arrivals:  # no interactive arrival in the window (an offline batch)
            return 0
        self._expire(now)
        return min(len(self._arrivals), math.floor(self.share * max_running))
