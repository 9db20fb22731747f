"""CLI twins of the SDK client: `lanes call`, `lanes stream`, `lanes submit`, `lanes job`.

They go through `lanes.Client` exactly as user code would: to the endpoint in
LANES_ENDPOINT (with LANES_API_KEY) for interactive workloads, to the Prefect API in
PREFECT_API_URL for jobs. router.cli registers them; lanes' errors print as a
message and an exit code (router.console).
"""

from __future__ import annotations

import inspect
import json
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Literal

import typer

from lanes.client import Client
from lanes.errors import InvalidInput, WrongMode
from lanes.jobstates import COMPLETED_WITH_ERRORS, FAILED_STATES
from lanes.router.console import ExitCode
from lanes.router.render import to_jsonable
from lanes.spec import InteractiveWorkload, OfflineWorkload, a_task
from lanes.specfile import load_spec
from lanes.wire import SET_BY_CALL

SpecOption = Annotated[
    Path | None, typer.Option("--file", "-f", help="workloads.yaml (default: LANES_SPEC).")
]
Endpoint = Annotated[str | None, typer.Option(help="Server URL (default: LANES_ENDPOINT).")]


def _positive_ms(value: float | None) -> float | None:
    """--timeout-ms as the SDK takes timeout_ms, refused under the option's own name."""
    if value is not None and not 0 < value < math.inf:
        raise typer.BadParameter(f"expected a positive number of milliseconds, found {value}")
    return value


TimeoutMs = Annotated[
    float | None,
    typer.Option(
        "--timeout-ms", callback=_positive_ms, help="The request's deadline on the server."
    ),
]


def _check_command(
    name: str, workload: InteractiveWorkload | OfflineWorkload, command: str
) -> None:
    """Refuse a workload that `lanes COMMAND` does not take, naming the command that
    does (the SDK's WrongMode names its method, client.submit, a person here runs none)."""
    if workload.mode == "offline" and command != "submit":
        raise WrongMode(
            f"workload {name!r} is offline: submit its records with "
            f"`lanes submit {name} RECORDS` instead of {command}"
        )
    if workload.mode == "interactive" and command == "submit":
        streams = " (or `lanes stream`)" if workload.task == "generate" else ""
        raise WrongMode(
            f"workload {name!r} is interactive: use `lanes call {name} -i INPUT`{streams}, "
            "not submit"
        )
    if command == "stream" and workload.task != "generate":
        raise WrongMode(
            f"workload {name!r} is {a_task(workload.task)} workload: use "
            f"`lanes call {name} -i INPUT`, not stream"
        )


def _json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidInput(f"{what}: expected JSON, found {text!r} ({e.msg})") from None


def read_input(text: str) -> Any:
    """An `--input` as every command reads it: JSON when it parses as JSON; otherwise
    the text itself (`-i "hello world"`), unless it begins as JSON does (`{`, `[`, `"`):
    that is JSON gone wrong, an InvalidInput. NaN and Infinity are not JSON: the
    endpoint refuses them, and predict would print them back as no JSON at all."""

    def not_json(constant: str) -> None:
        raise json.JSONDecodeError(f"{constant} is not JSON", text, text.find(constant))

    try:
        return json.loads(text, parse_constant=not_json)
    except json.JSONDecodeError as e:
        if text.lstrip().startswith(("{", "[", '"')):
            raise InvalidInput(
                f"--input: expected JSON, found {text!r} ({e.msg}); to send a text "
                "that begins so, give it as a JSON string, e.g. '\"[x] y\"'"
            ) from None
        return text


