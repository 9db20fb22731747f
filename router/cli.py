"""The `lanes` command line: validate, plan, predict, models build (and more as the router grows).

Each command builds `Settings` once and passes it down. A `LanesError` is printed as a
message a person can act on, without a traceback: exit code 2 for a bad spec or input,
1 for anything else that failed.
"""

from __future__ import annotations

import contextlib
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from lanes.demo.place import demo_models_folder
from lanes.digests import Digests, model_digests
from lanes.errors import InvalidInput, LanesError, ModelError
from lanes.measurements import Measurements
from lanes.router import client_cli, cost_cli, offline_cli, tune_cli
from lanes.router.console import SpecFile, command, guarded, writing
from lanes.router.plan import plan as make_plan
from lanes.router.render import to_jsonable
from lanes.router.render_cli import render_app
from lanes.settings import Settings
from lanes.spec import Spec
from lanes.specfile import load_spec

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="lanes: serve models interactive or offline from one workloads.yaml.",
)
models_app = typer.Typer(
    no_args_is_help=True, help="The models: build the demo's, seal the spec's digests."
)
app.add_typer(models_app, name="models")
app.add_typer(render_app, name="render")


def _load(file: Path | None, settings: Settings, check_models: bool = False) -> Spec:
    return load_spec(file, settings, check_models=check_models)


@app.command()
def validate(file: SpecFile = None) -> None:
    """Check a workloads.yaml: every problem is printed as FILE:LINE:COL: field: message.
    An embed workload's model is checked for inputs the task cannot feed, from its graph
    (its weights are not loaded), as `lanes serve` would refuse it; each tokenizer is loaded."""
    settings = guarded(Settings)
    spec = guarded(lambda: _load(file, settings, check_models=True))
    n = len(spec.workloads)
    typer.echo(f"{file or settings.spec}: ok ({n} workload{'s' if n != 1 else ''})")


@app.command()
def plan(
    file: SpecFile = None,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Print the plan as JSON. A deadline's expected_finish is the estimate "
            "without the 25% margin, on_time whether it is by finish_by; fits whether "
            "the run with the margin fits in the window (false: it starts now).",
        ),
    ] = False,
    at: Annotated[
        str | None,
        typer.Option(
            "--at",
            help="Plan as of this ISO time (e.g. 2030-01-01T21:00+00:00; no offset: UTC) "
            "instead of now: next runs and deadline starts.",
        ),
    ] = None,
) -> None:
    """Show where each workload goes: endpoint paths, or a Prefect deployment and its next
    run (with `schedule.finish_by`: its planned start and expected finish, and why); and
    $ per 1k items in its own lane and in the other, from the newest measurement
    (`lanes calibrate`, an offline run's manifest)."""
    settings = guarded(Settings)
    spec = guarded(lambda: _load(file, settings))
    measurements = Measurements(settings.home).load()
    now = guarded(lambda: _moment(at)) if at is not None else None
    routes = make_plan(spec, settings, now, measurements=measurements, calibrate=True)
    if as_json:
        typer.echo(json.dumps([r.as_json() for r in routes], indent=2))
        return
    table = Table(title="lanes plan")
    for column in ("workload", "mode", "task", "model", "goes to", "batching"):
        table.add_column(column)
    for r in routes:
        if r.mode == "interactive":
            where = "\n".join(r.endpoints)
        else:
            default = " (default off-peak)" if r.schedule_is_default else ""
            where = f"deployment {r.deployment}\n{r.schedule}{default}\nnext run {r.next_run}"
            if r.deadline is not None and r.deadline.get("start"):
                finish = r.deadline["expected_finish"] or "unknown (no rate)"
                where += (
                    f"\nfinish by {r.deadline['finish_by']}\nstart {r.deadline['start']}"
                    f"\nexpected finish {finish}"
                )
        batching = ", ".join(f"{k}={v}" for k, v in r.batching.items())
        table.add_row(r.workload, r.mode, r.task, r.model, where, batching)
    Console(width=160).print(table)
    for r in routes:
        if r.deadline is not None:
            typer.echo(f"{r.workload}: {r.deadline['note']}")
    cost_cli.print_costs(routes, settings)


def _moment(text: str) -> datetime:
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise InvalidInput.field(
            "--at", f"expected an ISO time like 2030-01-01T21:00+00:00, found {text!r}"
        ) from None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


