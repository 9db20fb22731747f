"""The router's offline half: `lanes compile`, `lanes deploy`, `lanes run`.

Plain typer-compatible functions; router.cli registers them as commands. Each builds
`Settings` once and passes it down; lanes' own errors print as a message, not a
traceback (router.console's `guarded`).
"""

from __future__ import annotations

import logging
import os
import shlex
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, TypeVar

import httpx
import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from lanes.batches import BATCH_DEPLOYMENT
from lanes.errors import InvalidInput, LanesError
from lanes.layout import ERRORS
from lanes.measurements import cost_basis_of
from lanes.router.console import ExitCode, guarded
from lanes.router.console import lanes_errors_untraced as untraced
from lanes.settings import Settings
from lanes.specfile import load_spec
from lanes.uris import join

T = TypeVar("T")

SpecFile = Annotated[
    Path | None,
    typer.Argument(help="workloads.yaml to use (default: LANES_SPEC or ./workloads.yaml)."),
]
SpecOption = Annotated[
    Path | None, typer.Option("--file", "-f", help="workloads.yaml (default: LANES_SPEC).")
]
# An embedded Prefect server starts in 9-15 s on a small machine, but took over 90 s on
# one core shared with other work; Prefect waits 20 s. A slow start is only a wait, a
# timeout fails the run: wait long.
EPHEMERAL_STARTUP_S = 300
PREFECT_HEALTH_TIMEOUT_S = 10


def _guarded(fn: Callable[[], T]) -> T:
    return guarded(fn)


OutputFile = Annotated[
    Path | None,
    typer.Option("--output", "-o", help="prefect.yaml to write (default: beside the spec)."),
]
ProjectDir = Annotated[
    Path | None,
    typer.Option(
        "--project-dir",
        help="The folder workers run in (default: the spec's); e.g. /app in an image, "
        "where the folder prefect.yaml goes to is found.",
    ),
]
Force = Annotated[
    bool, typer.Option("--force", help="Replace a prefect.yaml that lanes did not write.")
]


def compile(
    file: SpecFile = None,
    output: OutputFile = None,
    project_dir: ProjectDir = None,
    force: Force = False,
) -> None:
    """Write prefect.yaml: one Prefect deployment per offline workload."""
    from lanes.flows.compile import POOL_TYPE, deployment_names, write_prefect_yaml

    settings = Settings()
    spec_file = file or settings.spec

    def go() -> tuple[Path, list[str]]:
        spec = load_spec(spec_file, settings)
        path = write_prefect_yaml(spec, settings, spec_file, output, project_dir, force)
        return path, deployment_names(spec)

    path, names = _guarded(go)
    listed = ", ".join(names) or "none"
    typer.echo(f"{path}: {len(names)} deployment(s) ({listed})")
    pool = settings.work_pool
    prefect_file = (
        "" if path.name == "prefect.yaml" else f" --prefect-file {shlex.quote(path.name)}"
    )
    # The same options, or `lanes deploy` would compile another prefect.yaml (one whose
    # runs start in this machine's folder, where --project-dir named an image's).
    same = [str(file)] if file is not None else []
    same += ["--output", str(output)] if output is not None else []
    same += ["--project-dir", str(project_dir)] if project_dir is not None else []
    typer.echo(
        f"register them: {shlex.join(['lanes', 'deploy', *same])}, or in {path.parent}: "
        f"prefect --no-prompt deploy "
        f"--all{prefect_file} (work pool {pool!r} must exist: "
        f"prefect work-pool create {shlex.quote(pool)} --type {POOL_TYPE})"
    )


