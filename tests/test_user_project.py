"""A user's own project, driven through every command as a person would drive it.

The project lives in a temporary folder: its workloads.yaml, its own handler module
(`myhooks.py`) beside it, and its own `flows/`, `serving/` and `router/` packages, which
the hooks import. Installed, lanes owns only the import name `lanes`, and puts the
spec's folder on the import path itself, so every command finds the user's code without
PYTHONPATH, and the user's packages never shadow lanes (nor lanes the user's):

- `lanes validate`, `predict`, `serve`, `run` through the console script, from another
  folder, and `python -m lanes.router.cli` from inside the project (the project folder
  first on sys.path, as for a Prefect worker);
- `lanes deploy` to a real Prefect server, and a real process worker's flow run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.flows_fixtures import (
    WORDS,
    outputs_of,
    wait_until,
    write_jsonl,
    write_spec,
)
from tests.prefect_server import PREFECT, PrefectServer, call_api
from tests.servers import free_port

pytestmark = pytest.mark.slow

LANES = str(Path(sys.executable).parent / "lanes")  # the console script of this venv
TAG = "made-by-the-users-flows-package"
WORD = "w7"
FACTOR = 3.0

HOOKS = '''\
"""The user's hooks, built on the user's own flows/, serving/ and router/ packages."""
from flows.tags import TAG
from router.words import WORD
from serving.scale import FACTOR


class Scale:
    def pre(self, item):
        return {"x": [[v * FACTOR for v in row] for row in item["x"]]}

    def post(self, output):
        return {"y": output["y"].tolist(), "tag": TAG}


class Words:
    @staticmethod
    def pre(text):
        return WORD


def no_d(text):
    return "d" in text.split()


scale = Scale()
words = Words()
'''

PACKAGES = {
    "flows/__init__.py": '"""The user\'s own flows package (a Prefect project usually has one)."""\n',
    "flows/tags.py": f"TAG = {TAG!r}\n",
    "serving/__init__.py": "",
    "serving/scale.py": f"FACTOR = {FACTOR}\n",
    "router/__init__.py": "",
    "router/words.py": f"WORD = {WORD!r}\n",
}

WORKLOADS: dict[str, dict[str, Any]] = {
    "lookup": {"mode": "interactive", "task": "embed", "model": "enc", "handler": "myhooks:words"},
    "scale": {
        "mode": "interactive",
        "task": "infer",
        "model": "affine",
        "handler": "myhooks:scale",
    },
    "chat": {
        "mode": "interactive",
        "task": "generate",
        "model": "dec",
        "generation": {"temperature": 0, "max_new_tokens": 8},
        "guard": {"handler": "myhooks:no_d"},
    },
    "nightly": {
        "mode": "offline",
        "task": "infer",
        "model": "affine",
        "handler": "myhooks:scale",
        "input": "in/",
        "output": "out/",
        "retries": 0,
    },
}


@pytest.fixture
def project(tmp_path: Path) -> Path:
    folder = tmp_path / "project"
    write_spec(folder, WORKLOADS)
    (folder / "myhooks.py").write_text(HOOKS)
    for name, source in PACKAGES.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(source)
    records = [{"id": f"r{i}", "x": [[i, 1.0, 2.0, 3.0]]} for i in range(6)]
    write_jsonl(folder / "in" / "part-0.jsonl", records)
    return folder


@pytest.fixture
def elsewhere(tmp_path: Path) -> Path:
    """A working folder that is not the project: nothing of the user's is on sys.path."""
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    return folder


def environment(**extra: str) -> dict[str, str]:
    env = {**os.environ, **extra}
    # The test's own settings must not leak into the commands it drives.
    for name in [n for n in env if n.startswith("LANES_")]:
        del env[name]
    return env


