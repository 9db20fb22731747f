"""Changing a few numbers of a workloads.yaml in place, every other byte kept.

    text = set_scalars(text, {("workloads", "search", "batching", "max_batch_size"): 16})

A person's spec has comments, blank lines, flow mappings and a key order of its own;
loading and dumping it would lose them all. So the edit is textual, at the places the
YAML parser reports: a value that is there is replaced where it stands; a key that is
missing is added to the nearest mapping on its path that is there (a line of its own
at that mapping's indentation in block style, `, key: value` before the `}` in flow
style), the keys still missing below it written as one flow mapping
(`batching: {max_batch_size: 16, max_wait_ms: 2}`).

What a text edit cannot change safely is refused with `SpecEditError`, the file left
as it was: a value that an anchor shares with other places (`&x` ... `*x`), a key a
merge (`<<: *x`) may give, a path through something that is not a mapping. Every
edit is checked by loading the result: it must hold the new values and nothing else
changed.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from lanes.errors import LanesError
from lanes.specproblems import dotted

Scalar = int | float
Path = tuple[str, ...]

_MERGE = "tag:yaml.org,2002:merge"


class SpecEditError(LanesError):
    """The spec cannot be changed by a text edit; the message says what to do by hand."""


@dataclass(frozen=True)
class _Splice:
    """Replace text[start:end] with `text` (an insertion when start == end)."""

    start: int
    end: int
    text: str


def set_scalars(text: str, changes: Mapping[Path, Scalar]) -> str:
    """`text` with each path of `changes` set to its number, as the module docstring
    says. Raises SpecEditError when a change cannot be made as a text edit."""
    if not changes:
        return text
    root = yaml.compose(text, Loader=yaml.SafeLoader)
    if not isinstance(root, MappingNode):
        raise SpecEditError("the spec is not a mapping of keys; nothing can be set in it")
    shared = _shared_nodes(root)
    newline = "\r\n" if "\r\n" in text else "\n"
    # Missing keys, grouped under the mapping that is there: node id -> (node, subtree).
    additions: dict[int, tuple[MappingNode, dict[str, Any]]] = {}
    splices: list[_Splice] = []
    for path, value in changes.items():
        node: Node = root
        for depth, key in enumerate(path):
            if not isinstance(node, MappingNode):
                raise SpecEditError(
                    f"{dotted(path[:depth])}: not a mapping, so {key!r} cannot be set"
                )
            if id(node) in shared:
                raise SpecEditError(_shared_message(path[:depth]))
            found = _entry(node, key)
            if found is None:
                if any(k.tag == _MERGE for k, _ in node.value):
                    raise SpecEditError(
                        f"{dotted(path[: depth + 1])}: its mapping takes keys from a merge "
                        "(<<: *x); set the value by hand"
                    )
                subtree = additions.setdefault(id(node), (node, {}))[1]
                _nest(subtree, path[depth:], value)
                break
            node = found
        else:
            if not isinstance(node, ScalarNode) or node.style in ("|", ">"):
                raise SpecEditError(f"{dotted(path)}: not a plain value, so it is not replaced")
            if id(node) in shared:
                raise SpecEditError(_shared_message(path))
            start, end = node.start_mark.index, node.end_mark.index
            splices.append(_Splice(start, end, _number(value)))
    for node, subtree in additions.values():
        splices.append(_addition(text, node, subtree, newline))
    edited = text
    for splice in sorted(splices, key=lambda s: s.start, reverse=True):
        edited = edited[: splice.start] + splice.text + edited[splice.end :]
    _check(text, edited, changes)
    return edited


def _entry(mapping: MappingNode, key: str) -> Node | None:
    for key_node, value_node in mapping.value:
        if isinstance(key_node, ScalarNode) and key_node.tag != _MERGE and key_node.value == key:
            found: Node = value_node
            return found
    return None


def _nest(tree: dict[str, Any], path: Path, value: Scalar) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _number(value: Scalar) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return repr(value)


def _flow(tree: dict[str, Any]) -> str:
    parts = [
        f"{key}: {_flow(value) if isinstance(value, dict) else _number(value)}"
        for key, value in tree.items()
    ]
    return "{" + ", ".join(parts) + "}"


def _addition(text: str, mapping: MappingNode, tree: dict[str, Any], newline: str) -> _Splice:
    entries = [
        f"{key}: {_flow(value) if isinstance(value, dict) else _number(value)}"
        for key, value in tree.items()
    ]
    if mapping.flow_style:
        if not mapping.value:  # `{}`: just inside the brace
            at = mapping.end_mark.index - 1
            return _Splice(at, at, ", ".join(entries))
        at = mapping.value[-1][1].end_mark.index
        return _Splice(at, at, "".join(", " + entry for entry in entries))
    indent = " " * mapping.value[0][0].start_mark.column
    # After the line where the mapping's last value ends (its comment kept on it).
    end = _last_scalar(mapping.value[-1][1]).end_mark.index
    if end > 0 and text[end - 1] == "\n":  # a block scalar ends after its newline
        at = end
        lines = "".join(indent + entry + newline for entry in entries)
        return _Splice(at, at, lines)
    line_end = text.find("\n", end)
    if line_end == -1:
        at = len(text)
        lines = "".join(newline + indent + entry for entry in entries)
        return _Splice(at, at, lines)
    at = line_end + 1
    return _Splice(at, at, "".join(indent + entry + newline for entry in entries))


def _last_scalar(node: Node) -> Node:
    """The node whose text ends last under `node` (a block collection's own end mark
    lies at the start of whatever follows it, comments and blank lines included)."""
    while isinstance(node, MappingNode | SequenceNode) and not node.flow_style and node.value:
        last = node.value[-1]
        node = last[1] if isinstance(node, MappingNode) else last
    return node


def _shared_nodes(root: Node) -> set[int]:
    """Ids of the nodes an alias reaches (an anchor's node), and of all below them."""
    count: dict[int, int] = {}
    nodes: dict[int, Node] = {}
    stack = [root]
    while stack:
        node = stack.pop()
        count[id(node)] = count.get(id(node), 0) + 1
        if count[id(node)] == 1:  # an alias's children were walked with its anchor
            nodes[id(node)] = node
            stack += _children(node)
    shared: set[int] = set()
    stack = [nodes[key] for key, n in count.items() if n > 1]
    while stack:
        node = stack.pop()
        if id(node) not in shared:
            shared.add(id(node))
            stack += _children(node)
    return shared


def _children(node: Node) -> list[Node]:
    if isinstance(node, MappingNode):
        return [child for pair in node.value for child in pair]
    if isinstance(node, SequenceNode):
        return list(node.value)
    return []


def _shared_message(path: Path) -> str:
    return (
        f"{dotted(path)}: an anchor (&x) shares it with other places, and changing it "
        "would change them too; set the value by hand"
    )


def _check(before: str, after: str, changes: Mapping[Path, Scalar]) -> None:
    expected = copy.deepcopy(yaml.safe_load(before))
    for path, value in changes.items():
        tree = expected
        for key in path[:-1]:
            tree = tree.setdefault(key, {})
        tree[path[-1]] = value
    try:
        got = yaml.safe_load(after)
    except yaml.YAMLError as err:
        raise SpecEditError(f"the edit would not parse ({err}); set the values by hand") from None
    if got != expected:
        raise SpecEditError("the edit would change more than the values; set them by hand")
