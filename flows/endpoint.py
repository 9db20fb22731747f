"""A shard's batches on the serving endpoint's sessions (`runner: {kind: endpoint}`).

The flow reads, prepares and writes as with the local runner (its own copy of the
task, on the CPU, prepares records and applies the workload's handler); only the
model run moves: each batch of prepared items goes to
POST /internal/v1/batch/{workload}, where it waits in the offline lane of the
interactive workload named by `runner.workload` and runs when no interactive request
waits. Commits, retries, manifests and resume stay the flow's, as for every runner; each
answer's model time (BUSY_HEADER) adds up per shard (`ShardStats.busy_seconds`), on
which the manifest prices the run.

A full offline lane (503) or a lost connection is retried here, as the settings'
`endpoint_retries` say (after a lost connection a growing wait, after a 503 the
server's Retry-After); anything else fails the batch, and so the shard, for
Prefect's retries. An endpoint that refuses connections through every attempt is gone:
its shard fails without Prefect's retries (they would repeat the same attempts), and
so does each later batch at its first refused connection, until the endpoint answers
again; the flow starts no further shard (flows.scheduling), so a job whose endpoint died
fails in one round of attempts, and its rerun runs the shards left.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from lanes.backfill import (
    BUSY_HEADER,
    CONTENT_TYPE,
    MODEL_MISMATCH,
    PROVIDER_HEADER,
    WEIGHTS_HEADER,
    batch_path,
    weights_digest,
)
from lanes.batchframe import decode_outputs, encode_items
from lanes.digests import Digests
from lanes.errors import (
    InvalidInput,
    JobFailed,
    LanesError,
    RequestTooLarge,
    UnknownWorkload,
    WrongMode,
    from_wire,
)
from lanes.flows.runners import DeviceTime
from lanes.isolation import Failed
from lanes.settings import Settings
from lanes.settings_groups import EndpointRetries
from lanes.spec import Spec
from lanes.tasks.base import Task

log = logging.getLogger(__name__)

# Offline work waits while interactive requests come first: no read timeout.
TIMEOUT = httpx.Timeout(connect=10.0, read=None, write=60.0, pool=None)


def batch_key(settings: Settings) -> str:
    """The internal key the flow sends; JobFailed naming the settings without one."""
    key = settings.batch_key()
    if key is None:
        raise JobFailed(
            "runner kind endpoint needs the server's internal key: set LANES_INTERNAL_KEY "
            "(or LANES_API_KEY) here and on the server"
        )
    return key


def model_weights(spec: Spec, workload: str, settings: Settings) -> str | None:
    """The digest of `workload`'s model and tokenizer files, which its batches carry
    (WEIGHTS_HEADER) so that an endpoint running another model refuses them."""
    declared = spec.workloads[workload]
    return weights_digest(spec.models[declared.model], declared.task, Digests(settings.home))


def check_reachable(url: str, retries: EndpointRetries, attempts: int = 5) -> None:
    """JobFailed unless the endpoint answers at all (its /healthz, `attempts` times with
    the batches' back-off, a few seconds by default, for a restart): a job on an
    endpoint that is not there fails before any shard, not each shard after every
    batch's retries."""
    target = url.rstrip("/") + "/healthz"
    for attempt in range(1, attempts + 1):
        try:
            httpx.get(target, timeout=TIMEOUT.connect)
            return  # any answer: the batch route says the rest
        except httpx.TransportError as err:
            if attempt == attempts:
                raise JobFailed(
                    f"the endpoint at {url} does not answer ({type(err).__name__}: {err}): "
                    "start `lanes serve` there, or point the workload's `runner.url` (or "
                    "LANES_ENDPOINT) at it"
                ) from err
            time.sleep(retries.wait_after(attempt))


def check_key(url: str, workload: str, key: str, weights: str | None = None) -> None:
    """JobFailed when the endpoint refuses `key`, does not serve `workload` (or not for
    offline batches of its task), or runs it on other model files than `weights` says:
    such a job fails before any shard, not each shard after every batch. It sends an
    empty batch, which the route authorizes and checks before anything else and then
    refuses as empty (no model runs): only those refusals fail the job here, any other
    answer (a model still loading) is for the batches to meet."""
    target = url.rstrip("/") + batch_path(workload)
    headers = _headers(key, weights)
    try:
        # No read timeout: the server reads its model files' digest first, once (a
        # large model's takes seconds).
        response = httpx.post(target, content=b"", headers=headers, timeout=TIMEOUT)
    except httpx.TransportError as err:
        raise JobFailed(
            f"the endpoint at {url} does not answer ({type(err).__name__}: {err}): start "
            "`lanes serve` there, or point the workload's `runner.url` (or LANES_ENDPOINT) at it"
        ) from err
    if response.status_code == 401:
        raise JobFailed(
            f"the endpoint at {url} refused the internal key ({_error_of(response)}): set "
            "LANES_INTERNAL_KEY (else LANES_API_KEY) here to the server's LANES_INTERNAL_KEY "
            "(else LANES_API_KEY)"
        )
    error = _error_of(response)
    if isinstance(error, UnknownWorkload | WrongMode) or error.code == MODEL_MISMATCH:
        raise JobFailed(f"{url}: {error}")


def _headers(key: str, weights: str | None) -> dict[str, str]:
    headers = {"authorization": f"Bearer {key}", "content-type": CONTENT_TYPE}
    if weights is not None:
        headers[WEIGHTS_HEADER] = weights
    return headers


class EndpointGone(JobFailed):
    """The endpoint refused the connection through a batch's every attempt."""

    repeats = True  # Prefect's retries of the shard would repeat the same attempts


@dataclass
class EndpointModel:
    """Runs batches on the endpoint at `url` (its base URL), in `workload`'s offline lane."""

    task: Task
    url: str
    workload: str
    key: str
    provider: str = "endpoint"  # the server's provider, once it has answered
    client: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=TIMEOUT))
    retries: EndpointRetries = field(default_factory=EndpointRetries)
    weights: str | None = None  # the model files' digest (model_weights), sent with each batch
    # A batch found the endpoint gone (EndpointGone); reset by any answer.
    gone: bool = False

    def run(self, items: Sequence[Any], device: DeviceTime | None = None) -> list[Any]:
        """Per item: the workload's handler's `post` of the model's output, or a
        `Failed`; raises when every item failed, unless the endpoint refused each as
        invalid (its batching.max_kv_bytes: the records' fault, not the model's, for
        retries). The model time the endpoint says the batch used goes into `device`."""
        outputs: list[Any] = []
        for i, raw in enumerate(self._answers(items, 0, device)):
            if isinstance(raw, Failed):
                outputs.append(raw)
                continue
            try:
                outputs.append(self.task.handler.after(raw))
            except Exception as err:  # the handler's post fails on this output alone
                outputs.append(Failed(i, err))
        failed = [o for o in outputs if isinstance(o, Failed)]
        refused = all(isinstance(f.error, InvalidInput) for f in failed)
        if failed and len(failed) == len(outputs) and not refused:
            raise failed[0].error
        return outputs

    def _answers(self, items: Sequence[Any], start: int, device: DeviceTime | None) -> list[Any]:
        """The endpoint's raw output (or `Failed`) per item, `start` being the first's
        index in the batch. A generate batch is a shard's window of batches, its `n`
        choices each an item: its frame can pass the server's body limit
        (LANES_MAX_BODY_BYTES, a 413) though every item fits. That is no fault of the
        records, so the batch goes in halves, and only an item refused alone fails."""
        try:
            response = self._post(encode_items(items))
        except RequestTooLarge as err:
            if len(items) == 1:
                return [Failed(start, err)]
            half = len(items) // 2
            head = self._answers(items[:half], start, device)
            return head + self._answers(items[half:], start + half, device)
        self.provider = response.headers.get(PROVIDER_HEADER, self.provider)
        if device is not None:
            device.add(_busy_seconds(response))
        return list(decode_outputs(response.content, len(items), self.task.kind))

    def _post(self, body: bytes) -> httpx.Response:
        target = self.url.rstrip("/") + batch_path(self.workload)
        headers = _headers(self.key, self.weights)
        attempts = self.retries.attempts
        for attempt in range(1, attempts + 1):
            try:
                response = self.client.post(target, content=body, headers=headers)
            except httpx.TransportError as err:
                refused = isinstance(err, httpx.ConnectError)
                if refused and (attempt == attempts or self.gone):
                    self.gone = True
                    raise EndpointGone(
                        f"{target}: {type(err).__name__}: {err}: the endpoint at {self.url} "
                        "is gone; start `lanes serve` there again and rerun the job (it "
                        "redoes only the shards not committed)"
                    ) from err
                if attempt == attempts:
                    raise JobFailed(f"{target}: {type(err).__name__}: {err}") from err
                log.warning("%s: %s; retrying", target, err)
                time.sleep(self.retries.wait_after(attempt))
                continue
            self.gone = False
            if response.status_code == 200:
                return response
            error = _error_of(response)
            if response.status_code != 503 or attempt == attempts:
                raise error
            wait = _retry_after(response, self.retries.max_wait_s)
            log.info("%s: %s; retrying in %.1f s", target, error, wait)
            time.sleep(wait)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def close(self) -> None:
        self.client.close()


def _error_of(response: httpx.Response) -> LanesError:
    try:
        error = orjson.loads(response.content)["error"]
        message, code = str(error["message"]), error.get("code")
    except (orjson.JSONDecodeError, KeyError, TypeError):
        message, code = f"HTTP {response.status_code}: {response.text[:200]}", None
    return from_wire(f"the endpoint refused the batch: {message}", response.status_code, code)


def _busy_seconds(response: httpx.Response) -> float | None:
    """The batch's model time in the offline lane; None from a server that does not
    say (older than BUSY_HEADER: the run is then priced on its wall time)."""
    try:
        seconds = float(response.headers[BUSY_HEADER])
    except (KeyError, ValueError):
        return None
    return seconds if seconds >= 0 else None


def _retry_after(response: httpx.Response, longest: float) -> float:
    try:
        wait = max(float(response.headers.get("retry-after", "1")), 0.1)
    except ValueError:
        wait = 1.0
    return min(wait, longest)
