"""Shared fixtures: the demo models (built once, reused from .lanes/models) and real servers."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.servers import ServerThread

ROOT = Path(__file__).resolve().parent.parent

# Prefect must never phone home, and keeps its state inside the project.
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_HOME", str(ROOT / ".lanes" / "prefect-tests"))
# Prefect creates its home without parents; a fresh clone has no .lanes/ yet.
Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
# Every offline run records its throughput under LANES_HOME (lanes.measurements): the
# tests' runs write to a folder of their own, never to the project's .lanes/.
os.environ["LANES_HOME"] = tempfile.mkdtemp(prefix="lanes-tests-home-")
atexit.register(shutil.rmtree, os.environ["LANES_HOME"], ignore_errors=True)

# The modules that take longest, longest first (from `pytest --durations`): test
# workers (pytest-xdist, `--dist loadfile --no-loadscope-reorder`) take whole modules
# in collection order, so these start first and the short ones fill in behind them,
# instead of a long one starting last while the other workers sit idle. A module
# missing here runs after these, in the usual order; a stale name costs nothing.
LONGEST_FIRST = (
    "test_batch_api.py",
    "test_flows_deploy.py",
    "test_client_jobs.py",
    "test_user_project.py",
    "test_cli.py",
    "test_flows_paths.py",
    "test_backfill.py",
    "test_flows.py",
    "test_dask_cluster.py",
    "test_finish_by_deploy.py",
    "test_offline_errors.py",
    "test_finish_by.py",
    "test_serving_limits.py",
    "test_drain.py",
    "test_spec_fuzz.py",
    "test_serving.py",
    "test_idle_unload.py",
    "test_demo_models.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest modules first (LONGEST_FIRST); within a module, tests keep their order."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable


@pytest.fixture(scope="session")
def demo_models() -> Path:
    """The demo models, built on first use (a couple of minutes) and reused after."""
    from filelock import FileLock

    from lanes.demo.build import build_demo_models

    dest = Path(os.environ.get("LANES_MODELS_DIR", ROOT / ".lanes" / "models"))
    dest.mkdir(parents=True, exist_ok=True)
    # Test workers run side by side (pytest-xdist): one builds, the others wait for it
    # instead of replacing a model folder another worker is reading.
    with FileLock(str(dest / ".build.lock")):
        build_demo_models(dest, progress=False)
    return dest


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[str]:
    """One Prefect API (SQLite, temporary) for every in-process flow run of the session.

    Its server starts in ~10 s alone, but took ~2 min on a machine shared by several
    test runs: a generous bound, never a wait."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    # Generous: on a loaded machine the server has taken over a minute to answer.
    with prefect_test_harness(server_startup_timeout=300):
        yield str(PREFECT_API_URL.value())


@pytest.fixture
def serve() -> Iterator[type[ServerThread]]:
    """Start real uvicorn servers on 127.0.0.1; each is stopped when the test ends."""
    started: list[ServerThread] = []

    class Tracked(ServerThread):
        def __enter__(self) -> ServerThread:
            started.append(self)
            return super().__enter__()

    yield Tracked
    for server in started:
        server.stop()