def deploy(
    file: SpecFile = None,
    output: OutputFile = None,
    project_dir: ProjectDir = None,
    force: Force = False,
) -> None:
    """Compile, create the work pool if missing, register every offline workload on
    the Prefect server in PREFECT_API_URL, and remove the deployments of workloads
    the spec no longer has."""
    from lanes.router.deploy import deploy as deploy_all
    from lanes.router.plan import plan

    settings = Settings()
    spec_file = file or settings.spec

    def go() -> Any:
        spec = load_spec(spec_file, settings)
        return spec, deploy_all(spec, spec_file, settings, output, project_dir, force)

    spec, done = _guarded(go)
    pool = f"work pool {done.pool!r} ({'created' if done.pool_created else 'exists'})"
    typer.echo(f"{done.prefect_yaml}: {len(done.deployments)} deployment(s) in {pool}")
    for route in plan(spec, settings):
        if route.deployment in done.deployments:
            typer.echo(f"  {route.deployment}  {route.schedule}  next run {route.next_run}")
    for name in done.deployments:
        if name.endswith(f"/{BATCH_DEPLOYMENT}"):
            typer.echo(f"  {name}  the Batch API's batches (lanes serve's /v1/batches)")
    for name in done.removed:
        typer.echo(f"  {name}  removed: no longer in {spec_file}")
    for replanned in done.replanned:
        due = replanned.due.isoformat(timespec="seconds") if replanned.due else "unknown"
        then = (
            f"flow run {replanned.replacement} plans it again now"
            if replanned.replacement
            else "no finish_by now: its cron runs it next"
        )
        typer.echo(
            f"  {replanned.deployment}  deferred run {replanned.run} (due {due}) removed: {then}"
        )
    for found in done.shadowed:
        typer.echo(
            f"warning: {found.name}={found.here} here replaces the work pool's "
            f"{found.name}={found.pool} in every flow run of these deployments (their "
            f"job variables win over the pool's env): unset {found.name} where you "
            "deploy to keep the pool's, or set it to the pool's value",
            err=True,
        )
    typer.echo(f"run them: prefect worker start --pool {done.pool}")


def run(
    workload: Annotated[str, typer.Argument(help="An offline workload's name.")],
    input: Annotated[
        str | None, typer.Option("--input", "-i", help="Input folder, glob or s3:// URI.")
    ] = None,
    output: Annotated[
        str | None, typer.Option("--output", "-o", help="Output folder or s3:// URI.")
    ] = None,
    retry_errors: Annotated[
        bool,
        typer.Option("--retry-errors", help="Also rerun the rejected records of committed shards."),
    ] = False,
    force: Annotated[
        bool, typer.Option("--force", help="Ignore the commits: rerun every shard whole.")
    ] = False,
    file: SpecOption = None,
) -> None:
    """Run an offline workload now, on an embedded Prefect (no server needed), or on
    the server in PREFECT_API_URL when one is set. Committed shards are skipped.
    Exits 0 when every record was answered, 3 when some were rejected, 1 when the run
    failed, 2 for a bad spec or argument."""
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS as STARTUP
    from prefect.settings import temporary_settings

    from lanes.flows.batch import Rerun, offline
    from lanes.flows.embedded import start_embedded_server
    from lanes.flows.job import plan_job

    settings = Settings()
    spec_file = file or settings.spec
    startup = max(STARTUP.value(), EPHEMERAL_STARTUP_S)
    if retry_errors and force:
        _guarded(_both_reruns)
    rerun: Rerun = "all" if force else "errors" if retry_errors else "uncommitted"

    # The embedded server would try to send Prefect telemetry from a machine that may
    # have no way out, and log each failure as an error (the user's choice stands).
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

    def go() -> dict[str, Any]:
        # The spec, the workload and its input and output, checked here first: a typo is
        # one line at once, not an embedded Prefect started (or a failed flow run left
        # on the server) to say it.
        plan_job(workload, spec_file, settings, input, output)
        _check_prefect_api()
        start_embedded_server(startup)
        with temporary_settings(updates={STARTUP: startup}), _progress_bar(), untraced():
            try:
                result: dict[str, Any] = offline(
                    workload=workload, spec=str(spec_file), input=input, output=output, rerun=rerun
                )
            except RuntimeError as err:  # Prefect's client: "Failed to reach API at ..."
                if isinstance(err.__cause__, httpx.TransportError):
                    raise _unreachable(err.__cause__) from None
                raise
            return result

    summary = _guarded(go)
    _print_summary(summary)
    if summary["total_errors"]:
        errors = join(summary["output"], ERRORS)
        n = summary["total_errors"]
        rejected = "1 record was" if n == 1 else f"{n} records were"
        typer.echo(
            f"{rejected} rejected: they are in {errors}; "
            "fix them (or the workload) and rerun them: this command with --retry-errors",
            err=True,
        )
        raise typer.Exit(ExitCode.RECORD_ERRORS)