def lanes(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [LANES, *args],
        cwd=cwd,
        env=env or environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, (
        f"lanes {args} failed ({done.returncode}):\n{done.stdout}{done.stderr}"
    )
    return done.stdout


def expected_y(row: list[float]) -> list[float]:
    return [2 * v * FACTOR + 1 for v in row]


def test_validate_imports_the_users_handlers_and_names_the_line(
    project: Path, elsewhere: Path
) -> None:
    spec = project / "workloads.yaml"
    assert "ok (4 workloads)" in lanes(["validate", str(spec)], elsewhere)
    # From inside the project, its own flows/ is first on sys.path: lanes is not shadowed.
    inside = subprocess.run(
        [sys.executable, "-m", "lanes.router.cli", "validate"],
        cwd=project,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert inside.returncode == 0, inside.stderr

    text = spec.read_text()
    broken = text.replace("myhooks:words", "myhooks:wordz").replace("myhooks:no_d", "nohooks:no_d")
    spec.write_text(broken)
    done = subprocess.run(
        [LANES, "validate", str(spec)],
        cwd=elsewhere,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    lines = broken.splitlines()
    handler_line = next(n for n, line in enumerate(lines, 1) if "myhooks:wordz" in line)
    guard_line = next(n for n, line in enumerate(lines, 1) if "nohooks:no_d" in line)
    problems = done.stderr.splitlines()
    assert any(
        p.startswith(f"{spec}:{handler_line}:")
        and "workloads.lookup.handler: handler myhooks:wordz: module 'myhooks' has no attribute"
        in p
        for p in problems
    ), done.stderr
    assert any(
        p.startswith(f"{spec}:{guard_line}:")
        and "workloads.chat.guard.handler: guard nohooks:no_d: cannot import module 'nohooks'" in p
        for p in problems
    ), done.stderr
    assert problems[-1] == "2 problems found"


def test_predict_serve_and_run_use_the_users_code(project: Path, elsewhere: Path) -> None:
    spec = project / "workloads.yaml"
    predicted = json.loads(
        lanes(["predict", "scale", "-i", '{"x": [[1, 2, 3, 4]]}', "-f", str(spec)], elsewhere)
    )
    assert predicted == {"y": [expected_y([1, 2, 3, 4])], "tag": TAG}

    port = free_port()
    server = subprocess.Popen(
        [LANES, "serve", str(spec), "--port", str(port)],
        cwd=elsewhere,
        env=environment(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _ready(url, server), 120, "lanes serve ready")
        with httpx.Client(base_url=url, timeout=30) as client:
            answer = client.post("/v1/embeddings", json={"model": "lookup", "input": "anything"})
            assert answer.status_code == 200, answer.text
            vector = np.array(answer.json()["data"][0]["embedding"])
            table = np.random.default_rng(0).normal(size=(len(WORDS), 8))
            ids = [WORDS.index(t) for t in ("[CLS]", WORD, "[SEP]")]
            mean = table[ids].mean(axis=0)
            np.testing.assert_allclose(vector, mean / np.linalg.norm(mean), atol=1e-5)

            infer = client.post(
                "/v2/models/scale/infer",
                json={
                    "inputs": [
                        {"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}
                    ]
                },
            )
            assert infer.status_code == 200, infer.text
            outputs = {o["name"]: o for o in infer.json()["outputs"]}
            assert outputs["tag"]["data"] == [TAG]
            assert outputs["y"]["data"] == expected_y([1, 2, 3, 4])

            completion = client.post(
                "/v1/completions", json={"model": "chat", "prompt": "a", "max_tokens": 8}
            )
            assert completion.status_code == 200, completion.text
            assert completion.json()["choices"][0]["finish_reason"] == "content_filter"
    finally:
        server.terminate()
        _, stderr = server.communicate(timeout=60)
    assert "Traceback" not in stderr, stderr

    # From inside the project, as a Prefect worker would run it.
    done = subprocess.run(
        [sys.executable, "-m", "lanes.router.cli", "run", "nightly"],
        cwd=project,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    _check_outputs(project / "out")


def _ready(url: str, server: subprocess.Popen[str]) -> bool:
    if server.poll() is not None:
        raise AssertionError(f"lanes serve exited: {server.stderr.read() if server.stderr else ''}")
    try:
        return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def _check_outputs(out: Path) -> None:
    lines = sorted(outputs_of(out), key=lambda line: line["id"])
    assert [line["id"] for line in lines] == [f"r{i}" for i in range(6)]
    for i, line in enumerate(lines):
        assert line["tag"] == TAG
        assert line["y"] == [expected_y([i, 1.0, 2.0, 3.0])]


@pytest.fixture
def prefect_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    with PrefectServer(tmp_path / "prefect-home") as server:
        yield environment(**server.wait())


def test_prefect_deploy_and_a_worker_run_the_users_code(
    project: Path, elsewhere: Path, prefect_env: dict[str, str]
) -> None:
    spec = project / "workloads.yaml"
    lanes(["deploy", str(spec)], elsewhere, prefect_env)
    run = subprocess.run(
        [*PREFECT, "deployment", "run", "lanes-offline/nightly"],
        cwd=elsewhere,
        env=prefect_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    worker = subprocess.run(
        [*PREFECT, "worker", "start", "--pool", "lanes", "--run-once"],
        cwd=elsewhere,
        env=prefect_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert worker.returncode == 0, worker.stdout + worker.stderr
    api = prefect_env["PREFECT_API_URL"]
    runs = call_api("POST", f"{api}/flow_runs/filter", json={}).json()
    # The run we started; the others are the off-peak schedule's, still in the future.
    states = sorted(r["state_type"] for r in runs if r["state_type"] != "SCHEDULED")
    assert states == ["COMPLETED"], worker.stdout + worker.stderr
    _check_outputs(project / "out")
    shutil.rmtree(project / "out")
