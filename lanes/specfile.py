"""Reading workloads.yaml: bounded YAML with line numbers (lanes.specyaml), environment
overrides, then the schema and its rules (lanes.specrules).

Every problem comes back at once as `file:LINE:COL: field.path: message`, or, for a
value that came from the environment, `env LANES_WORKLOADS__...: field.path: message`.
Whatever the file holds, the result is a Spec or a SpecError.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lanes.errors import Problem, SpecError
from lanes.settings import Settings
from lanes.settings_origin import set_by
from lanes.spec import Spec
from lanes.specproblems import Found, Loc, dotted
from lanes.specrules import parse_spec
from lanes.specyaml import MAX_BYTES, MAX_DEPTH, Marks, read_yaml


def load_spec(
    path: str | Path | None = None,
    settings: Settings | None = None,
    *,
    check_files: bool = True,
    check_models: bool = False,
) -> Spec:
    """Load and validate a workloads.yaml, with the environment's overrides applied.

    Raises `SpecError` listing every problem found. The spec's folder goes on the import
    path and every `handler:` and guard is imported; `check_files=False` skips that and
    the check that model files exist (for clients that only route calls); `check_models`
    also reads each model's graph (not its weights) for inputs its task cannot feed, as
    loading it would (`lanes validate`).
    """
    settings = settings or Settings()
    file = Path(path) if path is not None else settings.spec
    name = str(file)
    try:
        with file.open("rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except (OSError, ValueError) as err:  # ValueError: a NUL in the path
        reason = getattr(err, "strerror", None) or str(err)
        if isinstance(err, FileNotFoundError):
            # Most often a command run in another folder than the spec's (a container's
            # workdir, a cron job's $HOME): say where it looked and how to point at it.
            reason = f"no such file ({file.absolute()}); pass its path or set LANES_SPEC"
        raise SpecError(
            [Problem(name, None, None, "", f"cannot read the spec: {reason}")]
        ) from None
    return parse_bytes(raw, name, file.resolve().parent, settings, check_files, check_models)


def read_document(path: str | Path, settings: Settings) -> Any:
    """The spec's document as `load_spec` reads it (names as written, aliases expanded),
    the environment's overrides merged in: what a copy of the spec must hold to load as
    the same spec elsewhere. Call `load_spec` first; this reports no problems."""
    file = Path(path)
    with file.open("rb") as f:
        document = read_yaml(f.read(MAX_BYTES + 1), str(file))
    data, _, _ = _apply_overrides({} if document.data is None else document.data, settings)
    return data


def parse_bytes(
    raw: bytes,
    source: str,
    base: Path,
    settings: Settings,
    check_files: bool = True,
    check_models: bool = False,
) -> Spec:
    """Validate a spec's bytes; `source` names it in messages, `base` anchors relative paths."""
    document = read_yaml(raw, source)
    data = {} if document.data is None else document.data
    data, origins, unknown = _apply_overrides(data, settings)
    spec, found = parse_spec(data, base, check_files, check_models, spec_name=Path(source).name)
    found = document.duplicates + found
    if spec is None or found or unknown:
        raise SpecError(_problems(found, source, document.marks, origins) + unknown)
    return spec


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
    data = _unshared(data)
    for section, overrides in (("workloads", settings.workloads), ("models", settings.models)):
        if not overrides:
            continue
        table = data.setdefault(section, {})
        if not isinstance(table, dict):
            continue
        by_env_name = {str(k).replace("-", "_").lower(): k for k in table}
        for env_key, values in overrides.items():
            keys = (section, str(env_key))
            var = set_by(keys)[0]
            name = by_env_name.get(env_key.lower())
            if name is None:
                known = ", ".join(sorted(by_env_name)) or "none"
                message = f"names no {section[:-1]} of the spec (known: {known}; '-' is '_')"
                unknown.append(Problem(f"env {var}", None, None, f"{section}.{env_key}", message))
                continue
            if _depth(values) > MAX_DEPTH:
                message = f"nested more than {MAX_DEPTH} deep; a spec needs 6"
                unknown.append(Problem(f"env {var}", None, None, f"{section}.{env_key}", message))
                continue
            if not isinstance(values, dict) or not isinstance(table[name], dict):
                table[name] = values
                origins[(section, name)] = var
                continue
            _merge(table[name], values, (section, name), keys, origins)
    return data, origins, unknown


def _unshared(data: Any) -> Any:
    """A copy in which no two paths share an object (an alias's value is written out
    at each use), so an override of one path changes that path alone. The document's
    size is bounded (lanes.specyaml), and so is this copy."""
    if isinstance(data, dict):
        return {key: _unshared(value) for key, value in data.items()}
    if isinstance(data, list):
        return [_unshared(item) for item in data]
    return data


def _depth(value: Any) -> int:
    """How deep `value` nests, counted without recursion (an override is any JSON)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth <= MAX_DEPTH and isinstance(item, dict | list):
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return deepest


def _merge(
    target: dict[str, Any],
    values: dict[str, Any],
    loc: Loc,
    keys: tuple[str, ...],
    origins: dict[Loc, str],
) -> None:
    # `keys` are the override's keys as the environment spells them; the variable to
    # name is the one that set them, which may be a parent holding JSON (set_by).
    for key, value in values.items():
        child, child_keys = (*loc, key), (*keys, str(key))
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value, child, child_keys, origins)
        else:
            target[key] = value
            origins[child] = set_by(child_keys)[0]


def _problems(found: Found, source: str, marks: Marks, origins: dict[Loc, str]) -> list[Problem]:
    problems = []
    for loc, message, at_key in found:
        path = dotted(loc)
        origin = next(
            (origins[loc[:n]] for n in range(len(loc), 0, -1) if loc[:n] in origins), None
        )
        if origin is not None:
            problems.append(Problem(f"env {origin}", None, None, path, _one_line(message)))
            continue
        mark = marks.find(loc, at_key)
        message = _one_line(message) + _overridden_beside(loc, origins)
        problems.append(Problem(source, mark.line, mark.column, path, message))
    problems.sort(key=lambda p: (p.source.startswith("env"), p.line or 0, p.column or 0))
    return problems


def _overridden_beside(loc: Loc, origins: dict[Loc, str]) -> str:
    """For a problem the file shows, the overrides of its workload or model, as the end
    of its message: an override of `mode` may be what makes the file's `batching` wrong,
    which the file alone cannot explain."""
    beside = [
        f"{dotted(where)} from env {variable}"
        for where, variable in origins.items()
        if len(loc) >= 2 and where[:2] == loc[:2]
    ]
    return f" (with {', '.join(beside)})" if beside else ""


def _one_line(message: str, limit: int = 500) -> str:
    # One problem per line: a handler's import error may carry its own newlines, a
    # template's message the whole template.
    line = " ".join(message.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."
