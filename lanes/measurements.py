"""Measured items/s per lane, kept under LANES_HOME, and what an item costs in each lane.

    store = Measurements(settings.home)
    store.save(Throughput(workload="search-query", model_key=key, lane="interactive",
                          items_per_second=rate, measured_at=now, source="calibrate"))
    newest(store.load(), "offline", key, workload="search-query")   # a Throughput or None
    usd_per_1k_items(settings.price_per_device_hour, rate)

A rate is *per device*: one replica of the endpoint, or one worker machine of an
offline run, holds one device (a GPU, or the CPU) for as long as it runs, so an item
costs `price_per_device_hour / 3600 / items_per_second`. An offline run on the
endpoint's sessions shares that device with interactive traffic: it is priced on the
model time its items used there (`items_per_busy_second`), not on its wall time.
`source` says where a rate came from: "calibrate" (`lanes calibrate`), "manifest URI"
(an offline run), "metrics URL" (a running endpoint's items per busy second).

Each record is one file, `<home>/measurements/<workload>/<stamp>-<lane>-<nonce>.json`,
written whole under a temporary name and then renamed: concurrent writers never
clash, and a reader never sees half of one. A file that does not read as a record is
skipped with a warning, never an error: measurements inform a plan, they never block
one.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import orjson
from pydantic import TypeAdapter, ValidationError

from lanes.spec import Mode

log = logging.getLogger(__name__)

FOLDER = "measurements"
# What an offline run's cost is on: the model time the endpoint's offline lane spent
# on its items (an endpoint run whose server reports it), or its wall time x devices
# (every other run, and manifests older than `cost_basis`).
CostBasis = Literal["busy_seconds", "wall_seconds"]
COST_BASES: dict[CostBasis, str] = {
    "busy_seconds": "the endpoint's offline-lane busy seconds",
    "wall_seconds": "wall time",
}
LANES: tuple[Mode, Mode] = ("offline", "interactive")


@dataclass(frozen=True)
class Throughput:
    """One lane's measured rate for one workload's model, per device."""

    workload: str
    model_key: str  # lanes.digests.model_key: the model's files by content, task settings
    lane: Mode
    items_per_second: float
    measured_at: datetime
    source: str  # "calibrate", "manifest URI" or "metrics URL"
    items: int = 0  # items the rate was measured over
    provider: str | None = None  # onnxruntime's execution provider
    batch_size: int | None = None  # offline: records per model run
    concurrency: int | None = None  # interactive: closed-loop clients of the chosen level
    p99_ms: float | None = None  # interactive: the chosen level's p99 latency
    slo_p99_ms: float | None = None  # interactive: the target it was held to
    meets_slo: bool | None = None  # interactive: False when even one client missed it
    # An offline run on the endpoint (`runner: {kind: endpoint}`): its items per second
    # of the model time the endpoint's offline lane spent on them, which its price is
    # on; None elsewhere (and in records older than it): priced on `items_per_second`.
    items_per_busy_second: float | None = None

    @property
    def cost_basis(self) -> CostBasis:
        return "busy_seconds" if self.items_per_busy_second is not None else "wall_seconds"

    @property
    def priced_rate(self) -> float:
        """The rate its price is on: per busy second where known, else per second."""
        busy = self.items_per_busy_second
        return busy if busy is not None else self.items_per_second

    def usd_per_1k_items(self, price_per_device_hour: float) -> float:
        return usd_per_1k_items(price_per_device_hour, self.priced_rate)


_ADAPTER = TypeAdapter(Throughput)


def usd_per_1k_items(price_per_device_hour: float, items_per_second: float) -> float:
    """What 1000 items cost on one device that runs `items_per_second`."""
    if items_per_second <= 0:
        raise ValueError(f"items_per_second: expected a positive rate, found {items_per_second}")
    return price_per_device_hour / 3600 / items_per_second * 1000


def usd_for(price_per_device_hour: float, items_per_second: float, items: int) -> float:
    """What `items` cost on one device that runs `items_per_second`."""
    return usd_per_1k_items(price_per_device_hour, items_per_second) * items / 1000


class Measurements:
    """The measurement records under one LANES_HOME."""

    def __init__(self, home: Path) -> None:
        self.folder = home / FOLDER

    def save(self, record: Throughput) -> Path:
        """Write `record`; returns its file. Raises OSError when the folder is not writable."""
        problem = _unpriceable(record)
        if problem is not None:
            raise ValueError(problem)
        folder = self.folder / record.workload
        folder.mkdir(parents=True, exist_ok=True)
        at = record.measured_at.astimezone(UTC).strftime("%Y%m%dT%H%M%S%fZ")
        path = folder / f"{at}-{record.lane}-{secrets.token_hex(3)}.json"
        temporary = path.with_name(f".{path.name}.tmp")
        temporary.write_bytes(orjson.dumps(asdict(record), option=orjson.OPT_INDENT_2))
        os.replace(temporary, path)
        return path

    def load(self) -> list[Throughput]:
        """Every readable record, newest first."""
        records = []
        for path in sorted(self.folder.glob("*/*.json")):
            try:
                record = _ADAPTER.validate_json(path.read_bytes())
            except (OSError, ValidationError) as err:
                log.warning("ignoring measurement %s: %s", path, _first_line(err))
                continue
            problem = _unpriceable(record)
            if problem is not None:
                log.warning("ignoring measurement %s: %s", path, problem)
                continue
            records.append(record)
        records.sort(key=lambda r: r.measured_at, reverse=True)
        return records


def _unpriceable(record: Throughput) -> str | None:
    """Why `record` cannot price an item or be ordered beside the others; None if it can."""
    for name, rate in (
        ("items_per_second", record.items_per_second),
        ("items_per_busy_second", record.items_per_busy_second),
    ):
        if rate is not None and not (math.isfinite(rate) and rate > 0):
            return f"{name}: expected a positive rate, found {rate}"
    if record.measured_at.utcoffset() is None:
        return (
            f"measured_at: expected a time with its UTC offset, found "
            f"{record.measured_at.isoformat()}"
        )
    return None


def newest(
    records: list[Throughput], lane: Mode, model_key: str, workload: str | None = None
) -> Throughput | None:
    """The newest record of `lane` for this model; `workload`'s own first (its batching
    and SLO shaped them), else another workload's of the same model and task settings.
    `records` newest first, as `Measurements.load` returns them."""
    same = [r for r in records if r.lane == lane and r.model_key == model_key]
    own = [r for r in same if r.workload == workload]
    found = own or same
    return found[0] if found else None


def cost_basis_of(manifest: Mapping[str, Any]) -> str:
    """What a manifest's cost is on, in words (one read back from storage may be older
    than `cost_basis`: then on wall time, and it says so)."""
    basis = manifest.get("cost_basis")
    if basis == "busy_seconds":
        return f"{COST_BASES['busy_seconds']} ({manifest.get('busy_seconds')} s)"
    if basis is None:
        return f"{COST_BASES['wall_seconds']} (a manifest without cost_basis)"
    return COST_BASES["wall_seconds"]


def _first_line(err: Exception) -> str:
    return str(err).splitlines()[0] if str(err) else type(err).__name__
