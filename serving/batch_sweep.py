"""The server's sweep of the Batch API's batches not yet ended, polled or not.

A batch's record changes only when a server looks at it (lanes.batches): unswept, one
that nobody retrieves or lists would never be finalized, its output file never listed,
its folder (a copy of its input, its run's shards) kept against the store's quota for
ever. Every `Settings.batch.sweep_s` the sweep does to each such batch what a retrieve
does (`Batches.settled`): its ended run finalizes it, its passed window stops its run.
Servers sharing a store all sweep it; the finalize claim (lanes.batch_claim) lets one
of them write a batch's files.

Each batch is looked at in a thread of its own call (the routes' way), so a shutdown
cancels the sweep between two batches; the one under way ends first, as a retrieve's
would. A batch that fails is logged with its id (its traceback the first time) and tried
again at the next sweep.
"""

from __future__ import annotations

import asyncio
import logging

from lanes.batch_claim import FINAL
from lanes.batches import Batches

log = logging.getLogger("lanes.serving")

# Batches looked at per sweep: each costs a read of its record and a call to the
# Prefect API. The next sweep goes on after the last one looked at, so with more
# batches under way than this, each is still looked at every few sweeps.
SWEEP_BATCHES = 100


def swept(batches: Batches, seconds: float) -> list[asyncio.Task[None]]:
    """The sweep's task every `seconds` (`Settings.batch.sweep_s`), started on the
    running loop; none for 0."""
    if seconds == 0:
        return []
    return [asyncio.create_task(BatchSweep(batches).every(seconds), name="lanes-batch-sweep")]


class BatchSweep:
    """Looks at the store's unfinished batches, SWEEP_BATCHES at most per `sweep()`."""

    def __init__(self, batches: Batches) -> None:
        self.batches = batches
        self._final: set[str] = set()  # ids seen final: such a record changes no more
        self._after = ""  # the last id looked at: the next sweep starts past it
        # Ids whose last look failed: logged whole once, then one line a sweep.
        self._failing: set[str] = set()

    async def every(self, seconds: float) -> None:
        """Sweeps every `seconds` until cancelled; a sweep that fails is logged."""
        while True:
            await asyncio.sleep(seconds)
            try:
                await self.sweep()
            except Exception:
                log.exception("the batch sweep failed; it runs again in %s s", seconds)

    async def sweep(self) -> None:
        """One sweep. A batch whose look fails is logged, and the sweep goes on."""
        listed = set(await asyncio.to_thread(self.batches.store.batch_ids))
        self._final &= listed  # a record deleted from the store
        due = sorted(listed - self._final)
        turn = [i for i in due if i > self._after] + [i for i in due if i <= self._after]
        for batch_id in turn[:SWEEP_BATCHES]:
            self._after = batch_id
            try:
                record, _ = await asyncio.to_thread(self.batches.settled, batch_id)
            except Exception as err:
                if batch_id in self._failing:
                    log.warning("the batch sweep failed on batch %s again: %s", batch_id, err)
                else:
                    self._failing.add(batch_id)
                    log.exception(
                        "the batch sweep failed on batch %s; it tries again next sweep", batch_id
                    )
                continue
            self._failing.discard(batch_id)
            if record["status"] in FINAL:
                self._final.add(batch_id)
