"""workloads.yaml as YAML: plain data, bounded, with the line of every key and value.

A spec is a small file a person writes, so whatever else a YAML file can hold is
refused before it costs time or memory, each with its line:

- more than MAX_BYTES, or bytes that are not UTF-8;
- nesting deeper than MAX_DEPTH, or more than MAX_NODES values once aliases are
  expanded (a few hundred bytes of "billion laughs" aliases would grow to gigabytes),
  or an alias inside the node it names;
- an explicit tag (`!!binary`, `!!set`, `!!python/...`, `!mine`, even `!!int`) but `!!str`;
- a key that is a mapping or a list, an integer of more than MAX_INT_DIGITS digits.

Keys are taken as written: `on:` is the name "on", not True, and `123:` is "123".
A date-like value is text (no field takes a date). Aliases and merge keys (`<<: *x`)
work as in any YAML file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml
from yaml.events import AliasEvent, Event, NodeEvent
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from lanes.errors import Problem, SpecError
from lanes.specproblems import Found, Loc, dotted

MAX_BYTES = 1 << 20
MAX_DEPTH = 20  # a spec needs 6: workloads.NAME.generation.stop[0]
MAX_NODES = 20_000  # keys and values, aliases counted as often as they are used
MAX_INT_DIGITS = 18

_CORE = "tag:yaml.org,2002:"
# What plain values resolve to; an explicit tag may name only text.
PLAIN_TAGS = frozenset(
    _CORE + name for name in ("str", "int", "float", "bool", "null", "map", "seq", "timestamp")
)
MERGE_TAG = _CORE + "merge"
EXPLICIT_TAGS = frozenset({"!", _CORE + "str"})


@dataclass(frozen=True)
class Mark:
    line: int  # 1-based
    column: int  # 1-based


START = Mark(1, 1)


@dataclass(frozen=True)
class Marks:
    """Where each path of the document sits: its key, and its value."""

    keys: dict[Loc, Mark] = field(default_factory=dict)
    values: dict[Loc, Mark] = field(default_factory=dict)

    def find(self, loc: Loc, at_key: bool) -> Mark:
        """The mark of `loc`; a path the file does not have (a missing key, a default)
        points at its nearest ancestor that it has, and at last at the document's start."""
        for end in range(len(loc), -1, -1):
            sub = loc[:end]
            table = self.keys if at_key and end == len(loc) else self.values
            if sub in table:
                return table[sub]
            if sub in self.keys:
                return self.keys[sub]
        return START


@dataclass(frozen=True)
class Document:
    data: Any  # dicts with str keys, lists, str, int, float, bool, None
    marks: Marks
    duplicates: Found  # (path, message, at the key): a key twice


def read_yaml(raw: bytes, source: str) -> Document:
    """Parse a spec's bytes. Raises SpecError (the problems, each with its line) when
    the file is not plain, bounded YAML as the module docstring says."""
    if len(raw) > MAX_BYTES:
        message = f"more than {MAX_BYTES} bytes; a spec is a few kilobytes (split it up)"
        raise SpecError([Problem(source, None, None, "", message)])
    text = _decode(raw, source)
    loader: _Loader | None = None
    try:
        loader = _Loader(text)  # it checks the characters at once
        node = loader.get_single_node()
        marks = Marks()
        walk = _Walk(marks, loader.tagged)
        if node is not None:
            walk.node(node, ())
        if walk.refused:
            raise SpecError(
                [Problem(source, at.line, at.column, dotted(loc), m) for loc, m, at in walk.refused]
            )
        data = loader.construct_document(node) if node is not None else None
    except _Refused as err:
        raise SpecError([Problem(source, err.line, err.column, "", err.message)]) from None
    except yaml.YAMLError as err:
        raise SpecError([_yaml_problem(err, source, text)]) from None
    finally:
        if loader is not None:
            loader.dispose()
    return Document(data, marks, walk.duplicates)


def _decode(raw: bytes, source: str) -> str:
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        start = err.start
        line_start = raw.rfind(b"\n", 0, start) + 1
        column = len(raw[line_start:start].decode("utf-8", "replace")) + 1
        line = raw.count(b"\n", 0, start) + 1
        message = (
            f"not UTF-8 text: byte 0x{raw[start]:02x} is no UTF-8 character; save the file as UTF-8"
        )
        raise SpecError([Problem(source, line, column, "", message)]) from None


def _yaml_problem(err: yaml.YAMLError, source: str, text: str) -> Problem:
    """One line: where, and what the YAML parser expected."""
    if isinstance(err, yaml.reader.ReaderError):
        line = text.count("\n", 0, err.position) + 1
        column = err.position - (text.rfind("\n", 0, err.position) + 1) + 1
        code = err.character if isinstance(err.character, int) else ord(err.character)
        message = f"invalid YAML: character U+{code:04X} is not allowed in YAML text"
        return Problem(source, line, column, "", message)
    mark = getattr(err, "problem_mark", None)
    at: tuple[int | None, int | None] = (None, None)
    if mark is not None:
        at = (mark.line + 1, mark.column + 1)
    problem = getattr(err, "problem", None)
    context = getattr(err, "context", None)
    what = problem or context or str(err)
    if problem and context:
        what = f"{problem} ({context})"
    return Problem(source, *at, "", "invalid YAML: " + " ".join(what.split()))


