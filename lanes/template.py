"""Text from a record's fields: `"{subject}\\n\\n{body}"` in workloads.yaml's `fields:`.

A template is literal text with `{name}` for a field's value (`{{` and `}}` for
literal braces); nothing else is interpreted, so a field name may hold any character
but braces (CSV headers like `Ticket ID` work). A value of `fields.text` or
`fields.prompt` without braces is a field name, taken as it is.

    template = Template.parse("{subject}: {body}")   # ValueError says what is wrong
    template.fields                                  # ("subject", "body")
    template.render({"subject": "Hi", "body": "..."})  # KeyError names a missing field
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson


@dataclass(frozen=True)
class FieldRef:
    """`{name}` in a template."""

    name: str


@dataclass(frozen=True)
class Template:
    source: str
    parts: tuple[str | FieldRef, ...]

    @classmethod
    def parse(cls, source: str) -> Template:
        """The template `source`; a ValueError names the first problem and its position."""
        parts: list[str | FieldRef] = []
        literal: list[str] = []
        at = 0
        while at < len(source):
            char = source[at]
            if char in "{}" and source[at : at + 2] in ("{{", "}}"):
                literal.append(char)
                at += 2
            elif char == "}":
                raise ValueError(
                    f"a single '}}' at position {at} of {source!r}; write '}}}}' for a brace"
                )
            elif char == "{":
                end = source.find("}", at + 1)
                name = source[at + 1 : end] if end >= 0 else ""
                if end < 0 or "{" in name:
                    raise ValueError(
                        f"'{{' at position {at} of {source!r} opens no field: expected "
                        "'{name}' (or '{{' for a brace)"
                    )
                if not name:
                    raise ValueError(f"'{{}}' at position {at} of {source!r} names no field")
                if literal:
                    parts.append("".join(literal))
                    literal = []
                parts.append(FieldRef(name))
                at = end + 1
            else:
                literal.append(char)
                at += 1
        if literal:
            parts.append("".join(literal))
        return cls(source, tuple(parts))

    @property
    def fields(self) -> tuple[str, ...]:
        """The field names it reads, in order, once each."""
        return tuple(dict.fromkeys(p.name for p in self.parts if isinstance(p, FieldRef)))

    def render(self, record: Mapping[str, Any]) -> str:
        """The text for `record`. A missing field raises KeyError(name); null is empty
        text, a string is itself, anything else its JSON."""
        return "".join(
            part if isinstance(part, str) else _text(record[part.name]) for part in self.parts
        )


def is_template(value: str) -> bool:
    """Whether a `fields.text`/`fields.prompt` value is a template (else a field name)."""
    return "{" in value or "}" in value


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return orjson.dumps(value).decode()
