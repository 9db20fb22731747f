"""Reading workloads.yaml: YAML with line numbers, environment overrides, then the schema.

Every problem comes back at once as `file:LINE:COL: field.path: message`, or, for a
value that came from the environment, `env LANES_WORKLOADS__...: field.path: message`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lanes.errors import Problem, SpecError
from lanes.settings import Settings
from lanes.spec import Found, Loc, Spec, parse_spec


@dataclass(frozen=True)
class Mark:
    line: int  # 1-based
    column: int  # 1-based


@dataclass(frozen=True)
class Marks:
    """Where each path of the document sits: its key, and its value."""

    keys: dict[Loc, Mark]
    values: dict[Loc, Mark]

    def find(self, loc: Loc, at_key: bool) -> Mark | None:
        # A path the file does not have (a missing key, a default) points at its
        # nearest ancestor that it does have.
        for end in range(len(loc), -1, -1):
            sub = loc[:end]
            table = self.keys if at_key and end == len(loc) else self.values
            if sub in table:
                return table[sub]
            if sub in self.keys:
                return self.keys[sub]
        return None


def load_spec(
    path: str | Path | None = None, settings: Settings | None = None, *, check_files: bool = True
) -> Spec:
    """Load and validate a workloads.yaml, with the environment's overrides applied.

    Raises `SpecError` listing every problem found. The spec's folder goes on the import
    path and every `handler:` and guard is imported; `check_files=False` skips that and
    the check that model files exist (for clients that only route calls).
    """
    settings = settings or Settings()
    file = Path(path) if path is not None else settings.spec
    name = str(path) if path is not None else str(settings.spec)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as err:
        raise SpecError(
            [Problem(name, None, None, "", f"cannot read the spec: {err.strerror}")]
        ) from None
    return parse_text(text, name, file.resolve().parent, settings, check_files)


def parse_text(
    text: str, source: str, base: Path, settings: Settings, check_files: bool = True
) -> Spec:
    """Validate YAML text; `source` names it in messages, `base` anchors relative paths."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line, col = (mark.line + 1, mark.column + 1) if mark is not None else (None, None)
        what = getattr(err, "problem", None) or str(err)
        raise SpecError([Problem(source, line, col, "", f"invalid YAML: {what}")]) from None
    marks = Marks({}, {})
    duplicates: Found = []
    if node is not None:
        _walk(node, (), marks, duplicates)
    if data is None:
        data = {}
    data, origins, unknown = _apply_overrides(data, settings)
    spec, found = parse_spec(data, base, check_files)
    found = duplicates + found
    if spec is None or found or unknown:
        raise SpecError(_problems(found, source, marks, origins) + unknown)
    return spec


def _walk(node: yaml.Node, loc: Loc, marks: Marks, duplicates: Found) -> None:
    marks.values[loc] = Mark(node.start_mark.line + 1, node.start_mark.column + 1)
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            key = key_node.value
            child = (*loc, key)
            if key in seen:
                duplicates.append((child, f"key {key!r} appears twice; keep one", True))
            seen.add(key)
            marks.keys[child] = Mark(key_node.start_mark.line + 1, key_node.start_mark.column + 1)
            _walk(value_node, child, marks, duplicates)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _walk(item, (*loc, index), marks, duplicates)


def _apply_overrides(data: Any, settings: Settings) -> tuple[Any, dict[Loc, str], list[Problem]]:
    """Merge LANES_WORKLOADS__* and LANES_MODELS__* into the document.

    Environment names cannot hold '-', so `search_query` names `search-query`.
    Returns the merged data, per overridden path the variable it came from, and a
    problem for each override that names nothing in the spec.
    """
    origins: dict[Loc, str] = {}
    unknown: list[Problem] = []
    if not isinstance(data, dict):
        return data, origins, unknown
    data = copy.deepcopy(data)
    for section, overrides in (("workloads", settings.workloads), ("models", settings.models)):
        if not overrides:
            continue
        table = data.setdefault(section, {})
        if not isinstance(table, dict):
            continue
        by_env_name = {str(k).replace("-", "_").lower(): k for k in table}
        for env_key, values in overrides.items():
            var = f"LANES_{section.upper()}__{env_key.upper()}"
            name = by_env_name.get(env_key.lower())
            if name is None:
                known = ", ".join(sorted(by_env_name)) or "none"
                message = f"names no {section[:-1]} of the spec (known: {known}; '-' is '_')"
                unknown.append(Problem(f"env {var}", None, None, f"{section}.{env_key}", message))
                continue
            if not isinstance(values, dict) or not isinstance(table[name], dict):
                table[name] = values
                origins[(section, name)] = var
                continue
            _merge(table[name], values, (section, name), var, origins)
    return data, origins, unknown


def _merge(
    target: dict[str, Any], values: dict[str, Any], loc: Loc, var: str, origins: dict[Loc, str]
) -> None:
    for key, value in values.items():
        child = (*loc, key)
        name = f"{var}__{key.upper()}"
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value, child, name, origins)
        else:
            target[key] = value
            origins[child] = name


def _problems(found: Found, source: str, marks: Marks, origins: dict[Loc, str]) -> list[Problem]:
    problems = []
    for loc, message, at_key in found:
        path = ".".join(str(part) for part in loc)
        origin = next(
            (origins[loc[:n]] for n in range(len(loc), 0, -1) if loc[:n] in origins), None
        )
        if origin is not None:
            problems.append(Problem(f"env {origin}", None, None, path, message))
            continue
        mark = marks.find(loc, at_key)
        line, col = (mark.line, mark.column) if mark else (None, None)
        problems.append(Problem(source, line, col, path, message))
    problems.sort(key=lambda p: (p.source.startswith("env"), p.line or 0, p.column or 0))
    return problems
