"""infra/images: the Dockerfiles, parsed (these machines run no containers), and the
extras they install, checked against pyproject.toml; and `lanes serve` run with only
what the serve extra brings (prefect, torch and the offline packages cannot import).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import httpx
import pytest
from dockerfile_parse import DockerfileParser

from lanes.digests import SEAL_SUFFIX, model_key
from lanes.settings import Settings
from lanes.specfile import load_spec
from tests.flows_fixtures import DIM, embed_model
from tests.servers import free_port

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "infra" / "images"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# What the serving image must not hold, and what only the offline lane needs.
NOT_SERVING = ("torch", "prefect", "prefect_dask", "dask", "distributed", "boto3", "pyarrow")


def _parsed(name: str) -> DockerfileParser:
    return DockerfileParser(path=str(IMAGES / name))


def _instructions(parser: DockerfileParser, stage: str) -> list[tuple[str, str]]:
    """(instruction, value) of one stage, from its FROM to the next FROM."""
    found: list[tuple[str, str]] = []
    inside = False
    for item in parser.structure:
        if item["instruction"] == "FROM":
            inside = item["value"].split()[-1] == stage
            continue
        if inside and item["instruction"] != "COMMENT":
            found.append((item["instruction"], item["value"]))
    return found


def _closure(extra: str) -> set[str]:
    """Every requirement name an extra of lanes pulls in, following `lanes[...]`."""
    extras = PYPROJECT["project"]["optional-dependencies"]
    names: set[str] = set()
    pending = [extra]
    seen: set[str] = set()
    while pending:
        current = pending.pop()
        if current in seen:
            continue
        seen.add(current)
        for requirement in extras[current]:
            inner = re.match(r"lanes\[([\w,]+)\]", requirement)
            if inner:
                pending += inner.group(1).split(",")
            else:
                names.add(re.split(r"[\[<>=~;! ]", requirement, maxsplit=1)[0].lower())
    return names | {
        re.split(r"[\[<>=~;! ]", r, maxsplit=1)[0].lower()
        for r in PYPROJECT["project"]["dependencies"]
    }


@pytest.mark.parametrize(
    ("dockerfile", "stage", "extra", "ports"),
    [
        ("serve.Dockerfile", "serve", "serve,batch", {"8000"}),
        ("worker.Dockerfile", "worker", "worker", {"8786", "8787"}),
    ],
)
def test_each_image_installs_its_extra_as_non_root_on_the_cuda_base(
    dockerfile: str, stage: str, extra: str, ports: set[str]
) -> None:
    parser = _parsed(dockerfile)
    default_base = re.search(r"^ARG BASE=(\S+)$", parser.content, re.M)
    assert default_base is not None, "a BASE build argument with a default"
    base = default_base.group(1)
    assert re.fullmatch(r"nvidia/cuda:13\.\d+\.\d+-cudnn-runtime-ubuntu\d+\.\d+", base), base
    # Every stage starts from that base (or from a stage of this file).
    stages = [s["value"].split() for s in parser.structure if s["instruction"] == "FROM"]
    assert all(words[0] in ("${BASE}", stage) for words in stages), stages

    runs = [v for i, v in _instructions(parser, "build") if i == "RUN"]
    installs = [r for r in runs if "pip install" in r]
    assert installs == [f'/opt/lanes/bin/pip install --no-cache-dir ".[{extra}]"'], installs
    assert not any(
        "torch" in line for line in parser.content.splitlines() if not line.startswith("#")
    )

    final = _instructions(parser, stage)
    users = [v for i, v in final if i == "USER"]
    assert users and users[-1] not in ("0", "root"), users
    assert "useradd --uid " + users[-1] in " ".join(v for i, v in final if i == "RUN")
    exposed = {p for i, v in final if i == "EXPOSE" for p in v.split()}
    assert exposed == ports
    healthchecks = [v for i, v in final if i == "HEALTHCHECK"]
    assert len(healthchecks) == 1 and "CMD" in healthchecks[0]


def test_the_serving_image_bakes_models_in_its_last_stage_and_mounts_them_in_serve() -> None:
    parser = _parsed("serve.Dockerfile")
    assert parser.baseimage == "serve"  # the default target: serve-baked, FROM serve
    baked = _instructions(parser, "serve-baked")
    assert baked[0] == ("COPY", "--chown=10001:10001 .lanes/models/ .lanes/models/")
    assert not any(".lanes" in v for i, v in _instructions(parser, "serve") if i == "COPY")
    healthcheck = next(v for i, v in _instructions(parser, "serve") if i == "HEALTHCHECK")
    assert "/healthz" in healthcheck
    entry = next(v for i, v in _instructions(parser, "serve") if i == "ENTRYPOINT")
    command = next(v for i, v in _instructions(parser, "serve") if i == "CMD")
    assert json.loads(entry) + json.loads(command) == ["lanes", "serve", "/app/workloads.yaml"]


def test_the_baked_image_seals_its_models_so_a_pod_hashes_none(tmp_path: Path) -> None:
    """The serve-baked stage's RUN, run here on a copy of its /app with the serving
    image's packages only: afterwards a pod's empty LANES_HOME finds every model file's
    digest in its seal (the files' bytes are swapped, size and mtime kept, so a digest
    read from them would differ)."""
    runs = [v for i, v in _instructions(_parsed("serve.Dockerfile"), "serve-baked") if i == "RUN"]
    (run,) = runs
    seal, _, cleanup = run.partition(" && ")
    argv = shlex.split(seal.replace("/app/", f"{tmp_path}/"))
    assert argv[0] == "lanes" and cleanup == "rm -rf /tmp/lanes"
    spec = _embed_spec(tmp_path)
    settings = Settings(home=tmp_path / "before")
    before = model_key(
        load_spec(spec, settings), load_spec(spec, settings).workload("search"), settings
    )
    code = _BLOCKED_CLI.format(blocked=NOT_SERVING, argv=argv)
    env = {**os.environ, "LANES_HOME": str(tmp_path / "build")}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    for path in (tmp_path / "models").rglob("*"):
        if path.is_file() and not path.name.endswith(SEAL_SUFFIX):
            info = path.stat()
            path.write_bytes(bytes(b ^ 0xFF for b in path.read_bytes()))
            os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))
    pod = Settings(home=tmp_path / "pod")
    spec_in_pod = load_spec(spec, pod)
    assert model_key(spec_in_pod, spec_in_pod.workload("search"), pod) == before


def _image_extras(dockerfile: str) -> list[str]:
    """The extras the image's one `pip install ".[...]"` names."""
    runs = [v for i, v in _instructions(_parsed(dockerfile), "build") if i == "RUN"]
    (install,) = [re.search(r'"\.\[([\w,]+)\]"', r) for r in runs if "pip install" in r]
    assert install is not None
    return install.group(1).split(",")


