"""CLI twins of the SDK client: `lanes call`, `lanes stream`, `lanes submit`, `lanes job`.

They go through `lanes.Client` exactly as user code would: to the endpoint in
LANES_ENDPOINT for interactive workloads, to the Prefect API for jobs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from lanes.client import Client
from lanes.errors import InvalidInput
from router.render import to_jsonable

SpecOption = Annotated[Path | None, typer.Option("--file", "-f", help="workloads.yaml.")]
Endpoint = Annotated[str | None, typer.Option(help="Server URL (default: LANES_ENDPOINT).")]


def _json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidInput(f"{what}: expected JSON, found {text!r} ({e.msg})") from None


def call(
    workload: Annotated[str, typer.Argument(help="An interactive workload.")],
    input: Annotated[str, typer.Option("--input", "-i", help="The input as JSON.")],
    file: SpecOption = None,
    endpoint: Endpoint = None,
) -> Any:
    """Call an interactive workload on the running endpoint; prints the result as JSON."""
    with Client(endpoint, spec=file) as client:
        result = client.call(workload, _json(input, "--input"))
    typer.echo(json.dumps(to_jsonable(result)))


def stream(
    workload: Annotated[str, typer.Argument(help="An interactive generate workload.")],
    prompt: Annotated[str, typer.Argument(help="The prompt.")],
    max_tokens: Annotated[int | None, typer.Option(help="Most tokens to generate.")] = None,
    temperature: Annotated[float | None, typer.Option(help="0 is greedy.")] = None,
    file: SpecOption = None,
    endpoint: Endpoint = None,
) -> None:
    """Stream a completion to the terminal as it is generated."""
    options = {"max_tokens": max_tokens, "temperature": temperature}
    with Client(endpoint, spec=file) as client:
        for chunk in client.stream(
            workload, prompt, **{k: v for k, v in options.items() if v is not None}
        ):
            sys.stdout.write(chunk)
            sys.stdout.flush()
    sys.stdout.write("\n")


def submit(
    workload: Annotated[str, typer.Argument(help="An offline workload.")],
    records: Annotated[
        str, typer.Argument(help="A JSONL file of records, or an input URI (folder or s3://).")
    ],
    now: Annotated[
        bool, typer.Option(help="Run now instead of at the next off-peak window.")
    ] = False,
    file: SpecOption = None,
) -> None:
    """Submit records to an offline workload; prints the job id."""
    path = Path(records)
    source: Any = records
    if path.is_file():
        lines = path.read_text(encoding="utf-8").splitlines()
        source = [
            _json(line, f"{records} line {n}") for n, line in enumerate(lines, 1) if line.strip()
        ]
    with Client(spec=file) as client:
        job = client.submit(workload, source, when="now" if now else "offpeak")
    typer.echo(job.id)


def job(
    id: Annotated[str, typer.Argument(help="A job id from `lanes submit`.")],
    wait: Annotated[bool, typer.Option(help="Wait until the job ends.")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds to wait.")] = 3600,
    results: Annotated[bool, typer.Option(help="Print its output lines.")] = False,
    file: SpecOption = None,
) -> None:
    """Show a job's status (and wait for it, or print its results)."""
    with Client(spec=file) as client:
        handle = client.job(id)
        if wait:
            handle.wait(timeout)
        typer.echo(f"{handle.id} {handle.status()}")
        if results:
            for line in handle.results():
                typer.echo(json.dumps(line))
