"""The value types workloads.yaml's fields take: strict numbers, bounded durations,
paths, input and output locations, handler references and stop strings.

Apart from the models (lanes.spec and the sections of each mode, lanes.specinteractive
and lanes.specoffline) because every section's fields are built from them: each
constraint is stated once, and a value is refused alike wherever it appears.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, Field, Strict

from lanes.errors import shown

HANDLER_PATTERN = r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$"

# What a file system takes (Linux: PATH_MAX, NAME_MAX), checked on the text alone so a
# bad value is a spec problem, not an OSError from the first stat().
MAX_PATH_CHARS = 4096
MAX_NAME_BYTES = 255


def _path_text(value: str) -> str:
    if "\0" in value:
        raise ValueError("expected a path, found one holding a NUL character")
    if len(value) > MAX_PATH_CHARS:
        raise ValueError(
            f"expected a path of at most {MAX_PATH_CHARS} characters, found {len(value)}"
        )
    if "://" not in value:  # a local path: each name must fit the file system
        for part in value.split("/"):
            if len(part.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
                raise ValueError(
                    f"expected a path whose every name is at most {MAX_NAME_BYTES} bytes, "
                    f"found one of {len(part.encode('utf-8', 'surrogatepass'))}"
                )
    return value


def _location(value: str) -> str:
    """A folder or glob, file:// or s3://bucket/prefix/: what lanes.storage reads, so that
    a mistyped URI fails at load, not at the first run (or as a local folder "s3:")."""
    scheme, sep, rest = value.partition("://")
    if sep and scheme == "s3" and not rest.split("/", 1)[0]:
        raise ValueError(f"expected s3://bucket/prefix/, found {shown(value)} (no bucket)")
    # s3:/bucket/ is a mistyped URI, not a local folder named "s3:".
    read = scheme in ("s3", "file") if sep else not value.lower().startswith("s3:")
    if not read:
        raise ValueError(f"expected a folder, a glob or s3://bucket/prefix/, found {shown(value)}")
    return value


def matching(pattern: str, expected: str) -> Callable[[str], str]:
    """A check that text matches `pattern` whose failure says `expected` in words: a
    user fixing workloads.yaml reads "module:attribute", not the regular expression."""
    compiled = re.compile(pattern)

    def check(value: str) -> str:
        if not compiled.match(value):
            shown = value if len(value) <= 40 else value[:37] + "..."
            raise ValueError(f"expected {expected}, found {shown!r}")
        return value

    return check


def _local_path(value: Path) -> Path:
    _path_text(str(value))
    return value


# Numbers as YAML writes them. Pydantic's lax mode would read `batch_size: true` as 1,
# "8" as 8 and 2.0 as 2: an integer field takes an integer alone, a number field an
# integer or a decimal, never a boolean or a string (the message says which was found).
Integer = Annotated[int, Strict()]
Number = Annotated[float, Strict()]
PositiveInt = Annotated[Integer, Field(gt=0)]
NonNegativeFloat = Annotated[Number, Field(ge=0)]
NonNegativeInt = Annotated[Integer, Field(ge=0)]
PositiveFloat = Annotated[Number, Field(gt=0)]
# A duration in milliseconds: up to a day.
Milliseconds = Annotated[Number, Field(gt=0, le=86_400_000)]
IdleSeconds = Annotated[Number, Field(gt=0, le=30 * 86_400)]  # at most 30 days
LocalPath = Annotated[Path, AfterValidator(_local_path)]
Location = Annotated[
    str, Field(min_length=1), AfterValidator(_path_text), AfterValidator(_location)
]
HandlerRef = Annotated[
    str,
    Field(max_length=200),
    AfterValidator(matching(HANDLER_PATTERN, "module:attribute, e.g. mypkg.hooks:handler")),
]
# Each stop string is looked for at every token of its sequence, and the text that
# could start one is held back; the work per token grows with each string's length
# (at 16 strings of 256 characters, about a millisecond in the worst case, a text
# made to match their starts; at 16384, 0.2 s). Delimiters are a few characters.
MAX_STOP_CHARS = 256
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
