"""The spec's problems at their field paths: pydantic's errors said in lanes' words.

A problem is (path, message, points at the key itself); a path is a tuple of keys from
the document's root, shown as `dotted` says. `from_pydantic` turns any model's errors
into problems (the spec's, and the settings' too); `workload_errors` those of a
workload, whose model pydantic picks by its `mode`. An unknown key is told with the
key it is close to, or else with the keys its place takes, read from the model.
"""

from __future__ import annotations

import difflib
import re
import types
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
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
            found += _from_pydantic_error(e, at, ())
            continue
        mode, *rest = e["loc"]
        model = InteractiveWorkload if mode == "interactive" else OfflineWorkload
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
            found += _missing(at, model, rest[0])
            continue
        found += _from_pydantic_error({**e, "loc": tuple(rest)}, at, (model,))
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
                    # Either mode's keys: the same unknown key is found by both.
                    found += _from_pydantic_error(e, at, (InteractiveWorkload, OfflineWorkload))
                elif key not in MODE_KEYS[mode]:
                    found += _missing(at, model, key)
    return list(dict.fromkeys(found))  # the keys both modes have were checked twice


def _missing(
    at: Loc, model: type[InteractiveWorkload] | type[OfflineWorkload], key: str | int
) -> Found:
    about = model.model_fields[str(key)].description or ""
    return [(at, f"missing required key {key!r} ({_lower_first(about).rstrip('.')})", True)]


def from_pydantic(err: ValidationError, prefix: Loc, model: type[BaseModel]) -> Found:
    """Each of `err`'s problems, `model`'s, at its key under `prefix`, in the words a
    request's problems are in (lanes.validation.explain)."""
    found: Found = []
    for e in err.errors(include_url=False):
        found += _from_pydantic_error(e, prefix, (model,))
    return found


def _from_pydantic_error(
    e: ErrorDetails, prefix: Loc, models: tuple[type[BaseModel], ...]
) -> Found:
    loc: Loc = prefix + tuple(e["loc"])
    kind = e["type"]
    if kind == "extra_forbidden":
        return [(loc, _unknown_key(e["loc"], models), True)]
    if kind == "missing":
        return [(loc[:-1], f"missing required key {shown(loc[-1])}", True)]
    message = explain([e]).detail
    if "found" not in message:  # a validator's own message may not say what it was given
        message = f"{message}; found {describe(e['input'])}"
    return [(loc, message, False)]


def _unknown_key(loc: Loc, models: tuple[type[BaseModel], ...]) -> str:
    """'unknown key' and the key meant, as `lanes call` says an unknown option: the one
    close to it, or else the keys its place takes (of any of `models`, where `loc` is)."""
    key = loc[-1]
    message = f"unknown key {shown(key)}"
    takes = sorted({k for model in models for k in _keys_at(model, loc[:-1])})
    near = difflib.get_close_matches(str(key), takes, n=1)
    if near:
        return f"{message}; did you mean {near[0]!r}?"
    if takes:
        return f"{message}; expected one of: {', '.join(takes)}"
    return message


def _keys_at(model: type[BaseModel], loc: Loc) -> list[str]:
    """The keys the mapping at `loc` in `model` takes; none where no model is there."""
    arms: list[Any] = [model]
    for part in loc:
        arms = [inner for arm in arms for inner in _arms(_inside(arm, part))]
    return [key for arm in arms if _is_model(arm) for key in arm.model_fields]


def _inside(kind: Any, part: str | int) -> Any:
    """The type of `part` inside a value of type `kind` (None if it has no such part)."""
    if _is_model(kind):
        field = kind.model_fields.get(str(part))
        return field.annotation if field is not None else None
    if get_origin(kind) is dict:
        return get_args(kind)[1]
    if get_origin(kind) is list and isinstance(part, int):
        return get_args(kind)[0]
    return None


def _arms(kind: Any) -> list[Any]:
    """The types a value of `kind` may be: a union's arms, without `Annotated`."""
    if get_origin(kind) is Annotated:
        return _arms(get_args(kind)[0])
    if get_origin(kind) in (Union, types.UnionType):
        return [arm for union_arm in get_args(kind) for arm in _arms(union_arm)]
    return [kind]


def _is_model(kind: Any) -> bool:
    return isinstance(kind, type) and issubclass(kind, BaseModel)


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
