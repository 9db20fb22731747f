"""The record a run leaves beside its outputs: what it read and wrote, how fast, what it cost.

Written to `<output>/_manifests/<start>-<run>.json`, and to `<output>/_manifest.json`
for the latest run. Measured items/s are kept so a later run can be planned from them.

Cost: the run's `cost_estimate` is its device-hours at `price_per_device_hour`, on the
basis `cost_basis` names: "busy_seconds" for a run on the endpoint's sessions whose
every shard's batches said the model time they used there (`busy_seconds`, per shard in
`shard_stats`), the fair figure where the device is shared with interactive traffic
and the wall time holds every wait for it; else "wall_seconds", wall time x devices (a
manifest without `cost_basis` is older than it, and on wall time too);
`interactive_cost_estimate` is what the same items would have cost on the endpoint,
at the newest interactive measurement of the same model (lanes.measurements: `lanes
calibrate`, or a running endpoint's metrics), null when there is none.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

import orjson

from lanes.flows.shard import ShardStats
from lanes.layout import LATEST, MANIFESTS
from lanes.measurements import CostBasis, Throughput, usd_for
from lanes.storage import Storage
from lanes.uris import join


@dataclass(frozen=True)
class ShardFailure:
    input: str
    error: str


@dataclass(frozen=True)
class Manifest:
    """One run. Counts of `records`/`outputs`/`errors` are of the shards this run ran
    whole, `retried`/`recovered` of the records it reran in shards committed before
    (`--retry-errors`), `items` of both; the `total_*` ones are of every committed
    shard, including those skipped by this run. `shards` counts every shard of the
    input: run, skipped, failed and not started (past the run's `finish_by`, or after a
    shard found its endpoint gone)."""

    workload: str
    flow_run: str | None
    input: str
    output: str
    started_at: str
    ended_at: str
    finish_by: str | None  # the run's deadline, if it has one
    deadline_met: bool | None  # whether it ended by `finish_by`; None without one
    wall_seconds: float
    busy_seconds: float | None  # the endpoint's offline-lane model time; None: not known
    shards: int
    shards_run: int
    shards_skipped: int
    shards_failed: int
    shards_not_started: int
    shards_retried: int
    records: int
    outputs: int
    errors: int
    retried: int
    recovered: int
    items: int
    items_per_second: float
    total_outputs: int
    total_errors: int
    provider: str
    devices: int
    device_hours: float
    price_per_device_hour: float
    cost_estimate: float
    cost_per_1k_items: float | None  # null when the run ran no items
    cost_basis: CostBasis  # what device_hours are of: busy_seconds or wall_seconds
    interactive_items_per_second: float | None  # the measurement below, per device
    interactive_cost_estimate: float | None  # the same items on the endpoint
    interactive_cost_per_1k_items: float | None
    interactive_measured: str | None  # where and when that rate was measured
    failures: list[ShardFailure]
    shard_stats: list[ShardStats]

    def late_by(self) -> float | None:
        """Seconds the run ended after its deadline; None when it has none or met it."""
        if self.finish_by is None or self.deadline_met:
            return None
        ended, deadline = (
            datetime.fromisoformat(self.ended_at),
            datetime.fromisoformat(self.finish_by),
        )
        return (ended - deadline).total_seconds()

    def summary(self) -> dict[str, Any]:
        """The manifest without its per-shard lists."""
        data = asdict(self)
        del data["shard_stats"]
        data["failures"] = [f"{f.input}: {f.error}" for f in self.failures]
        return data


def build_manifest(
    *,
    workload: str,
    flow_run: str | None,
    input: str,
    output: str,
    started: datetime,
    ended: datetime,
    stats: list[ShardStats],
    failures: list[ShardFailure],
    price_per_device_hour: float,
    interactive: Throughput | None = None,
    finish_by: datetime | None = None,
    not_started: int = 0,
) -> Manifest:
    """`interactive`: the newest interactive measurement of the job's model, if any;
    `finish_by`: the run's deadline, if it has one; `not_started`: shards the run did
    not start."""
    ran = [s for s in stats if not s.skipped]
    whole = [s for s in ran if not s.retried]
    retried = [s for s in ran if s.retried]
    wall = max((ended - started).total_seconds(), 1e-9)
    items = sum(s.items for s in ran)
    # A host that ran shards counts as one device for as long as the run took: an
    # estimate that is right for one GPU per worker machine, and says so.
    devices = max(1, len({s.host for s in ran}))
    busy = _busy_seconds(ran)
    if busy is not None:
        # Offline runs beside each other (idle-priority threads on a CPU's cores) each
        # count their own time: a device is busy at most for as long as the run took,
        # as recorded (to the millisecond, at least one: the wall rate's own floor), so
        # that a rate per busy second is never below the rate per wall second.
        busy = min(busy, max(round(wall, 3), 1e-3) * devices)
    device_hours = busy / 3600 if busy is not None else wall / 3600 * devices
    providers = sorted({s.provider for s in ran}) or ["none"]
    cost = device_hours * price_per_device_hour
    online = _interactive_cost(interactive, price_per_device_hour, items)
    return Manifest(
        workload=workload,
        flow_run=flow_run,
        input=input,
        output=output,
        started_at=started.isoformat(),
        ended_at=ended.isoformat(),
        finish_by=finish_by.isoformat() if finish_by is not None else None,
        deadline_met=ended <= finish_by if finish_by is not None else None,
        wall_seconds=round(wall, 3),
        busy_seconds=round(busy, 9) if busy is not None else None,
        shards=len(stats) + len(failures) + not_started,
        shards_run=len(ran),
        shards_skipped=len(stats) - len(ran),
        shards_failed=len(failures),
        shards_not_started=not_started,
        shards_retried=len(retried),
        records=sum(s.records for s in whole),
        outputs=sum(s.outputs for s in whole),
        errors=sum(s.errors for s in whole),
        retried=sum(s.retried for s in retried),
        recovered=sum(s.recovered for s in retried),
        items=items,
        items_per_second=round(items / wall, 2),
        total_outputs=sum(s.outputs for s in stats),
        total_errors=sum(s.errors for s in stats),
        provider=", ".join(providers),
        devices=devices,
        device_hours=round(device_hours, 6),
        price_per_device_hour=price_per_device_hour,
        cost_estimate=round(cost, 6),
        cost_per_1k_items=round(cost / items * 1000, 8) if items else None,
        cost_basis="busy_seconds" if busy is not None else "wall_seconds",
        interactive_items_per_second=online.items_per_second,
        interactive_cost_estimate=online.cost,
        interactive_cost_per_1k_items=online.per_1k,
        interactive_measured=online.measured,
        failures=failures,
        shard_stats=stats,
    )


def _busy_seconds(ran: list[ShardStats]) -> float | None:
    """The model time the shards' batches used on the endpoint, when every shard that
    ran says (and they ran some: a zero would price items at nothing); else None."""
    if not ran or any(s.busy_seconds is None for s in ran):
        return None
    busy = sum(s.busy_seconds or 0.0 for s in ran)
    return busy if busy > 0 else None


@dataclass(frozen=True)
class _Online:
    items_per_second: float | None = None
    cost: float | None = None
    per_1k: float | None = None
    measured: str | None = None


def _interactive_cost(record: Throughput | None, price: float, items: int) -> _Online:
    if record is None:
        return _Online()
    rate = record.items_per_second
    measured_for = record.workload
    if record.provider is not None:  # a rate of another device than the run's is no match
        measured_for += f", on {record.provider}"
    return _Online(
        items_per_second=round(rate, 2),
        cost=round(usd_for(price, rate, items), 6),
        per_1k=round(usd_for(price, rate, 1000), 8),
        measured=f"{record.source} at {record.measured_at.isoformat()} ({measured_for})",
    )


def write_manifest(storage: Storage, manifest: Manifest) -> str:
    """Write the run's manifest and the latest-run copy; returns the run's URI."""
    data = orjson.dumps(asdict(manifest), option=orjson.OPT_INDENT_2)
    stamp = manifest.started_at.replace(":", "").replace("-", "").replace("+0000", "Z")
    run = (manifest.flow_run or "local")[:8]
    uri = join(manifest.output, MANIFESTS, f"{stamp}-{run}.json")
    storage.write_bytes(uri, data)
    storage.write_bytes(join(manifest.output, LATEST), data)
    return uri
