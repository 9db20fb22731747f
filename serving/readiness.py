"""What the server hosts, and how each workload stands: loading, ready, or failed.

One registry answers every readiness question (`/readyz`, `/v2/health/ready`,
`/v2/models/{name}/ready`) and every request that finds its workload not loaded,
whatever the workload's task. The loader is the only writer. A workload whose model
`idle_unload_s` unloaded stays ready: it wakes for the next request
(serving/residency.py), which waits for that and is answered.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


class LoadState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"


@dataclass(frozen=True)
class Hosted:
    """One workload's state; `error` says why it failed."""

    state: LoadState
    error: str | None = None

    def as_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"state": self.state.value}
        if self.error is not None:
            body["error"] = self.error
        return body


LOADING = Hosted(LoadState.LOADING)
READY = Hosted(LoadState.READY)


class Readiness:
    """Each hosted workload's `Hosted`, in the spec's order; all start loading."""

    def __init__(self, names: Iterable[str]) -> None:
        self._hosted = dict.fromkeys(names, LOADING)
        # Set once, when the server is told to stop: it still serves, but is not ready.
        self.draining = False

    def drain(self) -> None:
        """From now on not ready, whatever each workload's state (safe in a signal handler)."""
        self.draining = True

    def __contains__(self, name: str) -> bool:
        return name in self._hosted

    def of(self, name: str) -> Hosted:
        """The state of a hosted workload (KeyError for one the server does not host)."""
        return self._hosted[name]

    def ready(self, name: str) -> None:
        self._hosted[name] = READY

    def failed(self, name: str, error: str) -> None:
        self._hosted[name] = Hosted(LoadState.FAILED, error)

    def overall(self) -> LoadState:
        """FAILED if any workload failed, else LOADING while any loads, else READY."""
        states = {hosted.state for hosted in self._hosted.values()}
        for state in (LoadState.FAILED, LoadState.LOADING):
            if state in states:
                return state
        return LoadState.READY

    def errors(self) -> str | None:
        """Every failure, one after another: `workload NAME: message; ...`."""
        failed = [f"workload {n}: {h.error}" for n, h in self._hosted.items() if h.error]
        return "; ".join(failed) or None

    def as_json(self) -> dict[str, Any]:
        """The body of /readyz."""
        state = self.overall()
        status = "draining" if self.draining else state.value
        body: dict[str, Any] = {
            "status": status,
            "ready": state is LoadState.READY and not self.draining,
        }
        errors = self.errors()
        if errors is not None:
            body["error"] = errors
        body["workloads"] = {name: hosted.as_json() for name, hosted in self._hosted.items()}
        return body