class _Refused(Exception):
    """What the loader will not compose, at the event where it found it."""

    def __init__(self, event: Event, message: str) -> None:
        super().__init__(message)
        mark = event.start_mark
        self.line = mark.line + 1 if mark is not None else None
        self.column = mark.column + 1 if mark is not None else None
        self.message = message


class _Loader(yaml.SafeLoader):
    """PyYAML's SafeLoader that counts what it composes.

    Each node's expanded size and height are known once it is composed, so an alias
    adds what it stands for without being expanded, and a bound holds however the
    file nests its aliases.
    """

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self._depth = 0  # of the node being composed
        self._reach = 0  # deepest level composed (aliases expanded) under it
        self._nodes = 0
        self._sizes: dict[int, tuple[int, int]] = {}  # id(node) -> (nodes, height)
        self.tagged: dict[int, str] = {}  # id(node) -> its explicit tag, when refused

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        event: Event = self.peek_event()  # type: ignore[no-untyped-call]
        if isinstance(event, AliasEvent):
            target = self.anchors.get(event.anchor)
            if target is not None:  # else the composer says the alias is undefined
                size = self._sizes.get(id(target))
                if size is None:
                    raise _Refused(
                        event,
                        f"alias *{event.anchor} is inside the node it names (a loop)",
                    )
                self._count(size[0], event)
                self._reach = max(self._reach, self._depth + size[1])
                self._check_depth(self._depth + size[1], event)
            return super().compose_node(parent, index)
        self._depth += 1
        self._check_depth(self._depth, event)
        outer, self._reach = self._reach, self._depth
        before = self._nodes
        node = super().compose_node(parent, index)
        self._count(1, event)
        tag = getattr(event, "tag", None)
        if tag is not None and tag not in EXPLICIT_TAGS and node is not None:
            self.tagged[id(node)] = tag
        if isinstance(event, NodeEvent) and event.anchor is not None:
            self._sizes[id(node)] = (self._nodes - before, self._reach - self._depth + 1)
        self._reach = max(outer, self._reach)
        self._depth -= 1
        return node

    def _count(self, nodes: int, event: Event) -> None:
        self._nodes += nodes
        if self._nodes > MAX_NODES:
            raise _Refused(
                event,
                f"more than {MAX_NODES} keys and values (aliases counted each time they are "
                "used); a spec needs far fewer: write fewer aliases or split the file",
            )

    def _check_depth(self, depth: int, event: Event) -> None:
        if depth > MAX_DEPTH:
            raise _Refused(
                event, f"nested more than {MAX_DEPTH} deep (aliases expanded); a spec needs 6"
            )

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        # Keys as written (see the module docstring); _Walk refused every other key.
        self.flatten_mapping(node)
        return {key.value: self.construct_object(value, deep=deep) for key, value in node.value}


def _timestamp_as_text(loader: _Loader, node: ScalarNode) -> str:
    return str(loader.construct_scalar(node))


_Loader.add_constructor(_CORE + "timestamp", _timestamp_as_text)


class _Walk:
    """Every path's marks; duplicate keys; the keys, tags and integers refused."""

    def __init__(self, marks: Marks, tagged: dict[int, str]) -> None:
        self.marks = marks
        self.tagged = tagged
        self.duplicates: Found = []
        self.refused: list[tuple[Loc, str, Mark]] = []

    def node(self, node: Node, loc: Loc) -> None:
        self.marks.values[loc] = _mark(node)
        tag = self.tagged.get(id(node), node.tag)
        if id(node) in self.tagged or tag not in PLAIN_TAGS:
            self.refused.append((loc, _tag_message(tag), _mark(node)))
        elif isinstance(node, MappingNode):
            self._mapping(node, loc)
        elif isinstance(node, SequenceNode):
            for index, item in enumerate(node.value):
                self.node(item, (*loc, index))
        elif node.tag == _CORE + "int":
            digits = sum(c.isdigit() for c in node.value)
            if digits > MAX_INT_DIGITS:
                message = f"an integer of {digits} digits is larger than any field takes"
                self.refused.append((loc, message, _mark(node)))

    def _mapping(self, node: MappingNode, loc: Loc) -> None:
        seen: set[str] = set()
        for key_node, value_node in node.value:
            if not isinstance(key_node, ScalarNode):
                kind = "mapping" if isinstance(key_node, MappingNode) else "list"
                message = f"expected a name as key, found a {kind}"
                self.refused.append((loc, message, _mark(key_node)))
                continue
            key = key_node.value
            child = (*loc, key)
            self.marks.keys[child] = _mark(key_node)
            if key_node.tag == MERGE_TAG:
                self.node(value_node, child)  # `<<: *x`: its keys are the mapping's own
                continue
            if id(key_node) in self.tagged or key_node.tag not in PLAIN_TAGS:
                tag = self.tagged.get(id(key_node), key_node.tag)
                self.refused.append((child, _tag_message(tag), _mark(key_node)))
            if key in seen:
                self.duplicates.append((child, f"key {key!r} appears twice; keep one", True))
            seen.add(key)
            self.node(value_node, child)


def _mark(node: Node) -> Mark:
    return Mark(node.start_mark.line + 1, node.start_mark.column + 1)


def _tag_message(tag: str) -> str:
    short = "!!" + tag.removeprefix(_CORE) if tag.startswith(_CORE) else tag
    return f"the tag {short} is not plain data; write the value without it (quote text)"