def _check_prefect_api() -> None:
    """With PREFECT_API_URL set, the run is that server's: one that does not answer is
    one line at once, not a traceback from deep in Prefect's client."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        return  # an embedded Prefect starts with the run
    try:
        httpx.get(f"{str(url).rstrip('/')}/health", timeout=PREFECT_HEALTH_TIMEOUT_S)
    except httpx.TransportError as err:
        raise _unreachable(err) from None


def _unreachable(err: httpx.TransportError) -> LanesError:
    from prefect.settings import PREFECT_API_URL

    return LanesError(
        f"cannot reach the Prefect API at {PREFECT_API_URL.value()} ({type(err).__name__}: "
        f"{err}): start that server (prefect server start), or unset PREFECT_API_URL to "
        "run on an embedded Prefect"
    )


def _both_reruns() -> None:
    raise InvalidInput(
        "--force reruns every record, --retry-errors only the rejected ones: choose one"
    )


@contextmanager
def _progress_bar() -> Iterator[None]:
    """A bar over the run's shards, fed by its progress events (flows.progress)."""
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[records]} records"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
    )
    handler = _ProgressHandler(progress)
    watched = logging.getLogger("lanes.flows.progress")
    level, propagate = watched.level, watched.propagate
    watched.addHandler(handler)
    # Debug events for the bar only, not for Prefect's console handler.
    watched.setLevel(logging.DEBUG)
    watched.propagate = False
    try:
        with progress:
            yield
    finally:
        watched.removeHandler(handler)
        watched.setLevel(level)
        watched.propagate = propagate


class _ProgressHandler(logging.Handler):
    def __init__(self, progress: Progress) -> None:
        super().__init__(logging.DEBUG)
        self.progress = progress
        self.records = 0
        self.counted: dict[str, int] = {}  # per running shard, from its records events
        self.bar = progress.add_task("planning", total=None, records=0)

    def emit(self, record: logging.LogRecord) -> None:
        event: str | None = getattr(record, "lanes_event", None)
        fields: dict[str, Any] = getattr(record, "lanes", {})
        if event == "planned":
            description = f"shards ({fields['shards'] - fields['pending']} already committed)"
            self.progress.update(self.bar, total=fields["pending"], description=description)
        elif event == "records":  # only where the shard runs in this process
            shard, records = str(fields["shard"]), int(fields["records"])
            self.counted[shard] = self.counted.get(shard, 0) + records
            self.records += records
            self.progress.update(self.bar, records=self.records)
        elif event == "shard":  # from the flow, for every runner
            seen = self.counted.pop(str(fields["shard"]), 0)
            self.records += max(0, int(fields["records"]) - seen)
            self.progress.update(self.bar, advance=1, records=self.records)


def _interactive_cost(summary: dict[str, Any]) -> str:
    """What the run's items would have cost in the interactive lane."""
    if summary.get("interactive_cost_estimate") is None:
        return f"not measured: run lanes calibrate {summary['workload']}"
    return (
        f"${summary['interactive_cost_estimate']:.4f} at "
        f"{summary['interactive_items_per_second']} items/s ({summary['interactive_measured']})"
    )


def _print_summary(summary: dict[str, Any]) -> None:
    table = Table(title=f"lanes run {summary['workload']}", show_header=False)
    rows = [
        ("input", summary["input"]),
        ("output", summary["output"]),
        ("shards", f"{summary['shards_run']} run, {summary['shards_skipped']} already done"),
        ("records", f"{summary['outputs']} outputs, {summary['errors']} errors"),
        ("all shards", f"{summary['total_outputs']} outputs, {summary['total_errors']} errors"),
        ("throughput", f"{summary['items_per_second']} items/s"),
        ("wall time", f"{summary['wall_seconds']} s"),
        ("provider", summary["provider"]),
        (
            "cost estimate",
            f"${summary['cost_estimate']:.4f} ({summary['device_hours']:.4f} device-hours "
            f"at ${summary['price_per_device_hour']}/h, on {cost_basis_of(summary)})",
        ),
        ("on the endpoint", _interactive_cost(summary)),
    ]
    if summary["shards_retried"]:
        retried = f"{summary['retried']} records, {summary['recovered']} answered now"
        rows.insert(4, ("retried", retried))
    for key, value in rows:
        table.add_row(key, str(value))
    Console(width=160).print(table)
