"""The Prefect API offline jobs live on: its client, and a deployment's runs made there.

The API is `prefect_api_url` when given, else Prefect's own `PREFECT_API_URL` setting;
without either a call fails at once (Prefect would otherwise start a throwaway server).
Prefect is imported only when a call is made.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from lanes.errors import LanesError, Unavailable

if TYPE_CHECKING:
    from prefect.client.orchestration import SyncPrefectClient

FLOW_NAME = "lanes-offline"  # flows.FLOW_NAME; lanes cannot import the flows wing
PREFECT_RETRY_AFTER_S = 5.0  # the Retry-After of a call that found the Prefect API down


class PrefectApi:
    """The Prefect API jobs live on, and its errors said the lanes way."""

    def __init__(self, url: str | None) -> None:
        self._url = url

    def url(self) -> str:
        if self._url:
            return self._url
        from prefect.settings import PREFECT_API_URL

        value = PREFECT_API_URL.value()
        if not value:
            raise LanesError(
                "jobs run on a Prefect server, and none is set: set PREFECT_API_URL "
                "(e.g. http://127.0.0.1:4200/api) or LANES_PREFECT_API_URL, or pass "
                "Client(prefect_api_url=...)"
            )
        return str(value)

    def shown(self) -> str:
        """`url()` as a message says it: without the user and password it may hold (a
        proxy's basic auth), since a message may reach a client of the Batch API."""
        url = self.url()
        parts = urlsplit(url)
        if "@" not in parts.netloc:
            return url
        return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))

    @contextmanager
    def client(self) -> Iterator[SyncPrefectClient]:
        import httpx
        from prefect.client.orchestration import SyncPrefectClient
        from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_KEY

        url = self.shown()
        client = SyncPrefectClient(
            self.url(), api_key=PREFECT_API_KEY.value(), auth_string=PREFECT_API_AUTH_STRING.value()
        )
        try:
            with client:
                yield client
        except httpx.TransportError as err:
            raise Unavailable(
                f"cannot reach the Prefect API at {url}: {err}; retry once it is back",
                retry_after=PREFECT_RETRY_AFTER_S,
            ) from None
        except httpx.HTTPStatusError as err:
            raise LanesError(
                f"the Prefect API at {url} refused {err.request.method} "
                f"{err.request.url.path}: HTTP {err.response.status_code} {err.response.text[:300]}"
            ) from None

    def deployment(self, client: SyncPrefectClient, workload: str) -> uuid.UUID:
        from prefect.exceptions import ObjectNotFound

        try:
            return client.read_deployment_by_name(f"{FLOW_NAME}/{workload}").id
        except ObjectNotFound:
            raise LanesError(
                f"no deployment {FLOW_NAME}/{workload} on the Prefect API at {self.shown()}: "
                "register the offline workloads there first (`lanes deploy`)"
            ) from None


@dataclass(frozen=True)
class ScheduledRun:
    """A flow run `create_run` made, or found under its idempotency key."""

    id: uuid.UUID
    scheduled: datetime | None  # when it is (or was) due
    ended: bool  # it has run (or was cancelled): it will not start again


def create_run(
    deployment: str,
    parameters: dict[str, Any],
    scheduled: datetime,
    name: str,
    tags: list[str],
    prefect_api_url: str | None = None,
    idempotency_key: str | None = None,
) -> ScheduledRun:
    """A flow run of deployment `lanes-offline/<deployment>`, due at `scheduled`
    (the Batch API's batches: lanes.batches; a deadline's later start: flows.start).
    With `idempotency_key`, a run the deployment's flow already has under that key is
    returned as it is, and none is made."""
    from prefect.states import Scheduled

    prefect = PrefectApi(prefect_api_url)
    with prefect.client() as client:
        found = prefect.deployment(client, deployment)
        run = client.create_flow_run_from_deployment(
            found,
            parameters=parameters,
            state=Scheduled(scheduled_time=scheduled),
            name=name,
            tags=tags,
            idempotency_key=idempotency_key,
        )
        ended = run.state is not None and run.state.is_final()
        return ScheduledRun(run.id, run.next_scheduled_start_time or run.expected_start_time, ended)
