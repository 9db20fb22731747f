"""No spec hurts the loader: mutated workloads.yaml files either load, and then work in
every command that reads them, or fail with SpecError, one line per problem.

The seeds are the demo workloads.yaml and test_spec's GOOD; the mutations are what
broke the loader before (a mapping where a name goes, deep nesting, aliases, tags,
huge numbers, long names, bytes that are not UTF-8) and plain damage (a key deleted,
duplicated or renamed, a value of another type, a line cut short).
"""

from __future__ import annotations

import copy
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lanes.errors import Problem, SpecError
from lanes.router.plan import endpoints, plan
from lanes.settings import Settings
from lanes.spec import OfflineWorkload, Spec
from lanes.specfile import load_spec
from tests.test_spec import GOOD

# Hypothesis warns when the global `random` state moves while it draws an example. With
# test files side by side in one process (pytest-xdist), a server thread left by an
# earlier file (Prefect's client, uvicorn) may draw from it meanwhile: not our strategies.
pytestmark = pytest.mark.filterwarnings("ignore:Do not use the `random` module inside strategies")

ROOT = Path(__file__).resolve().parent.parent
DEMO = (ROOT / "workloads.yaml").read_text()
SEEDS = [yaml.safe_load(DEMO), yaml.safe_load(GOOD)]
# Files the seeds name, made empty in the spec's folder so that a mutant can pass.
FILES = [
    ".lanes/models/minilm/model.onnx",
    ".lanes/models/minilm/tokenizer.json",
    ".lanes/models/tinycode/model.onnx",
    ".lanes/models/tinycode/tokenizer.json",
    ".lanes/models/classifier/model.onnx",
    "enc.onnx",
    "tok.json",
    "clf.onnx",
]

WORDS = [
    "interactive",
    "offline",
    "embed",
    "generate",
    "infer",
    "minilm",
    "enc",
    "clf",
    "dask",
    "local",
    "UTC",
    "Europe/Paris",
    "0 2 * * *",
    "* * 31 2 *",
    "0 0 30 2 *",
    "61 1 * * *",
    "lanes.demo.labels:handler",
    "missing_module:handler",
    "data/corpus/",
    "s3://bucket/prefix/",
    "../../../etc",
    "{subject}\n\n{body}",
    "{open",
    "a" * 300,
    "x/" * 2100,
    "\x00",
    "é\u202e\U0001f600",
]
BIG_INTS = st.one_of(st.integers(10**17, 10**30), st.integers(-(10**30), -(10**17)))
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 70_000),
    BIG_INTS,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.text(min_size=256, max_size=5000),
    st.sampled_from(WORDS),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.sampled_from(WORDS), st.text(max_size=10)), inner, max_size=4),
    ),
    max_leaves=12,
)
TAGS = ["!!binary", "!!set", "!!omap", "!!python/name:os.getcwd", "!mine", "!!timestamp", "!!int"]


