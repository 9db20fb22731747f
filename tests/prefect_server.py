"""A real Prefect server for tests: `prefect server start` on 127.0.0.1 at a free port.

SQLite in a PREFECT_HOME of the test's own; the server runs in its own process group,
so stopping it stops its children too. Start it as early as possible and wait for it
as late as possible: it takes 10-30 s to answer on a small, busy machine.

A new database costs ~14 s of CPU in migrations, so each server starts from a copy of
an empty, migrated one, made once per Prefect version under .lanes/prefect-db/.

    with PrefectServer(tmp / "prefect") as server:   # starts it
        env = server.wait()                          # ... healthy; env points at it

`call_api(method, url, ...)` calls its REST API as Prefect's own client does, a 503 tried
again.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import httpx

from tests.servers import free_port

STARTUP_S = 120
# The Prefect API a pytest started by another one reuses (tests/conftest.py: prefect_api).
PREFECT_API_ENV = "LANES_TESTS_PREFECT_API"
# As Prefect's own client: a 503 (its SQLite busy, on a loaded core) is tried again.
API_TRIES = 8
PREFECT = [sys.executable, "-m", "prefect"]  # the CLI of this venv's Prefect
TEMPLATES = Path(__file__).resolve().parent.parent / ".lanes" / "prefect-db"


class PrefectServer:
    """A `prefect server start` subprocess; `env` is the environment pointing at it."""

    def __init__(self, home: Path) -> None:
        home.mkdir(parents=True, exist_ok=True)
        self.home = home
        self.port = free_port()
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        self.env = {
            **os.environ,
            "PREFECT_HOME": str(home),
            "PREFECT_API_URL": self.api_url,
            "DO_NOT_TRACK": "1",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        }
        self.log_path = home / "server.log"
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> PrefectServer:
        self.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        template = migrated_database(self.env)
        if template is not None:
            shutil.copyfile(template, self.home / "prefect.db")
        with self.log_path.open("wb") as log:
            self._process = subprocess.Popen(
                [
                    *PREFECT,
                    "server",
                    "start",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    "--analytics-off",
                ],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait(self, timeout: float = STARTUP_S) -> dict[str, str]:
        """Block until /api/health answers 200; returns `env`."""
        assert self._process is not None, "start() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"prefect server exited:\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.api_url}/health", timeout=2).status_code == 200:
                    return self.env
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"prefect server not healthy after {timeout} s: see {self.log_path}")

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


def migrated_database(env: dict[str, str]) -> Path | None:
    """An empty Prefect database with every migration applied (made on first use);
    None if making it failed (the server then migrates a new one itself)."""
    from importlib.metadata import version

    template = TEMPLATES / version("prefect") / "prefect.db"
    if template.is_file():
        return template
    template.parent.mkdir(parents=True, exist_ok=True)
    staging = template.parent / f"staging-{os.getpid()}"
    staging.mkdir(exist_ok=True)
    try:
        done = subprocess.run(
            [*PREFECT, "server", "database", "upgrade", "-y"],
            env={**env, "PREFECT_HOME": str(staging)},
            capture_output=True,
            timeout=STARTUP_S,
        )
        made = staging / "prefect.db"
        if done.returncode != 0 or not made.is_file():
            return None
        os.replace(made, template)  # atomic: a session racing this one is fine
        return template
    except subprocess.TimeoutExpired:
        return None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def call_api(method: str, url: str, **kwargs: object) -> httpx.Response:
    """A call to Prefect's REST API; a 503 is tried again (API_TRIES, backing off up to
    2 s), as Prefect's own client does, and any other error status raised."""
    for attempt in range(API_TRIES):
        answer = httpx.request(method, url, timeout=30, **kwargs)  # type: ignore[arg-type]
        if answer.status_code != 503 or attempt == API_TRIES - 1:
            break
        time.sleep(min(0.25 * 2**attempt, 2.0))
    answer.raise_for_status()
    return answer
