"""The offline lane on a real Dask cluster: a `dask scheduler` and two `dask worker`
processes on 127.0.0.1, started as a deployment would start them, and a job whose
`runner: {kind: dask, address: ...}` names the scheduler. Its shards spread over both
workers, its output equals the local runner's byte for byte, and a worker killed while
it holds a shard (at a gate, not a timing window) loses nothing: the shard reruns on
the other worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from lanes.flows.batch import offline
from tests.dask_hooks import HELD_FROM, SHARD_LOG_ENV, WORKER_NAME_ENV, started
from tests.flows_fixtures import errors_of, outputs_of, wait_until, write_jsonl, write_spec
from tests.gates import GATE_FILE_ENV
from tests.servers import free_port

ROOT = Path(__file__).resolve().parent.parent
DASK = [sys.executable, "-m", "dask"]
SHARDS = 6
START_S = 120  # a process that imports prefect and lanes on a busy 2-core machine


class DaskCluster:
    """`dask scheduler` and named `dask worker` processes, each in a session of its own
    so that killing one kills its nanny and its worker process together."""

    def __init__(self, folder: Path, env: dict[str, str]) -> None:
        self.folder = folder
        self.env = env
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, workers: list[str]) -> None:
        port = self.address.rsplit(":", 1)[1]
        self._spawn(
            "scheduler", ["scheduler", "--host", "127.0.0.1", "--port", port, "--no-dashboard"]
        )
        for name in workers:
            self._spawn(
                name,
                [
                    "worker", self.address, "--name", name, "--nworkers", "1", "--nthreads", "1",
                    "--no-dashboard", "--local-directory", str(self.folder / name),
                ],
                {WORKER_NAME_ENV: name},
            )  # fmt: skip

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        with (self.folder / f"{name}.log").open("wb") as log:
            self.processes[name] = subprocess.Popen(
                [*DASK, *args],
                cwd=ROOT,
                env={**self.env, **(env or {})},
                stdout=log,
                stderr=log,
                start_new_session=True,
            )

    def workers(self) -> set[str]:
        """Names of the workers the scheduler has now."""
        from distributed import Client

        with Client(self.address, timeout=30) as client:
            return {str(w["name"]) for w in client.scheduler_info()["workers"].values()}

    def kill(self, name: str) -> None:
        process = self.processes[name]
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text()[-1500:]}" for p in self.folder.glob("*.log"))


@pytest.fixture
def cluster(prefect_api: str, tmp_path: Path) -> Iterator[DaskCluster]:
    folder = tmp_path / "dask"
    folder.mkdir()
    env = {
        **os.environ,
        # The workers run Prefect task runs: they report to the flow's API.
        "PREFECT_API_URL": prefect_api,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        GATE_FILE_ENV: str(tmp_path / "gate-open"),
        SHARD_LOG_ENV: str(tmp_path / "shards"),
    }
    running = DaskCluster(folder, env)
    try:
        yield running
    finally:
        running.stop()


@pytest.mark.slow
def test_a_job_on_a_two_worker_cluster_survives_a_killed_worker(
    cluster: DaskCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    handler = "tests.dask_hooks:where_shards_run"
    runner = {"kind": "dask", "address": cluster.address, "max_concurrent_shards": 2}
    spec = write_spec(
        tmp_path,
        {
            "local": {
                "mode": "offline", "task": "infer", "model": "affine", "input": "in/",
                "output": "out-local/", "batch_size": 4, "retries": 0, "handler": handler,
            },
            "cluster": {
                "mode": "offline", "task": "infer", "model": "affine", "input": "in/",
                "output": "out-cluster/", "batch_size": 4, "retries": 0, "handler": handler,
                "runner": runner,
            },
        },
    )  # fmt: skip
    ids = []
    for shard in range(SHARDS):
        records = [{"id": f"s{shard}-{i}", "x": [[i, shard, 0, 0]]} for i in range(10)]
        ids += [r["id"] for r in records]
        write_jsonl(tmp_path / "in" / f"part-{shard}.jsonl", records)
    log = tmp_path / "shards"
    log.mkdir()
    gate = tmp_path / "gate-open"  # closed: shards from HELD_FROM on wait in their worker

    cluster.start(["w1", "w2"])
    wait_until(lambda: cluster.workers() == {"w1", "w2"}, START_S, "both workers joined")
    code = f"from lanes.flows.batch import offline; print(offline(workload='cluster', spec={str(spec)!r}))"
    with (tmp_path / "flow.log").open("wb") as flow_log:
        flow = subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env=cluster.env,
            stdout=flow_log,
            stderr=flow_log,
        )
    try:
        # Two shards from HELD_FROM on started, one per worker: each holds its thread.
        def held() -> list[tuple[int, str]]:
            return [(s, w) for s, w in started(log) if s >= HELD_FROM]

        wait_until(lambda: len(held()) == 2, START_S, f"two shards held ({cluster.logs()})")
        before_kill = started(log)
        holders = {w for _, w in held()}
        assert holders == {"w1", "w2"}, before_kill
        assert {w for s, w in before_kill if s < HELD_FROM} <= {"w1", "w2"}
        killed_shard = next(s for s, w in held() if w == "w2")

        cluster.kill("w2")
        wait_until(lambda: cluster.workers() == {"w1"}, START_S, "the scheduler dropped w2")
        gate.touch()
        flow.wait(timeout=300)
    finally:
        if flow.poll() is None:
            flow.kill()
            flow.wait(timeout=30)
    assert flow.returncode == 0, (tmp_path / "flow.log").read_text()[-3000:] + cluster.logs()

    after = started(log)
    # The shard w2 held when it died ran again on w1; every later shard ran on w1.
    assert (killed_shard, "w1") in after and (killed_shard, "w2") in after
    assert {w for s, w in after if (s, "w2") not in before_kill and s != killed_shard} == {"w1"}
    seen = Counter(line["id"] for line in outputs_of(tmp_path / "out-cluster"))
    assert sorted(seen) == sorted(ids) and set(seen.values()) == {1}
    assert errors_of(tmp_path / "out-cluster") == []

    # The local runner, on the same input (gate open), writes the same bytes.
    monkeypatch.setenv(GATE_FILE_ENV, str(gate))
    monkeypatch.setenv(SHARD_LOG_ENV, str(log))
    local = offline(workload="local", spec=str(spec))
    assert local["outputs"] == len(ids)
    for shard in range(SHARDS):
        name = f"part-{shard}.jsonl"
        assert (tmp_path / "out-cluster" / name).read_bytes() == (
            tmp_path / "out-local" / name
        ).read_bytes(), name
