"""`lanes serve`: one uvicorn process hosting every interactive workload."""

from __future__ import annotations

import uvicorn

from lanes import logs
from lanes.serving.app import create_app
from lanes.settings import Settings
from lanes.spec import Spec


def serve(spec: Spec, settings: Settings, host: str | None = None, port: int | None = None) -> None:
    """Serve until SIGINT/SIGTERM; then stop accepting, finish queued work, exit."""
    logs.configure(settings.log_format, settings.log_level, settings.access_log_level)
    config = uvicorn.Config(
        create_app(spec, settings),
        host=host or settings.host,
        port=port if port is not None else settings.port,
        # httptools and uvloop (uvicorn[standard]): a fraction of h11's per-request cost.
        http="auto",
        loop="auto",
        access_log=False,  # lanes.access writes one line per request, with its id
        log_config=None,  # uvicorn's lines go to the root handler, in the same format
        timeout_graceful_shutdown=30,
        log_level=settings.log_level.lower(),
    )
    uvicorn.Server(config).run()
