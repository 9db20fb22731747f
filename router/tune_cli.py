"""`lanes tune WORKLOAD`: the table, the picture and the YAML of router.tune's search.

A plain typer-compatible function; router.cli registers it.
"""

from __future__ import annotations

import re
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from lanes.errors import InvalidInput, LanesError
from lanes.router.console import progress_bar, writing
from lanes.settings import Settings
from lanes.specfile import load_spec

if TYPE_CHECKING:
    from lanes.router.loadgen import Level
    from lanes.router.tune import Config, Point

_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s)?\s*$")


def parse_ms(text: str, option: str) -> float:
    """`50`, `50ms` or `0.05s` as milliseconds."""
    found = _DURATION.match(text)
    if found is None or float(found.group(1)) <= 0:
        raise InvalidInput(f"{option}: expected a positive time like 50ms or 0.05s, found {text!r}")
    value = float(found.group(1))
    return value * 1000 if found.group(2) == "s" else value


def _numbers(text: str, option: str, least: float) -> list[float]:
    try:
        values = sorted({float(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise InvalidInput(
            f"{option}: expected numbers separated by commas, found {text!r}"
        ) from None
    if not values or values[0] < least:
        raise InvalidInput(f"{option}: expected numbers of at least {least:g}, found {text!r}")
    return values


def _counts(text: str | None, option: str) -> list[int]:
    """Whole numbers of at least 1 (empty: none given)."""
    if text is None:
        return []
    values = _numbers(text, option, 1)
    if any(not v.is_integer() for v in values):
        raise InvalidInput(f"{option}: expected whole numbers, found {text!r}")
    return [int(v) for v in values]


def parse_prefills(text: str) -> list[int | None]:
    """`whole` (None) and whole numbers of at least 1, in order, each once."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    numbers = ",".join(part for part in parts if part != "whole")
    if not parts:
        raise InvalidInput(f"--prefill: expected whole or token counts like 64,256, found {text!r}")
    counts: list[int | None] = [*_counts(numbers, "--prefill")] if numbers else []
    return [None, *counts] if "whole" in parts else counts


def tune(
    workload: Annotated[str, typer.Argument(help="The interactive workload to tune.")],
    p99: Annotated[
        str | None,
        typer.Option(
            "--p99",
            help="p99 target, e.g. 50ms (default: the workload's slo.p99_ms, else "
            "100ms; generate: 5s).",
        ),
    ] = None,
    write: Annotated[
        bool,
        typer.Option(
            "--write", help="Set the best configuration in the spec file, every other byte kept."
        ),
    ] = False,
    file: Annotated[
        Path | None,
        typer.Option("--spec", "--file", "-f", help="workloads.yaml (default: LANES_SPEC)."),
    ] = None,
    endpoint: Annotated[
        str | None,
        typer.Option(
            "--endpoint",
            help="Measure the server running at this URL instead of one of tune's own: only "
            "the configuration it serves (its batching cannot be changed from here).",
        ),
    ] = None,
    sizes: Annotated[
        str | None,
        typer.Option(
            "--sizes",
            help="max_batch_size values, e.g. 8,32,64 (default: a quarter of the "
            "declared one, it, twice it).",
        ),
    ] = None,
    waits: Annotated[
        str | None,
        typer.Option(
            "--waits",
            help="max_wait_ms values, e.g. 0,2 (default: 0, the declared one, twice "
            "it or 2); not for generate.",
        ),
    ] = None,
    prefill: Annotated[
        str | None,
        typer.Option(
            "--prefill",
            help="generate: max_prefill_tokens values, e.g. whole,64,256 (whole: each "
            "prompt in one run; default: whole, 64, 256, or around the declared one).",
        ),
    ] = None,
    concurrency: Annotated[
        str | None,
        typer.Option(
            "--concurrency",
            "-c",
            help="Client counts, e.g. 1,4,16,64 (default: 1, 4, 16, ... up to the largest size).",
        ),
    ] = None,
    seconds: Annotated[
        float, typer.Option("--seconds", "-s", help="Timed seconds of each slice of a point.")
    ] = 1.0,
    repeats: Annotated[
        int, typer.Option("--repeats", "-r", help="Slices per point, interleaved.")
    ] = 2,
    png: Annotated[
        Path | None,
        typer.Option("--png", help="Where the chart goes (default: LANES_HOME/tune/WORKLOAD.png)."),
    ] = None,
) -> None:
    """Search WORKLOAD's batching (max_batch_size x max_wait_ms; generate: x max_prefill_tokens)
    under closed-loop load at several concurrencies, on an endpoint of its own in this
    process; print throughput, p50 and p99 of each point, mark the fastest whose p99
    meets the target, draw latency against throughput, and print the YAML to paste
    (or, with --write, set it in the spec)."""
    from lanes.router.calibrate import slo_p99_ms
    from lanes.router.plot import plotting_missing, save_chart
    from lanes.router.tune import (
        Plan,
        best_point,
        chart,
        clients,
        current,
        default_levels,
        default_prefills,
        default_sizes,
        default_waits,
        grid,
        interactive,
        measure,
        snippet,
        write_knobs,
    )

    settings = Settings()
    spec_path = file or settings.spec
    spec = load_spec(spec_path, settings)
    w = interactive(spec, workload)
    if seconds <= 0 or repeats < 1:
        raise InvalidInput("--seconds and --repeats: expected a positive time and at least 1")
    target = parse_ms(p99, "--p99") if p99 is not None else slo_p99_ms(w)
    declared = current(w)
    if endpoint is not None:
        if sizes is not None or waits is not None or prefill is not None or write:
            raise InvalidInput(
                "--sizes, --waits, --prefill and --write need tune's own endpoint: a running "
                "endpoint's batching cannot be changed from here (drop --endpoint to search "
                "the grid, or restart that server with other batching and measure again)"
            )
        configs = [declared]
    else:
        wait_list = _numbers(waits, "--waits", 0) if waits is not None else None
        if w.task != "generate" and wait_list is None:
            wait_list = default_waits(w.batching.max_wait_ms)
        size_list = _counts(sizes, "--sizes") or default_sizes(w.batching.max_batch_size)
        prefills = parse_prefills(prefill) if prefill is not None else None
        if w.task == "generate" and prefills is None:
            prefills = default_prefills(w.batching.max_prefill_tokens)
        configs = grid(w, size_list, wait_list, prefills)
    levels = _counts(concurrency, "--concurrency")
    levels = levels or default_levels(max(c.max_batch_size for c in configs))
    # Past twice the target a curve has crossed the line: more clients only queue.
    plan = Plan(configs, levels, seconds, repeats, give_up_ms=2 * target)
    missing = plotting_missing()
    out = png or settings.home / "tune" / f"{workload}.png"
    if missing is None:
        with _writing(out, "--png", "or name another"):  # before minutes of load
            out.parent.mkdir(parents=True, exist_ok=True)
    where = f"the endpoint at {endpoint}" if endpoint else "an endpoint of its own"
    typer.echo(
        f"tuning {workload} on {where}: {len(configs)} configuration(s) x {len(levels)} "
        f"concurrencies x {repeats} slices of {seconds:g} s, about {plan.estimate_s():.0f} s "
        "(and the models' loading)",
        err=True,
    )

    with progress_bar() as progress:
        bar = progress.add_task("loading", total=plan.slices)

        def slice_done(config: Config, level: Level) -> None:
            p99_text = f"{level.p99_ms:.1f} ms" if level.p99_ms is not None else "-"
            progress.update(
                bar,
                advance=1,
                description=f"{config.short}, {clients(level.concurrency)}: "
                f"{level.items_per_second:.0f}/s, p99 {p99_text}",
            )

        total = plan.slices

        def skipped(config: Config, slices: int) -> None:
            nonlocal total
            total -= slices
            progress.update(bar, total=total)

        points = measure(spec, workload, settings, plan, endpoint, slice_done, skipped)
    best = best_point(points, target)
    source = "--p99" if p99 is not None else "slo.p99_ms" if w.slo.p99_ms else "default"
    _print_points(workload, points, target, source, best, declared)
    for config in configs:
        last = max((p for p in points if p.config == config), key=lambda p: p.concurrency)
        if last.concurrency < levels[-1]:
            why = (
                f"{last.errors} errors there"
                if last.errors
                else f"its p99 past twice the target ({2 * target:g} ms): more clients only queue"
            )
            typer.echo(
                f"{config.short}: stopped after {clients(last.concurrency)}, {why}", err=True
            )
    measured = sorted({p.concurrency for p in points})
    if missing is not None:
        typer.echo(missing, err=True)
    else:
        note = (
            f"closed loop at {', '.join(map(str, measured))} clients (xN beside each p99), "
            f"{repeats} x {seconds:g} s per point"
        )
        with _writing(out, "--png", "or name another"):
            save_chart(chart(workload, points, target, best, note), out)
        typer.echo(f"chart: {out}")
    if best is None:
        lowest = min(
            (p for p in points if p.p99_ms is not None), key=lambda p: p.p99_ms or 0.0, default=None
        )
        found = f"; the lowest was {lowest.p99_ms:.1f} ms" if lowest and lowest.p99_ms else ""
        raise LanesError(
            f"no point met the p99 target of {target:g} ms{found}: nothing to recommend "
            "(try smaller --sizes or --waits, fewer clients, or a looser --p99)"
        )
    if endpoint is not None:
        typer.echo(
            f"the endpoint sustains {best.items_per_second:.1f} items/s with "
            f"{clients(best.concurrency)} within p99 {target:g} ms"
        )
        return
    if write:
        with _writing(spec_path, "--write", "or paste the YAML a run without --write prints"):
            loaded = write_knobs(spec_path, workload, best.config, settings)
        typer.echo(f"wrote {best.config.label} into {spec_path} (workloads.{workload}.batching)")
        if best.config.applied(loaded) != loaded:
            typer.echo(
                "note: a LANES_WORKLOADS__ setting overrides the file: the workload still "
                "loads with "
                + ", ".join(f"{key} {getattr(loaded, key)}" for key in best.config.knobs()),
                err=True,
            )
        return
    typer.echo("paste into workloads.yaml (or run again with --write):")
    typer.echo(snippet(workload, best.config), nl=False)


def _writing(path: Path, option: str, otherwise: str) -> AbstractContextManager[None]:
    return writing(f"{option}: cannot write {path}", f"make its folder writable, {otherwise}")


def _print_points(
    name: str,
    points: list[Point],
    target: float,
    source: str,
    best: Point | None,
    declared: Config,
) -> None:
    from lanes.router.tune import clients

    table = Table(title=f"{name}: closed-loop load, p99 target {target:g} ms ({source})")
    waits = any(p.config.max_wait_ms is not None for p in points)
    prefills = any(p.config.max_prefill_tokens is not None for p in points)
    headers = [
        "max_batch_size",
        *(["max_wait_ms"] if waits else []),
        *(["max_prefill_tokens"] if prefills else []),
        "clients",
    ]
    for column in (*headers, "items/s", "p50 ms", "p99 ms", "errors", ""):
        table.add_column(column, justify="right")
    previous = None
    for p in points:
        knobs = [str(p.config.max_batch_size)]
        if waits:
            knobs.append(f"{p.config.max_wait_ms:g}" if p.config.max_wait_ms is not None else "-")
        if prefills:
            budget = p.config.max_prefill_tokens
            knobs.append(str(budget) if budget is not None else "whole")
        notes = ["best"] if p is best else []
        if p.config == previous:
            knobs = [""] * len(knobs)
        elif p.config == declared:
            notes.append("current")
        previous = p.config
        p99 = f"{p.p99_ms:.2f}" if p.p99_ms is not None else "-"
        if not p.meets(target):
            p99 = f"[red]{p99}[/red]"
        mark = ", ".join(notes)
        if p is best:
            mark = f"[bold green]{mark}[/bold green]"
        table.add_row(
            *knobs,
            str(p.concurrency),
            f"{p.items_per_second:.1f}",
            f"{p.p50_ms:.2f}" if p.p50_ms is not None else "-",
            p99,
            str(p.errors),
            mark,
        )
    Console(width=160).print(table)
    failed = [p for p in points if p.errors]
    if failed:
        typer.echo(
            f"{len(failed)} point(s) had errors (never chosen); the first: {failed[0].first_error}"
        )
    if best is None:
        return
    typer.echo(
        f"best: {best.config.label} at {clients(best.concurrency)}: "
        f"{best.items_per_second:.1f} items/s, p50 {best.p50_ms or 0:.2f} ms, p99 "
        f"{best.p99_ms or 0:.2f} ms"
    )
    mine = [p for p in points if p.config == declared and p.meets(target)]
    if mine and best.config != declared:
        top = max(mine, key=lambda p: p.items_per_second)
        typer.echo(
            f"current ({declared.label}): at best {top.items_per_second:.1f} items/s "
            f"within the target; the best makes {best.items_per_second / top.items_per_second:.2f}x that"
        )
