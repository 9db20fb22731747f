"""Shared fixtures: the demo models (built once, reused from .lanes/models) and real servers."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack
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
    "test_batch_sweep.py",
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
def prefect_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One Prefect API for every in-process flow run of the session (each test worker's
    own): a real `prefect server start` on a copy of a migrated, empty database
    (tests/prefect_server.py), so no session pays the migrations again.

    Its server starts in ~10 s alone, but took ~2 min on a machine shared by several
    test runs: a generous bound, never a wait."""
    from prefect.context import _temporary_global_settings_context, get_settings_context
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.utilities.asyncutils import run_coro_as_sync

    from tests.prefect_server import PREFECT_API_ENV, PrefectServer

    with ExitStack() as stack:
        # A test rerun in a pytest of its own (flows_fixtures.ran_where_modes_bind) uses
        # the API of the session that started it.
        api_url = os.environ.get(PREFECT_API_ENV)
        if api_url is None:
            server = stack.enter_context(PrefectServer(tmp_path_factory.mktemp("prefect-api")))
            server.wait(timeout=300)
            api_url = server.api_url
        with temporary_settings(updates={PREFECT_API_URL: api_url}):
            # As prefect_test_harness does: contexts copied before this one (an event
            # loop's, a thread's) see the server too.
            with _temporary_global_settings_context(get_settings_context()):
                yield api_url
            # Logs and events still queued go out before the server stops.
            run_coro_as_sync(_drain_to_the_api())


async def _drain_to_the_api() -> None:
    """What prefect_test_harness does before it stops its server."""
    import inspect

    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    try:
        logs = APILogWorker.instance().drain()
        if inspect.isawaitable(logs):
            await logs
    except RuntimeError:  # never started: nothing was logged to the API
        pass
    events = EventsWorker.drain_all()
    if inspect.isawaitable(events):
        await events


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