# What the serving image holds none of: the rest of the offline lane, and torch.
NOT_IN_SERVING_IMAGE = tuple(m for m in NOT_SERVING if m not in ("prefect", "boto3"))

# The Batch API asked for a batch, in a process where `blocked` cannot import.
_BATCH_CREATE = """
import json, sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, Refuse())
from lanes.batches import Batches
from lanes.batchstore import new_id
from lanes.errors import NotConfigured
from lanes.settings import Settings
from lanes.specfile import load_spec
batches = Batches(load_spec({spec!r}), Settings())
line = {{"custom_id": "a", "method": "POST", "url": "/v1/embeddings",
        "body": {{"model": "search", "input": "x"}}}}
uploaded = batches.store.put_file(new_id("file"), "in.jsonl", "batch",
                                  iter([json.dumps(line).encode() + b"\\n"]))
try:
    batches.create({{"input_file_id": uploaded.id, "endpoint": "/v1/embeddings",
                    "completion_window": "24h"}})
except NotConfigured as e:
    print(e)
"""


def test_the_serving_image_holds_what_its_batch_api_needs(tmp_path: Path) -> None:
    """The rendered serving pods take PREFECT_API_URL for the Batch API: their image
    installs the extra that brings Prefect's client and boto3 (not the rest of the
    offline lane), and in a process holding only what it installs, a batch gets past
    the missing-package check to the Prefect API's (none is configured here). Where
    prefect is missing, the answer names that same extra."""
    extras = _image_extras("serve.Dockerfile")
    installed = set().union(*(_closure(e) for e in extras))
    assert {"prefect", "boto3"} <= installed
    assert not installed & {"torch", "pyarrow", "prefect-dask", "dask", "prefect-kubernetes"}
    spec = _embed_spec(tmp_path)
    env = {**os.environ, "LANES_HOME": str(tmp_path / "home")}
    env.pop("PREFECT_API_URL", None)
    env.pop("LANES_PREFECT_API_URL", None)
    env["LANES_BATCH__STORE"] = str(tmp_path / "store")
    answers = {}
    for blocked in (NOT_IN_SERVING_IMAGE, NOT_SERVING):
        code = _BATCH_CREATE.format(blocked=blocked, spec=str(spec))
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
        )
        assert done.returncode == 0, done.stderr[-2000:]
        answers[blocked] = done.stdout
    assert "PREFECT_API_URL" in answers[NOT_IN_SERVING_IMAGE]
    assert "has no Prefect" not in answers[NOT_IN_SERVING_IMAGE]
    assert f"pip install 'lanes[{','.join(extras)}]'" in answers[NOT_SERVING]


