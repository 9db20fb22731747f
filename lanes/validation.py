"""A request's pydantic `ValidationError` as one `InvalidInput`: the field as the
request spells it (`messages[1].content`, never pydantic's `messages.1.content.str`),
what was expected and found in lanes' words, and OpenAI's error code
(`invalid_type`, `integer_below_min_value`, `missing_required_parameter`, ...).

Shared by every protocol and task that validates a request with pydantic, so a
field's error reads the same online and offline.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence, Sized
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import ValidationError
from pydantic_core import ErrorDetails

from lanes.errors import InvalidInput, shown, with_article

_EXPECTED = {
    "string_type": "a string",
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "a boolean",
    "bool_parsing": "a boolean",
    "list_type": "an array",
    "tuple_type": "an array",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
    "none_required": "null",
    "path_type": "a path",
}
_BOUNDS = {
    "greater_than_equal": (">=", "ge", "below_min_value"),
    "greater_than": (">", "gt", "below_min_value"),
    "less_than_equal": ("<=", "le", "above_max_value"),
    "less_than": ("<", "lt", "above_max_value"),
}
# Union members and validator wrappers that pydantic puts in a location.
_TAG = re.compile(r"[\[\]\-]|^[A-Z]|^(str|int|float|bool|list|dict|none)$")


def invalid_input(err: ValidationError, names: Mapping[str, str] | None = None) -> InvalidInput:
    """The first problem of `err`, as an `InvalidInput` naming its field. `names`
    renames top-level fields (a spec's `max_new_tokens` is a request's `max_tokens`).

    In a union (a string or an array of strings) the branch that got deepest says
    most; where every branch failed at the field itself, the error lists them all.
    """
    errors = err.errors(include_url=False)
    placed = [(_param(e["loc"], names or {}), e) for e in errors]
    depth = max(len(_parts(e["loc"])) for _, e in placed)
    param = next(p for p, e in placed if len(_parts(e["loc"])) == depth)
    here = [e for p, e in placed if p == param]
    return _one(param or "body", here)


def _parts(loc: Sequence[int | str]) -> list[int | str]:
    return [p for p in loc if isinstance(p, int) or not _TAG.search(p)]


def _param(loc: Sequence[int | str], names: Mapping[str, str]) -> str:
    out = ""
    for part in _parts(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            part = names.get(part, part) if not out else part
            out += f".{part}" if out else part
    return out


def _one(param: str, errors: list[ErrorDetails]) -> InvalidInput:
    explained = explain(errors)
    return InvalidInput.field(param, explained.detail, explained.code)


@dataclass(frozen=True)
class Explained:
    """One field's problem in lanes' words."""

    detail: str  # what was expected and found: "expected an integer, found 'ten'"
    code: str  # OpenAI's error code where it has one: "invalid_type"


def explain(errors: Sequence[ErrorDetails]) -> Explained:
    """What pydantic's `errors` about one field (several: a union's branches, the
    likeliest first) say, in lanes' words. Shared by requests, workloads.yaml and the
    LANES_* settings, so a wrong value reads the same wherever it was written."""
    first = errors[0]
    kind = first["type"]
    value = first.get("input")
    found = describe(value)
    ctx: dict[str, Any] = dict(first.get("ctx") or {})
    expected = [_EXPECTED[e["type"]] for e in errors if e["type"] in _EXPECTED]
    too_large = kind == "int_parsing_size"  # a lax int field given an integer past 64 bits
    if too_large or (kind in ("int_type", "int_from_float") and _beyond_int64(value)):
        # JSON's parser reads an integer beyond 64 bits as a float: it was too large.
        detail = f"expected an integer of at most 64 bits, found {found}"
        return Explained(detail, "integer_above_max_value")
    if kind in _EXPECTED:
        wanted = " or ".join(dict.fromkeys(expected))
        return Explained(f"expected {wanted}, found {found}", "invalid_type")
    if kind == "missing":
        return Explained("missing required parameter", "missing_required_parameter")
    if kind in _BOUNDS:
        sign, key, suffix = _BOUNDS[kind]
        limit = ctx.get(key)
        number = "decimal" if isinstance(limit, float) else "integer"
        # A float field's bound of 0 is pydantic's 0.0: a user wrote, and reads, 0.
        if isinstance(limit, float) and limit.is_integer():
            limit = int(limit)
        detail = f"expected a value {sign} {limit}, found {found}"
        return Explained(detail, f"{number}_{suffix}")
    if kind == "too_short":
        least = ctx.get("min_length", 1)
        if least == 1:
            return Explained("expected at least one item, found an empty array", "empty_array")
        detail = f"expected at least {least} items, found {ctx.get('actual_length')}"
        return Explained(detail, "array_below_min_length")
    if kind == "too_long":
        # pydantic leaves a mapping's length out (None): counted here.
        length = ctx.get("actual_length")
        if length is None and isinstance(value, Sized):
            length = len(value)
        items = "keys" if isinstance(value, Mapping) else "items"
        detail = f"expected at most {ctx.get('max_length')} {items}, found {length}"
        return Explained(detail, "array_above_max_length")
    if kind == "string_too_short":
        detail = f"expected at least {ctx.get('min_length')} character(s), found {found}"
        return Explained(detail, "string_below_min_length")
    if kind == "string_too_long":
        detail = f"expected at most {ctx.get('max_length')} characters"
        if isinstance(value, str):
            detail += f", found {len(value)}"
        return Explained(detail, "string_above_max_length")
    if kind == "literal_error":
        detail = f"expected {ctx.get('expected')}, found {found}"
        return Explained(detail, "invalid_value")
    if kind == "finite_number":  # workloads.yaml's .nan and .inf, a setting's "inf"
        return Explained(f"expected a finite number, found {found}", "invalid_value")
    if kind == "string_pattern_mismatch":
        detail = f"expected text matching {ctx.get('pattern')}, found {found}"
        return Explained(detail, "invalid_value")
    if kind == "value_error":
        return Explained(str(ctx.get("error") or first["msg"]), "invalid_value")
    # A PydanticCustomError of lanes' own: its type is the code, its message the detail.
    message = first["msg"]
    return Explained(message[:1].lower() + message[1:], kind)


def _beyond_int64(value: Any) -> bool:
    return isinstance(value, float) and value.is_integer() and abs(value) >= 2**63


def describe(value: Any) -> str:
    """A found value, short: `null`, `true`, `42`, `'text'`, `an array`, `an object`
    (an SDK caller's numpy array: `a float64 array of shape [1, 2]`)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return shown(value)
    if isinstance(value, str):
        return repr(value if len(value) <= 40 else value[:37] + "...")
    if isinstance(value, np.ndarray):
        return f"{with_article(str(value.dtype))} array of shape {list(value.shape)}"
    if isinstance(value, list | tuple):
        return "an array"
    if isinstance(value, Mapping):
        return "an object"
    return type(value).__name__


def not_utf8(data: bytes | memoryview) -> UnicodeDecodeError | None:
    """Where `data` stops being UTF-8, or None. orjson reports any such byte (Latin-1
    text, UTF-16 from a Windows tool) as "surrogates not allowed" at char 0, which
    names neither the byte nor where it is: a JSON error's message says both from it."""
    try:
        bytes(data).decode("utf-8")
    except UnicodeDecodeError as bad:
        return bad
    return None


def malformed_json(body: bytes | memoryview, error: Exception) -> str:
    """What a body that did not parse as JSON (`error`, the parser's) expected and
    found; where a byte is not UTF-8 (`not_utf8`), that byte."""
    bad = not_utf8(body)
    if bad is None:
        return f"expected JSON, found malformed JSON ({error})"
    byte = bytes(body[bad.start : bad.start + 1]).hex()
    return (
        f"expected JSON in UTF-8, found byte 0x{byte} at offset {bad.start}, which is "
        f"not UTF-8 there ({bad.reason}); send the body encoded as UTF-8"
    )
