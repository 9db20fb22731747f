"""The spec's problems at their field paths: pydantic's errors said in lanes' words.

A problem is (path, message, points at the key itself); a path is a tuple of keys from
the document's root, shown as `dotted` says. `from_pydantic` turns any model's errors
into problems (the spec's, and the settings' too); `workload_errors` those of a
workload, whose model pydantic picks by its `mode`.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from lanes.errors import shown
from lanes.spec import MODE_KEYS, InteractiveWorkload, OfflineWorkload
from lanes.validation import describe, explain

# (path, message) pairs; a path is a tuple of keys from the document's root.
Loc = tuple[str | int, ...]
Found = list[tuple[Loc, str, bool]]  # (path, message, points at the key itself)

_PLAIN_KEY = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def workload_errors(err: ValidationError, at: Loc, raw: Any) -> Found:
    """A workload's errors, without the mode pydantic puts first in each path, and a key
    of the other mode named as such."""
    found: Found = []
    for e in err.errors(include_url=False):
        kind = e["type"]
        if kind == "union_tag_not_found":
            message = "missing required key 'mode': interactive (someone is waiting) or offline"
            found.append((at, message, True))
            found += _modeless_problems(at, raw)
            continue
        if kind == "union_tag_invalid":
            found.append(
                (
                    (*at, "mode"),
                    f"expected 'interactive' or 'offline', found {describe(raw['mode'])}",
                    False,
                )
            )
            found += _modeless_problems(at, raw)
            continue
        if not e["loc"]:  # not a mapping at all
            found += _from_pydantic_error(e, at)
            continue
        mode, *rest = e["loc"]
        if kind == "extra_forbidden" and len(rest) == 1:
            other = "offline" if mode == "interactive" else "interactive"
            if rest[0] in MODE_KEYS[other]:
                message = (
                    f"`{rest[0]}` applies to {other} workloads only; "
                    f"remove it or set `mode: {other}`"
                )
                found.append(((*at, rest[0]), message, True))
                continue
        if kind == "missing" and len(rest) == 1:
            model = InteractiveWorkload if mode == "interactive" else OfflineWorkload
            found += _missing(at, model, rest[0])
            continue
        found += _from_pydantic_error({**e, "loc": tuple(rest)}, at)
    return found


def _modeless_problems(at: Loc, raw: Any) -> Found:
    """A workload without a valid `mode` has no model to be checked against; so that the
    mode's problem hides no other, each other key is checked as the mode that has it
    would check it (a key both modes have, or neither, once). A required key of one
    mode only (an offline workload's `input`) is not asked for: the mode is unknown."""
    if not isinstance(raw, dict):
        return []
    found: Found = []
    for mode, model in (("interactive", InteractiveWorkload), ("offline", OfflineWorkload)):
        other = MODE_KEYS["offline" if mode == "interactive" else "interactive"]
        data = {k: v for k, v in raw.items() if k != "mode" and k not in other}
        try:
            model.model_validate({**data, "mode": mode})
        except ValidationError as err:
            for e in err.errors(include_url=False):
                key = e["loc"][0] if len(e["loc"]) == 1 else None
                if e["type"] != "missing" or key is None:
                    found += _from_pydantic_error(e, at)
                elif key not in MODE_KEYS[mode]:
                    found += _missing(at, model, key)
    return list(dict.fromkeys(found))  # the keys both modes have were checked twice


def _missing(
    at: Loc, model: type[InteractiveWorkload] | type[OfflineWorkload], key: str | int
) -> Found:
    about = model.model_fields[str(key)].description or ""
    return [(at, f"missing required key {key!r} ({_lower_first(about).rstrip('.')})", True)]


def from_pydantic(err: ValidationError, prefix: Loc) -> Found:
    """Each of `err`'s problems at its key under `prefix`, in the words a request's
    problems are in (lanes.validation.explain)."""
    found: Found = []
    for e in err.errors(include_url=False):
        found += _from_pydantic_error(e, prefix)
    return found


def _from_pydantic_error(e: ErrorDetails, prefix: Loc) -> Found:
    loc: Loc = prefix + tuple(e["loc"])
    kind = e["type"]
    if kind == "extra_forbidden":
        return [(loc, f"unknown key {shown(loc[-1])}", True)]
    if kind == "missing":
        return [(loc[:-1], f"missing required key {shown(loc[-1])}", True)]
    message = explain([e]).detail
    if "found" not in message:  # a validator's own message may not say what it was given
        message = f"{message}; found {describe(e['input'])}"
    return [(loc, message, False)]


def dotted(loc: Loc) -> str:
    """A field path as a message shows it: `workloads.search-query.batching`, a list's
    item as `generation.stop[0]`; a key that is not a plain name is quoted (it may hold
    a newline, or run long)."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            key = part if _PLAIN_KEY.match(part) else shown(part, 40)
            path += f".{key}" if path else key
    return path


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]
