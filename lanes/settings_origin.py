"""Which LANES_ variable set a setting: the source a settings error names, and the
variable a spec override came from (lanes.specfile).

A nested setting may come in its own variable or inside a parent's JSON; these find
the one to fix. Apart from lanes.settings because they read the environment only at
error time, after pydantic-settings has read it, and the spec's overrides need them
without the settings' fields.
"""

from __future__ import annotations

import os
from typing import Any


def problem_source(
    loc: tuple[str | int, ...], given: dict[str, Any]
) -> tuple[str, tuple[str | int, ...]]:
    """Where the value at `loc` came from, as a Problem's source: the LANES_ variable
    that set it (`variable_of`), or the default where no variable and no argument of
    Settings() set it (the default off-peak time zone on a system that loads none)."""
    variable, inside = variable_of(loc)
    keys = tuple(str(part) for part in loc[: len(loc) - len(_in_value(loc))])
    if keys and keys[0] not in given and not _is_set(keys):
        return f"default ({variable.removeprefix('env ')} not set)", inside
    return variable, inside


def _is_set(keys: tuple[str, ...]) -> bool:
    """Whether a LANES_ variable sets the setting at `keys` (its own or a parent's)."""
    present = {name.upper() for name in os.environ}
    names = ("LANES_" + "__".join(key.upper() for key in keys[:n]) for n in range(1, len(keys) + 1))
    return any(name in present for name in names)


def variable_of(loc: tuple[str | int, ...]) -> tuple[str, tuple[str | int, ...]]:
    """The variable that set `loc` and the part of `loc` inside its JSON value
    (LANES_ALLOWED_INPUT_ROOTS='[1]' is no LANES_..._ROOTS__0)."""
    keys = loc[: len(loc) - len(_in_value(loc))]
    name, used = set_by(tuple(str(part) for part in keys))
    return f"env {name}", loc[used:]


def set_by(keys: tuple[str, ...]) -> tuple[str, int]:
    """The LANES_ variable that set the setting at `keys`, and how many of the keys its
    name holds. A nested setting may come in its own variable (LANES_BATCH__SHARD_LINES)
    or inside a parent's JSON (LANES_BATCH='{"shard_lines": 0}'); where both are set the
    deeper one wins, as pydantic-settings merges them, so the longest name present is the
    one to fix. Read at error time only: the environment is what pydantic-settings read.
    Names match without case, as pydantic-settings reads them; with none present (a
    value given in code), the full name."""
    present = {name.upper(): name for name in os.environ if name.upper().startswith("LANES_")}
    for used in range(len(keys), 0, -1):
        name = "LANES_" + "__".join(key.upper() for key in keys[:used])
        if name in present:
            return present[name], used
    return "LANES_" + "__".join(key.upper() for key in keys), len(keys)


def _in_value(loc: tuple[str | int, ...]) -> tuple[str | int, ...]:
    """The part of `loc` inside a variable's JSON value: from its first index on."""
    index = next((n for n, part in enumerate(loc) if isinstance(part, int)), len(loc))
    return loc[index:]
