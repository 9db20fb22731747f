"""A run's progress events, for whoever watches in this process (`lanes run` draws a bar).

    planned   shards=<the run's>, pending=<those it runs>       (flows.batch)
    records   shard=<name>, records=<ran since the last event>  (flows.shard_task)
    shard     shard=<name>, records=<it ran; 0 when it failed>  (flows.scheduling)

A `records` event is seen only where the shard task runs: in this process with
threads, nowhere with Dask; the flow reports each finished shard itself.

Each is a DEBUG record of the "lanes.flows.progress" logger, its fields in the record's
`lanes` attribute and its name in `lanes_event`.
"""

from __future__ import annotations

import logging
from typing import Any

progress_log = logging.getLogger("lanes.flows.progress")


def progress(event: str, **fields: Any) -> None:
    progress_log.debug("%s %s", event, fields, extra={"lanes_event": event, "lanes": fields})
