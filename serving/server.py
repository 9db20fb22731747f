"""`lanes serve`: one uvicorn process hosting every interactive workload."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable
from types import FrameType

import uvicorn

from lanes import logs
from lanes.errors import InvalidInput, LanesError
from lanes.runtime import Runtime
from lanes.serving.app import create_app
from lanes.settings import Settings
from lanes.spec import Spec

log = logging.getLogger("lanes.serving")

# After the listener closes, how long requests already written on open connections
# have to reach the server before idle connections are closed.
LINGER_S = 0.2
# How long before uvicorn's graceful timeout (which cancels whatever still runs) the
# streams still generating are ended, whole: time for their last events to be written.
EXPIRE_BEFORE_S = 3.0
# uvicorn's grace for the requests in flight once the listener closed; past it, it
# cancels them (infra's terminationGracePeriodSeconds counts on it: router/render_serving.py).
GRACEFUL_S = 30


class DrainingServer(uvicorn.Server):
    """uvicorn's server, stopping as a load balancer needs it to.

    On the first SIGTERM or SIGINT it drains for `drain_s`: `on_drain` turns readiness
    false (a balancer's health check takes the replica out) while every request is
    still served, each answer closing its connection, so no client keeps a connection
    the server is about to close. A server that was not `ready` yet (models still
    loading, or one failed) was never sent traffic by a balancer: it stops at once,
    without a drain, abandoning the loads in progress. Then the listener closes
    (`on_close`: a batch waiting for company runs now, as none can come), requests
    already on their way are read (`LINGER_S`), in-flight and queued work finishes,
    and the app's lifespan stops its workers. A second signal skips what is left of
    the drain.
    Streams still generating `EXPIRE_BEFORE_S` before uvicorn's graceful timeout would
    cancel them are ended then, whole (`on_expire`): a client sees its text so far,
    finish_reason `length` and `[DONE]`, not a connection cut mid-answer.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        drain_s: float,
        on_drain: Callable[[], None],
        on_close: Callable[[], None],
        on_expire: Callable[[], None],
        ready: Callable[[], bool],
    ) -> None:
        super().__init__(config)
        self.drain_s = drain_s
        self.on_drain = on_drain
        self.on_close = on_close
        self.on_expire = on_expire
        self.ready = ready
        self.drain_until: float | None = None
        self._drain_logged = False
        self._stopped_unready = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain_until is None and self.drain_s > 0 and not self.should_exit:
            # Flags and a read of readiness only: safe in a signal handler, unlike logging.
            if self.ready():
                self.drain_until = time.monotonic() + self.drain_s
                self.on_drain()
                return
            self._stopped_unready = True
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.drain_until is not None:
            if not self._drain_logged:
                self._drain_logged = True
                log.info(
                    "draining for %.1f s: /readyz answers 503, requests are still served",
                    self.drain_s,
                )
            if time.monotonic() >= self.drain_until:
                self.should_exit = True
        return await super().on_tick(counter)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        # uvicorn says where it listens only for sockets it bound itself.
        for server in self.servers if self.started else []:
            for sock in server.sockets:
                host, port = sock.getsockname()[:2]
                shown = f"[{host}]" if ":" in host else host
                log.info(
                    "listening on http://%s:%d (SIGINT or SIGTERM drains, then stops)", shown, port
                )

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self._stopped_unready:
            log.info(
                "stopping before every workload was ready: no drain (/readyz never said "
                "ready, so no balancer sent requests here); loads in progress are abandoned"
            )
        for server in self.servers:
            server.close()
        self.on_close()
        # uvicorn closes idle connections at once: first let requests that clients
        # already wrote on them arrive, so that they are answered, not cut off.
        await asyncio.sleep(LINGER_S)
        grace = self.config.timeout_graceful_shutdown
        expiring = None
        if grace is not None:
            when = grace - min(EXPIRE_BEFORE_S, grace / 2)
            expiring = asyncio.get_running_loop().call_later(when, self.on_expire)
        try:
            await super().shutdown(sockets)
        finally:
            if expiring is not None:
                expiring.cancel()


def serve(spec: Spec, settings: Settings, host: str | None = None, port: int | None = None) -> None:
    """Serve until SIGINT/SIGTERM; then drain, stop accepting, finish queued work, exit.
    A spec without an interactive workload is refused (InvalidInput) before listening."""
    if not any(w.mode == "interactive" for w in spec.workloads.values()):
        # Nothing would ever load: a server that listens so is ready at once and
        # answers 404 to every route, which looks like a working deployment.
        raise InvalidInput(
            "nothing to serve: the spec declares no interactive workload; declare one "
            "(`mode: interactive`) to serve it (an offline workload with `runner: {kind: "
            "endpoint}` runs on one), or run offline workloads with `lanes run` or "
            "`lanes deploy`"
        )
    logs.configure(settings.log_format, settings.log_level, settings.access_log_level)
    host = host or settings.host
    port = port if port is not None else settings.port
    # Bound before anything loads: a port in use is one line at once, not uvicorn's
    # log line after the models loaded and an exit status that means something else.
    sockets = listen(host, port)
    # The providers are the process's, not a workload's: a device this machine cannot
    # give (LANES_DEVICE=cuda without a GPU) is one line and a non-zero exit now, not a
    # server whose every workload failed to load and which is never ready.
    runtime = Runtime(settings)
    app = create_app(spec, settings, runtime)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        # httptools and uvloop (uvicorn[standard]): a fraction of h11's per-request cost;
        # h11 where HTTP/1.0 clients stream (the README's Serving).
        http=settings.http,
        loop="auto",
        access_log=False,  # lanes.access writes one line per request, with its id
        log_config=None,  # uvicorn's lines go to the root handler, in the same format
        timeout_graceful_shutdown=GRACEFUL_S,
        log_level=settings.log_level.lower(),
    )
    server = DrainingServer(config, settings.drain_s, app.drain, app.closed, app.expire, app.ready)
    server.run(sockets=sockets)


def listen(host: str, port: int) -> list[socket.socket]:
    """TCP sockets bound to `host`:`port`, one per address the host resolves to, as
    uvicorn binds them (not listening yet; uvicorn does that)."""
    if not 0 <= port <= 65535:
        raise InvalidInput(f"port: expected 0 to 65535, found {port}")
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as e:
        raise InvalidInput(
            f"host: cannot resolve {host!r} ({e}): give an address or a name this machine resolves"
        ) from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(found):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # as asyncio does: "::" is not also IPv4's
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.set_inheritable(True)
    except OSError as e:
        for sock in sockets:
            sock.close()
        raise LanesError(
            f"cannot listen on {host}:{port} ({e.strerror or e}): stop what listens there, "
            "or choose another --port (LANES_PORT) or --host (LANES_HOST)"
        ) from None
    return sockets
