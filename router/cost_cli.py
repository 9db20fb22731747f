"""The router's cost half: `lanes calibrate`, and the cost table of `lanes plan`.

Plain typer-compatible functions; router.cli registers them.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from lanes.errors import InvalidInput
from lanes.measurements import COST_BASES, Measurements, Throughput
from lanes.router.console import progress_bar, writing
from lanes.router.plan import LaneCost, Route, decimals
from lanes.settings import Settings
from lanes.specfile import load_spec

if TYPE_CHECKING:
    from lanes.router.loadgen import Level

SpecOption = Annotated[
    Path | None, typer.Option("--file", "-f", help="workloads.yaml (default: LANES_SPEC).")
]


def calibrate(
    workload: Annotated[str, typer.Argument(help="The workload whose model to measure.")],
    seconds: Annotated[
        float, typer.Option("--seconds", "-s", help="Timed seconds per interactive level.")
    ] = 3.0,
    items: Annotated[
        int | None,
        typer.Option("--items", "-n", help="Offline items (default: 512; generate: 64)."),
    ] = None,
    from_metrics: Annotated[
        str | None,
        typer.Option(
            "--from-metrics",
            help="Instead of measuring, record the interactive lane's rate from the /metrics "
            "of the endpoint at this URL (items per busy second since it started).",
        ),
    ] = None,
    file: SpecOption = None,
) -> None:
    """Measure both lanes of WORKLOAD's model on this machine and store the rates under
    LANES_HOME/measurements: the offline shard path in process, then the endpoint in
    process under closed-loop load, the best rate whose p99 meets the workload's SLO."""
    from lanes.router.calibrate import (
        DEFAULT_ITEMS,
        measure_interactive,
        measure_offline,
        read_metrics,
    )

    settings = Settings()
    spec = load_spec(file or settings.spec, settings)
    w = spec.workload(workload)
    if not (math.isfinite(seconds) and seconds > 0):
        raise InvalidInput(f"--seconds: expected a positive number of seconds, found {seconds:g}")
    if items is not None and items <= 0:
        raise InvalidInput(f"--items: expected a positive number of items, found {items}")
    store = Measurements(settings.home)
    with _storing(store.folder):  # before minutes of measuring that could not be kept
        (store.folder / workload).mkdir(parents=True, exist_ok=True)
    if from_metrics is not None:
        record = read_metrics(spec, workload, settings, from_metrics)
        with _storing(store.folder):
            store.save(record)
        _print_records([record], settings, store)
        return
    count = items or DEFAULT_ITEMS[w.task]
    with progress_bar() as progress:
        bar = progress.add_task("offline lane: records", total=count)
        offline, samples = measure_offline(
            spec, workload, settings, count, lambda n: progress.advance(bar, n)
        )
        progress.update(
            bar, description=f"offline lane: {_figure(offline.items_per_second, 1)} items/s"
        )
        levels = progress.add_task("interactive lane: levels", total=None)

        def level_done(level: Level) -> None:
            p99 = f"{level.p99_ms:.1f} ms" if level.p99_ms is not None else "-"
            progress.update(
                levels,
                advance=1,
                description=f"interactive lane: {level.concurrency} clients, "
                f"{_figure(level.items_per_second, 1)} items/s, p99 {p99}",
            )

        interactive, ran = measure_interactive(
            spec, workload, settings, samples, seconds, level_done
        )
    with _storing(store.folder):
        store.save(offline)
        store.save(interactive)
    _print_levels(ran, interactive)
    _print_records([offline, interactive], settings, store)


def _storing(folder: Path) -> AbstractContextManager[None]:
    return writing(
        f"cannot store measurements under {folder}",
        "make LANES_HOME writable, or set it to a folder that is",
    )


def _print_levels(levels: list[Level], chosen: Throughput) -> None:
    table = Table(title=f"interactive lane, p99 target {chosen.slo_p99_ms:g} ms")
    for column in ("clients", "items/s", "p50 ms", "p99 ms", "errors", ""):
        table.add_column(column, justify="right")
    for level in levels:
        mark = "chosen" if level.concurrency == chosen.concurrency else ""
        table.add_row(
            str(level.concurrency),
            _figure(level.items_per_second, 1),
            f"{level.p50_ms:.2f}" if level.p50_ms is not None else "-",
            f"{level.p99_ms:.2f}" if level.p99_ms is not None else "-",
            str(level.errors),
            mark,
        )
    Console(width=160).print(table)


def _print_records(records: list[Throughput], settings: Settings, store: Measurements) -> None:
    price = settings.price_per_device_hour
    table = Table(title=f"{records[0].workload}: cost {_at_price(settings)}")
    for column in ("lane", "items/s", "$ / 1k items", "provider", "source"):
        table.add_column(column)
    for r in records:
        dollars = f"${_figure(r.usd_per_1k_items(price), 6)}"
        table.add_row(r.lane, _figure(r.items_per_second, 1), dollars, r.provider or "-", r.source)
    Console(width=160).print(table)
    typer.echo(f"stored under {store.folder / records[0].workload}")


def print_costs(routes: list[Route], settings: Settings) -> None:
    """`lanes plan`'s second table: each workload's $ per 1k items, its own lane first."""
    table = Table(title=f"$ per 1k items {_at_price(settings)}, one device per replica or worker")
    for column in ("workload", "lane", "$ / 1k items", "items/s", "measured"):
        table.add_column(column)
    for r in routes:
        for label, cost in (("own", r.cost), ("other", r.other_lane_cost)):
            cells = _cost_cells(cost, label, r.workload)
            table.add_row(r.workload if label == "own" else "", *cells)
    Console(width=160).print(table)


def _at_price(settings: Settings) -> str:
    """The price the table's dollars are at, and whether anyone chose it."""
    price = settings.price_per_device_hour
    if "price_per_device_hour" not in settings.model_fields_set:
        return f"at ${price:g} per device-hour, the default: set LANES_PRICE_PER_DEVICE_HOUR"
    return f"at ${price:g} per device-hour (LANES_PRICE_PER_DEVICE_HOUR)"


def _cost_cells(cost: LaneCost, label: str, workload: str) -> tuple[str, str, str, str]:
    lane = f"{cost.lane} ({label})"
    if cost.usd_per_1k_items is None or cost.items_per_second is None:
        return lane, "-", "-", cost.note or ""
    measured = str(cost.source)
    if cost.measured_at is not None:
        measured += " " + datetime.fromisoformat(cost.measured_at).strftime("%Y-%m-%d %H:%M %Z")
    if cost.provider is not None:
        measured += f" on {cost.provider}"
    if cost.measured_for not in (None, workload):
        measured += f" (of {cost.measured_for}, the same model)"
    if cost.cost_basis == "busy_seconds":
        measured += (
            f"; priced on {COST_BASES['busy_seconds']}: "
            f"{cost.items_per_busy_second} items per busy second"
        )
    elif cost.cost_basis == "wall_seconds":
        measured += f"; priced on {COST_BASES['wall_seconds']}"
    if cost.note:
        measured += f"; {cost.note}"
    dollars = f"${_figure(cost.usd_per_1k_items, 6)}"
    return lane, dollars, _figure(cost.items_per_second, 1), measured


def _figure(value: float, at_least: int) -> str:
    """`value` with `at_least` decimals, or three significant figures when smaller."""
    return f"{value:.{decimals(value, at_least)}f}"
