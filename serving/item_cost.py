"""What one input costs an embed or infer workload's runs, and so where its batches run.

A batch worker (serving/worker.py) learns the running mean of a whole run's time per
input from every run (`ItemCost.learn`); a batch expected to take less than
INLINE_RUN_S runs on the event loop rather than the model's thread, and the queue's
expected wait is its length at that cost. Apart from the worker because it is the one
number its choices read, learned the same way from either lane's runs.
"""

from __future__ import annotations

from lanes.isolation import Failed
from lanes.serving.batch_run import Result

# A batch expected to run shorter than this runs on the event loop itself: waking
# the model thread and then the loop again costs ~0.15-0.2 ms on a small VM (see
# serving/model_thread.py), ten times a tiny model's run, and a loop blocked this
# long holds up other requests for little more than those two wake-ups would.
INLINE_RUN_S = 0.0005
_COST_WEIGHT = 0.5  # of the newest batch in the running per-item cost: adapts in a few runs


class ItemCost:
    """The running mean of run time per input; `seconds` is None before a whole run."""

    def __init__(self) -> None:
        self.seconds: float | None = None

    def runs_inline(self, items: int) -> bool:
        """Whether a batch of `items` would run on the event loop (see INLINE_RUN_S)."""
        return self.seconds is not None and self.seconds * items < INLINE_RUN_S

    def learn(self, result: Result) -> Result:
        """A whole run's duration teaches the cost per item that decides where a batch
        runs."""
        outputs, took = result
        if not any(isinstance(o, Failed) for o in outputs):
            cost = took / len(outputs)
            old = self.seconds
            self.seconds = cost if old is None else old + _COST_WEIGHT * (cost - old)
        return result
