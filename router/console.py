"""How the CLI reports lanes' own errors: a message a person can act on, no traceback;
and what its exit codes mean."""

from __future__ import annotations

import enum
import functools
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from lanes.errors import (
    InvalidInput,
    LanesError,
    NotFound,
    SpecError,
    StorageError,
    UnknownWorkload,
    WrongMode,
)

T = TypeVar("T")

SpecFile = Annotated[
    Path | None,
    typer.Argument(help="workloads.yaml to use (default: LANES_SPEC or ./workloads.yaml)."),
]


class ExitCode(enum.IntEnum):
    """Every command's exit status (the README's CLI section lists them)."""

    OK = 0
    FAILED = 1  # a job or run failed, or anything else lanes could not do
    BAD_INPUT = 2  # a bad spec, argument or input: fix it and run again
    RECORD_ERRORS = 3  # a job or run finished, but rejected some records
    TIMED_OUT = 4  # `lanes job --wait`: still running when --timeout ran out


# The extra of lanes (pyproject.toml) that brings each package a lane imports, for the
# message when an install lacks it.
EXTRA_OF = {
    "starlette": "serve",
    "uvicorn": "serve",
    "prometheus_client": "serve",
    "prefect": "offline",
    "prefect_dask": "offline",
    "dask": "offline",
    "distributed": "offline",
    "boto3": "offline",
    "botocore": "offline",
    "pyarrow": "offline",
    "onnxruntime": "runtime",
    "tokenizers": "runtime",
    "torch": "build",
    "matplotlib": "plot",
}


def guarded(fn: Callable[[], T]) -> T:
    """Run `fn`; a LanesError becomes a message on stderr and an exit code: 2 for a bad
    spec or input, 1 for anything else that failed; so does a package of a lane that
    this install lacks (the message names the extra to install)."""
    # Plain prints, not rich: one problem per line, never wrapped, so editors and
    # grep can jump to FILE:LINE:COL.
    try:
        return fn()
    except SpecError as e:
        for problem in e.problems:
            print(problem, file=sys.stderr)
        n = len(e.problems)
        print(f"{n} problem{'s' if n != 1 else ''} found", file=sys.stderr)
        raise typer.Exit(ExitCode.BAD_INPUT) from None
    except (InvalidInput, UnknownWorkload, NotFound, WrongMode) as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(ExitCode.BAD_INPUT) from None
    except LanesError as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(ExitCode.FAILED) from None
    except ModuleNotFoundError as e:
        extra = EXTRA_OF.get((e.name or "").split(".")[0])
        if extra is None:
            raise
        print(
            f"error: this command needs lanes[{extra}], which this install lacks (no module "
            f"named {e.name!r}): pip install 'lanes[{extra}]'",
            file=sys.stderr,
        )
        raise typer.Exit(ExitCode.FAILED) from None


def command(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` with lanes' errors reported as `guarded` does; typer still sees its signature."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return guarded(lambda: fn(*args, **kwargs))

    return wrapper


class _Untraced(logging.Filter):
    """Drops the traceback from a record whose exception is a LanesError."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], LanesError):
            record.exc_info = None
            record.exc_text = None
        return True


@contextmanager
def lanes_errors_untraced() -> Iterator[None]:
    """While the block runs, Prefect logs a flow or task run that failed with a
    LanesError by its message alone: Prefect adds the traceback to every failure, but
    a LanesError's message is the whole story (what failed, where, what to do)."""
    loggers = [logging.getLogger(name) for name in ("prefect.flow_runs", "prefect.task_runs")]
    untraced = _Untraced()
    for logger in loggers:
        logger.addFilter(untraced)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(untraced)


@contextmanager
def writing(what: str, fix: str) -> Iterator[None]:
    """An OSError in the block as one StorageError line: "`what` (why): `fix`"; a
    command says it before minutes of work, not as a traceback after them."""
    try:
        yield
    except OSError as e:
        # mkdir(exist_ok=True) says "File exists" of a file where the folder would be.
        reason = "its folder is a file" if isinstance(e, FileExistsError) else e.strerror or e
        raise StorageError(f"{what} ({reason}): {fix}") from None


@contextmanager
def progress_bar() -> Iterator[Progress]:
    """A rich progress display on stderr (stdout keeps the tables), for long commands."""
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
    )
    with progress:
        yield progress