def test_the_serve_extra_holds_neither_torch_nor_prefect_and_dev_holds_every_lane() -> None:
    serving = _closure("serve")
    assert not serving & {"torch", "prefect", "prefect-dask", "boto3", "pyarrow"}, serving
    assert {"onnxruntime-gpu", "starlette", "uvicorn", "prometheus-client"} <= serving
    assert {"prefect", "prefect-dask", "prefect-kubernetes", "boto3"} <= _closure("worker")
    assert "torch" not in _closure("worker")
    # `make up` and `make test` install .[dev]: both lanes and the model build.
    assert {"prefect", "starlette", "torch", "onnxruntime-gpu"} <= _closure("dev")


_SCHEDULES = """
from lanes.schedule import Schedule
from lanes.settings import Settings
print(Settings().offpeak.timezone, Schedule(cron="0 2 * * *", timezone="Europe/Berlin").timezone)
"""


def test_every_install_reads_time_zones_where_the_system_has_no_database(
    tmp_path: Path,
) -> None:
    """zoneinfo falls back to the tzdata wheel where the system has no IANA database
    (a container image without the OS's tzdata package). Prefect pulled tzdata in
    through pendulum on Python < 3.13 only, and never in lanes[serve]: there, loading the
    settings failed on their default off-peak time zone, "UTC"."""
    core = {
        re.split(r"[\[<>=~;! ]", r, maxsplit=1)[0] for r in PYPROJECT["project"]["dependencies"]
    }
    assert "tzdata" in core
    # An empty PYTHONTZPATH folder stands in for a system without a time zone database.
    env = {**os.environ, "PYTHONTZPATH": str(tmp_path), "LANES_HOME": str(tmp_path / "home")}
    done = subprocess.run(
        [sys.executable, "-c", _SCHEDULES], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["UTC", "Europe/Berlin"]


# A finder that refuses the offline lane's packages and torch, as in the serving image.
_BLOCKED_SERVE = """
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (not in lanes[serve])", name=name)
        return None
sys.meta_path.insert(0, Refuse())
from lanes.router.cli import main
sys.argv = ["lanes", "serve", {spec!r}, "--port", "{port}"]
main()
"""


# The same finder, then any `lanes` command line.
_BLOCKED_CLI = _BLOCKED_SERVE.split("sys.argv")[0] + "sys.argv = {argv!r}\nmain()\n"


def _embed_spec(folder: Path) -> Path:
    """A spec of one interactive embed workload `search` on a tiny test encoder."""
    model, tokenizer = embed_model(folder / "models" / "enc")
    path = folder / "workloads.yaml"
    path.write_text(
        f"version: 1\nmodels:\n  enc: {{path: {model}, tokenizer: {tokenizer}}}\n"
        "workloads:\n  search: {mode: interactive, task: embed, model: enc}\n"
    )
    return path


@pytest.mark.slow
def test_lanes_serve_runs_on_the_serve_extra_alone(tmp_path: Path) -> None:
    spec = _embed_spec(tmp_path)
    port = free_port()
    code = _BLOCKED_SERVE.format(blocked=NOT_SERVING, spec=str(spec), port=port)
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        process = subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=out)
    try:
        ready: dict[str, Any] = {}
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
            for _ in range(600):  # up to ~60 s for the process to start and load
                if process.poll() is not None:
                    break
                try:
                    answer = client.get("/readyz")
                except httpx.TransportError:
                    answer = None
                if answer is not None and answer.status_code == 200:
                    ready = answer.json()
                    break
                time.sleep(0.1)
            assert ready.get("ready") is True, log.read_text()[-2000:]
            embedded = client.post("/v1/embeddings", json={"model": "search", "input": "hello"})
            assert embedded.status_code == 200, embedded.text
            assert len(embedded.json()["data"][0]["embedding"]) == DIM
    finally:
        process.terminate()
        process.wait(timeout=60)
    assert "not in lanes[serve]" not in log.read_text()


def test_a_command_whose_extra_is_missing_says_which_to_install(tmp_path: Path) -> None:
    spec = _embed_spec(tmp_path)
    code = _BLOCKED_SERVE.format(blocked=("starlette",), spec=str(spec), port=free_port())
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "needs lanes[serve]" in done.stderr and "pip install 'lanes[serve]'" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("dockerfile", "stage"), [("serve.Dockerfile", "serve"), ("worker.Dockerfile", "worker")]
)
def test_each_image_carries_the_project_with_its_handler_modules(
    dockerfile: str, stage: str
) -> None:
    """/app is the project as it stands beside workloads.yaml (a `handler: myhooks:handler`
    imports myhooks.py from there), less the models and lanes' own source; the build
    context leaves out the virtualenv, local state and data."""
    parser = _parsed(dockerfile)
    project = _instructions(parser, "project")
    assert project == [("WORKDIR", "/app"), ("COPY", ". ."), ("RUN", "rm -rf .lanes lanes")]
    copies = [v for i, v in _instructions(parser, stage) if i == "COPY"]
    assert copies[-1] == "--from=project --chown=10001:10001 /app/ ./", copies
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    assert {".venv", ".git", ".lanes/*", "!.lanes/models", "data"} <= set(ignored)