def call(
    workload: Annotated[str, typer.Argument(help="An interactive workload.")],
    input: Annotated[
        str,
        typer.Option(
            "--input",
            "-i",
            help="The input as JSON (a plain text is taken as a string); generate: a "
            'prompt, or an object of it and the options: \'{"prompt": "...", "max_tokens": 3}\'.',
        ),
    ],
    timeout_ms: TimeoutMs = None,
    stream: Annotated[
        bool | None,
        typer.Option(
            "--stream/--no-stream",
            help="generate: print the text as it is made (default: the workload's `stream:`).",
        ),
    ] = None,
    file: SpecOption = None,
    endpoint: Endpoint = None,
) -> None:
    """Call an interactive workload on the running endpoint; prints the result as JSON
    (a generate workload that streams, or --stream: its text as it is made)."""
    value = read_input(input)
    options: dict[str, Any] = {}
    with Client(endpoint, spec=file) as client, _options_of_input("call"):
        declared = load_spec(file, check_files=False).workload(workload)
        _check_command(workload, declared, "call")
        generates = declared.task == "generate" and declared.mode == "interactive"
        if generates and isinstance(value, dict):
            value, options = _prompt_and_options(value)
        default = declared.stream if isinstance(declared, InteractiveWorkload) else False
        # A stream prints text alone: asked for logprobs, the default is the whole answer.
        default = default and "logprobs" not in options
        streams = default if stream is None else stream
        if streams and generates:
            _print_stream(client.stream(workload, value, timeout_ms=timeout_ms, **options))
            return
        result = client.call(workload, value, timeout_ms=timeout_ms, **options)
    typer.echo(json.dumps(to_jsonable(result)))