@app.command()
def predict(
    workload: Annotated[str, typer.Argument(help="Workload name.")],
    input: Annotated[
        str,
        typer.Option(
            "--input", "-i", help="One request as JSON (a plain text is taken as a string)."
        ),
    ],
    file: Annotated[Path | None, typer.Option("--file", "-f", help="workloads.yaml.")] = None,
) -> None:
    """Run one request in-process (any mode), for debugging: no server, no Prefect."""
    from lanes.runtime import Runtime
    from lanes.tasks import load_task

    settings = guarded(Settings)

    def run() -> Any:
        spec = _load(file, settings)
        spec.workload(workload)
        item = client_cli.read_input(input)  # as `lanes call` reads it
        task = load_task(workload, spec, Runtime(settings))
        prepared = task.prepare(item)
        try:
            return task.run([prepared])[0]
        except LanesError:
            raise
        except Exception as err:  # onnxruntime raises its own pybind classes
            # The serving lane answers this as a 500; here it is one line, as ours are.
            raise ModelError(
                f"workload {workload!r}: model {spec.workload(workload).model!r} failed on "
                f"this input: {err}"
            ) from err

    typer.echo(json.dumps(to_jsonable(guarded(run))))


@app.command()
def serve(
    file: SpecFile = None,
    host: Annotated[str | None, typer.Option(help="Address (default: LANES_HOST).")] = None,
    port: Annotated[
        int | None, typer.Option(min=0, max=65535, help="Port (default: LANES_PORT).")
    ] = None,
) -> None:
    """Serve every interactive workload on one HTTP endpoint (OpenAI and Open Inference v2)."""
    settings = guarded(Settings)
    spec = guarded(lambda: _load(file, settings))

    def start() -> None:
        from lanes.serving.server import serve as run_server

        run_server(spec, settings, host, port)

    guarded(start)


@app.command()
def top(
    endpoint: Annotated[
        str | None, typer.Option(help="Server URL (default: LANES_ENDPOINT).")
    ] = None,
    once: Annotated[
        bool, typer.Option("--once", help="Print one frame (one interval's window) and exit.")
    ] = False,
    interval: Annotated[
        float, typer.Option(min=0.1, help="Seconds between frames (the window of each).")
    ] = 1.0,
) -> None:
    """A live view of a running server from its /metrics: per workload req/s, p50/p99,
    queue depth, batch size, utilization, tokens/s, errors/s (its 5xx answers);
    responses per route."""
    from lanes.router.top import run as run_top

    settings = guarded(Settings)
    key = settings.api_key.get_secret_value() if settings.api_key else None
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how a live view ends
        guarded(lambda: run_top(endpoint or settings.endpoint, key, interval, once))


@models_app.command("build")
def models_build(
    dest: Annotated[
        Path | None,
        typer.Option(help="Folder (default: where the spec names them; see LANES_SPEC)."),
    ] = None,
    force: Annotated[bool, typer.Option(help="Rebuild models that already exist.")] = False,
) -> None:
    """Build the demo models (minilm, tinycode, classifier) where the spec expects them
    (lanes.demo.place); skips those already built."""
    settings = guarded(Settings)
    folder = dest or guarded(lambda: demo_models_folder(settings))
    try:
        from lanes.demo.build import build_demo_models
    except ImportError as e:
        typer.echo(
            f"error: building models needs torch: pip install 'lanes[build]' ({e})", err=True
        )
        raise typer.Exit(1) from None

    def build() -> list[Path]:
        fix = "make it writable, or pass --dest a folder that is"
        with writing(f"cannot write the demo models into {folder}", fix):
            return build_demo_models(folder, force=force)

    for path in guarded(build):
        typer.echo(str(path))


@models_app.command("seal")
def models_seal(file: SpecFile = None) -> None:
    """Write each file's content digest beside it (NAME.lanes-digest), for every file the
    spec's models read, so that a fresh pod (a Kubernetes Job, a serving replica) reads
    the digest instead of hashing the model on each start. Run it where the models are
    prepared (the baked image runs it at build time); a seal is trusted only while its
    file keeps the size and mtime it was sealed with, so copy the models with their
    times (cp -p, rsync -a, tar) or seal them again where they land."""
    settings = guarded(Settings)
    spec = guarded(lambda: _load(file, settings))
    digests = Digests(settings.home, seal=True)
    for name, model in spec.models.items():
        try:
            files = model_digests(model, digests)
        except OSError as e:
            typer.echo(
                f"error: models.{name}: cannot write a seal beside its files ({e}); "
                "seal them where they are writable, then copy them with their times",
                err=True,
            )
            raise typer.Exit(1) from None
        missing = [role for role, d in files.items() if d is None]
        if missing:
            typer.echo(
                f"error: models.{name}: {', '.join(missing)} not readable at "
                f"{model.path.parent}: seal where the models are",
                err=True,
            )
            raise typer.Exit(1)
        typer.echo(f"models.{name}: sealed {len(files)} file{'s' if len(files) != 1 else ''}")


for module, names in (
    (offline_cli, ("compile", "deploy", "run")),
    (client_cli, ("call", "stream", "submit", "job")),
    (cost_cli, ("calibrate",)),
    (tune_cli, ("tune",)),
):
    for name in names:
        app.command(name)(command(getattr(module, name)))


def main() -> None:
    app(prog_name="lanes")


if __name__ == "__main__":
    main()