def _paths(data: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [at]
    if isinstance(data, dict):
        for key, value in data.items():
            found += _paths(value, (*at, key))
    elif isinstance(data, list):
        for index, item in enumerate(data):
            found += _paths(item, (*at, index))
    return found


def _parent(data: Any, path: tuple[Any, ...]) -> Any:
    for part in path[:-1]:
        data = data[part]
    return data


@st.composite
def data_mutant(draw: st.DrawFn) -> Any:
    """A seed with one to three structural changes."""
    data = copy.deepcopy(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(data) if p]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = _parent(data, path)
        action = draw(st.sampled_from(["delete", "replace", "rename", "add", "nest"]))
        if action == "delete":
            del parent[path[-1]]
        elif action == "replace":
            parent[path[-1]] = draw(VALUES)
        elif action == "rename" and isinstance(parent, dict):
            parent[draw(st.sampled_from(WORDS))] = parent.pop(path[-1])
        elif action == "add" and isinstance(parent, dict):
            # Keys of either mode on any workload, and plain noise.
            key = draw(
                st.sampled_from(["batching", "slo", "stream", "batch_size", "retries", "runner"])
                | st.sampled_from(
                    ["schedule", "input", "fields", "max_error_rate", "guard", "truncate"]
                )
                | st.text(max_size=12)
            )
            parent[key] = draw(VALUES)
        elif action == "nest":
            value: Any = draw(SCALARS)
            for _ in range(draw(st.integers(5, 60))):
                value = [value] if draw(st.booleans()) else {"k": value}
            parent[path[-1]] = value
    return data


def _bomb(levels: int, width: int) -> str:
    lines = [f"l0: &l0 [{', '.join(['lol'] * width)}]"]
    for n in range(1, levels):
        lines.append(f"l{n}: &l{n} [{', '.join([f'*l{n - 1}'] * width)}]")
    return "\n".join(lines) + "\n"


@st.composite
def text_mutant(draw: st.DrawFn) -> bytes:
    """YAML text of a (maybe mutated) seed, then damage no data can express."""
    data = draw(data_mutant()) if draw(st.booleans()) else draw(st.sampled_from(SEEDS))
    text = yaml.safe_dump(data, allow_unicode=True, sort_keys=False, width=10**6)
    lines = text.splitlines(keepends=True)
    action = draw(
        st.sampled_from(["none", "tag", "bomb", "alias", "dup", "cut", "bytes", "indent", "deep"])
    )
    at = draw(st.integers(0, max(0, len(lines) - 1)))
    if action == "tag":
        line = lines[at]
        if ": " in line:
            key, _, value = line.partition(": ")
            lines[at] = f"{key}: {draw(st.sampled_from(TAGS))} {value}"
    elif action == "bomb":
        bomb = _bomb(draw(st.integers(2, 12)), draw(st.integers(2, 12)))
        lines.append(bomb if draw(st.booleans()) else "  " + bomb.replace("\n", "\n  "))
    elif action == "alias":
        line = lines[at]
        if ": " in line:
            key, _, value = line.partition(": ")
            lines[at] = f"{key}: &x {value}"
            lines.append(draw(st.sampled_from(["y: *x\n", "version: *x\n", "x: &y [*y]\n"])))
    elif action == "dup":
        lines.insert(at, lines[at])
    elif action == "cut":
        text = "".join(lines)
        return text[: draw(st.integers(0, len(text)))].encode()
    elif action == "indent":
        lines[at] = draw(st.sampled_from(["\t", " ", "   - "])) + lines[at]
    elif action == "deep":
        depth = draw(st.integers(10, 600))
        lines.append(f"deep: {'[' * depth}{']' * depth}\n")
    raw = "".join(lines).encode()
    if action == "bytes":
        noise = draw(st.binary(min_size=1, max_size=8))
        spot = draw(st.integers(0, len(raw)))
        raw = raw[:spot] + noise + raw[spot:]
    return raw


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("fuzz")
    for name in FILES:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(b"")
    return folder


def _accepted_works(spec: Spec, settings_: Settings) -> None:
    """What serve, run, plan and compile rely on, for a spec the loader accepted."""
    from lanes.flows.compile import deployment

    after = datetime(2026, 3, 1, tzinfo=UTC)
    routes = plan(spec, settings_, after)
    assert [r.workload for r in routes] == list(spec.workloads)
    for model in spec.models.values():
        assert isinstance(model.path, Path)
        model.path.is_file()  # no OSError: the path fits the file system
    for name, workload in spec.workloads.items():
        assert workload.model in spec.models
        if workload.task in ("embed", "generate"):
            assert spec.models[workload.model].tokenizer is not None
        if isinstance(workload, OfflineWorkload):
            assert isinstance(workload.input, str) and isinstance(workload.output, str)
            if workload.schedule is not None:
                upcoming = workload.schedule.next_run(after)
                assert after < upcoming < after + timedelta(days=366 * 9)
            deployment(name, workload, settings_, "workloads.yaml")
        else:
            endpoints(name, workload)
    spec.model_dump_json()


def _check(folder: Path, raw: bytes) -> None:
    path = folder / "workloads.yaml"
    path.write_bytes(raw)
    settings_ = Settings()
    try:
        spec = load_spec(path, settings_)
    except SpecError as err:
        assert err.problems
        for problem in err.problems:
            assert isinstance(problem, Problem)
            text = str(problem)
            assert "\n" not in text and len(text) < 2000, text
            assert problem.line is None or problem.line >= 1
    else:
        _accepted_works(spec, settings_)


FUZZ = settings(
    max_examples=int(os.environ.get("LANES_FUZZ_EXAMPLES", "200")),
    # Generous: a hang (an alias bomb, a cron searched forever) is what this catches.
    deadline=timedelta(seconds=5),
    derandomize=True,  # the same examples on every run: the suite cannot flake
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)


@FUZZ
@given(raw=text_mutant())
def test_mutated_spec_loads_or_fails_with_spec_error(folder: Path, raw: bytes) -> None:
    _check(folder, raw)


@FUZZ
@given(data=data_mutant())
def test_mutated_data_loads_or_fails_with_spec_error(folder: Path, data: Any) -> None:
    _check(folder, yaml.safe_dump(data, allow_unicode=True, width=10**6).encode())