def _prompt_and_options(item: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """A generate input given as an object, as `lanes predict` takes it: its `prompt`
    (or chat `messages`) and the request's options (max_tokens, temperature, ...), for
    `Client.call(name, prompt, **options)`."""
    given = [key for key in ("prompt", "messages") if key in item]
    if len(given) != 1:
        raise InvalidInput(
            "--input: a generate workload's object needs one of 'prompt' or 'messages', "
            f"found {'both' if given else 'neither'}; pass a prompt text, or e.g. "
            '\'{"prompt": "def f(x):", "max_tokens": 3}\''
        )
    options = dict(item)
    prompt = options.pop(given[0])
    for key in options:
        if key in _INSTEAD:
            raise InvalidInput.field(
                "--input", f"{key!r} is not an option here; use {_INSTEAD[key]}"
            )
        if key in _sdk_arguments():
            raise InvalidInput.field("--input", f"{key!r} is not an option of the request")
    return prompt, options


# Fields of a generate --input that are no request options, and what sets them instead.
_INSTEAD = {
    "stream": "--stream/--no-stream",
    "model": "the WORKLOAD argument",
    "workload": "the WORKLOAD argument",
    "timeout_ms": "--timeout-ms",
    "input": "'prompt' or 'messages'",
}


def _sdk_arguments() -> set[str]:
    """The named parameters of `Client.call` and `Client.stream` (`self` too): a field of
    that name among their `**options` would be Python's TypeError, not an option."""
    methods = (Client.call, Client.stream)
    return {
        name
        for method in methods
        for name, parameter in inspect.signature(method).parameters.items()
        if parameter.kind is not parameter.VAR_KEYWORD
    }


@contextmanager
def _options_of_input(command: str) -> Iterator[None]:
    """The SDK's refusal of an option, said as a field of --input (the CLI passes no
    other options): the CLI's user wrote the object's fields, not a `call()`, and an
    option the SDK sets itself is one `lanes COMMAND` sets."""
    try:
        yield
    except InvalidInput as e:
        if e.code != "unknown_parameter" or e.param is None:
            raise
        if e.param in SET_BY_CALL:
            detail = f"lanes {command} sets {e.param!r} itself; leave it out"
            raise InvalidInput.field("--input", detail, e.code) from None
        raise e.at("--input") from None


def _print_stream(chunks: Iterator[str]) -> None:
    for chunk in chunks:
        sys.stdout.write(chunk)
        sys.stdout.flush()
    sys.stdout.write("\n")


def stream(
    workload: Annotated[str, typer.Argument(help="An interactive generate workload.")],
    prompt: Annotated[str, typer.Argument(help="The prompt.")],
    max_tokens: Annotated[int | None, typer.Option(help="Most tokens to generate.")] = None,
    temperature: Annotated[float | None, typer.Option(help="0 is greedy.")] = None,
    timeout_ms: TimeoutMs = None,
    file: SpecOption = None,
    endpoint: Endpoint = None,
) -> None:
    """Stream a completion to the terminal as it is generated."""
    options = {"max_tokens": max_tokens, "temperature": temperature}
    chosen = {k: v for k, v in options.items() if v is not None}
    _check_command(workload, load_spec(file, check_files=False).workload(workload), "stream")
    with Client(endpoint, spec=file) as client:
        _print_stream(client.stream(workload, prompt, timeout_ms=timeout_ms, **chosen))


def submit(
    workload: Annotated[str, typer.Argument(help="An offline workload.")],
    records: Annotated[
        str,
        typer.Argument(help="A .jsonl file of records (staged), or an input URI (folder, s3://)."),
    ],
    when: Annotated[
        str, typer.Option(help="offpeak: the workload's next window; now: at once.")
    ] = "offpeak",
    now: Annotated[bool, typer.Option("--now", help="Short for --when now.")] = False,
    file: SpecOption = None,
) -> None:
    """Submit records to an offline workload. Prints the job id (stdout) and when it
    runs (stderr)."""
    chosen: Literal["offpeak", "now"] = "now" if now else _when(when)
    _check_command(workload, load_spec(file, check_files=False).workload(workload), "submit")
    path = Path(records)
    source: Any = records
    if path.is_file() and path.name.endswith(".jsonl"):
        lines = path.read_text(encoding="utf-8").splitlines()
        source = [
            _json(line, f"{records} line {n}") for n, line in enumerate(lines, 1) if line.strip()
        ]
    with Client(spec=file) as client:
        try:
            job = client.submit(workload, source, when=chosen)
        except InvalidInput as e:
            # A path not here may be the workers' (a shared mount): said only when refused.
            if "://" in records or path.exists() or any(c in records for c in "*?["):
                raise
            raise InvalidInput(
                f"{records}: no such file here, nor an input the workers read ({e})"
            ) from None
        scheduled = job.scheduled_time()
    typer.echo(job.id)
    at = scheduled.isoformat() if scheduled else "unknown"
    typer.echo(f"job {job.id}: {workload}, scheduled for {at}", err=True)


def job(
    id: Annotated[
        str | None,
        typer.Argument(help="A job id from `lanes submit`, or a batch id; none: list them."),
    ] = None,
    wait: Annotated[bool, typer.Option(help="Wait until the job ends.")] = False,
    timeout: Annotated[float, typer.Option(min=0, help="Seconds to wait at most.")] = 3600,
    results: Annotated[
        bool, typer.Option(help="Print its results as JSON lines (the status goes to stderr).")
    ] = False,
) -> None:
    """Without ID, list the newest jobs and Batch API batches (`ID KIND STATUS
    SCHEDULED NAME`). Show a job's status (`ID STATUS`); wait for it to end, print its results. With
    --wait, exits 0 when every record was answered, 3 when some were rejected, 1 when
    the job failed, 4 when it is still running after --timeout."""
    with Client() as client:
        if id is None:
            for found in client.jobs():
                at = found.scheduled.isoformat() if found.scheduled else "-"
                typer.echo(f"{found.id}  {found.kind}  {found.status}  {at}  {found.name}")
            return
        handle = client.job(id)
        if wait:
            try:
                handle.wait(timeout)
            except TimeoutError as e:
                typer.echo(f"error: {e}", err=True)
                raise typer.Exit(ExitCode.TIMED_OUT) from None
        status = handle.status()
        typer.echo(f"{handle.id} {status}", err=results)
        if status == COMPLETED_WITH_ERRORS or status in FAILED_STATES:
            message = handle.message()  # how it ended: the counts, or why it failed
            if message:
                typer.echo(f"{handle.id}: {message}", err=True)
        if results:
            for line in handle.results():
                typer.echo(json.dumps(to_jsonable(line)))
    if wait and status == COMPLETED_WITH_ERRORS:
        raise typer.Exit(ExitCode.RECORD_ERRORS)


def _when(value: str) -> Literal["offpeak", "now"]:
    if value == "offpeak":
        return "offpeak"
    if value == "now":
        return "now"
    raise InvalidInput(f'--when: expected "offpeak" or "now", found {value!r}')
