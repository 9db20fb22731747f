"""Measure both lanes of one workload's model on this machine (`lanes calibrate`).

Both lanes run the same synthetic items (`synthetic_items`): texts of 3-30 words for
embed, prompts of 3-12 words for generate (the workload's `generation:` settings),
inputs shaped like the model's for infer. Texts and prompts are cut, word by word, to
what the model's context holds by the workload's own tokenizer (`_fitted`).

- **offline**: the shard code path (flows.shard.run_shard: read, sort, prepare, run in
  `batch_size` batches, write, commit) over the items as one input file, in this
  process, without Prefect; a warm-up shard of one batch runs first, untimed. Its rate
  is items over the shard's own time.
- **interactive**: the endpoint in this process on 127.0.0.1, serving the workload
  interactively (its batching as declared), and closed-loop clients in a child
  process (router.loadgen) at 1, 2, 4, ... up to `batching.max_batch_size`. The
  lane's fair rate is the best a level sustains while its p99 latency meets the
  workload's `slo.p99_ms` (`DEFAULT_P99_MS` of its task when it declares none); the
  levels stop at the first that misses it. When even one client misses it, the
  one-client rate is kept, marked `meets_slo: false`.

A rate from a running endpoint's `/metrics` (`read_metrics`) is the interactive lane's
items per second of the executor time it used since the server started: the device's
rate under the traffic it had, idle time and the offline lane's runs left out.
"""

from __future__ import annotations

import random
import socket
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import numpy as np
import orjson
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from lanes.digests import model_key
from lanes.errors import InvalidInput, LanesError, ModelError, WrongMode
from lanes.flows.job import folder_job
from lanes.flows.runners import Model
from lanes.flows.sample import run_records
from lanes.flows.shard import ShardStats
from lanes.layout import ERRORS
from lanes.measurements import Throughput
from lanes.protocols.v2 import datatype_of
from lanes.router.loadgen import HttpRequest, Level, LoadGenerator
from lanes.runtime import Runtime
from lanes.serving.app import create_app
from lanes.settings import Settings
from lanes.spec import (
    InteractiveWorkload,
    Mode,
    Spec,
    TaskName,
    Workload,
    WorkloadBase,
    as_interactive,
    as_offline,
    in_offline_lane,
)
from lanes.storage import Storage
from lanes.tasks import InferTask, Task, load_task

# The p99 latency target of a workload that declares no `slo.p99_ms`, by task. A
# generate request's latency is its whole completion (it is not streamed here).
DEFAULT_P99_MS: dict[TaskName, float] = {"embed": 100.0, "infer": 100.0, "generate": 5000.0}
DEFAULT_ITEMS: dict[TaskName, int] = {"embed": 512, "infer": 512, "generate": 64}
READY_TIMEOUT_S = 600.0

# Query-like words: the synthetic texts and prompts are drawn from them.
_VOCABULARY = (
    "how do i reverse a list in python sort dictionary by value read file line best pizza "
    "near me cheap flights to paris weather tomorrow what is the capital of australia "
    "convert celsius install docker on ubuntu fix slow laptop recipe for bread train "
    "schedule quarterly report summary customer question about refund policy late "
    "delivery order mountain trail map batch size latency padding text memory usage tips "
    "learn spanish fast running shoes movie times tonight symptoms of flu mortgage rates"
)


@dataclass(frozen=True)
class Item:
    """One synthetic item in both lanes' shapes: an input record and an HTTP request."""

    record: dict[str, Any]
    request: HttpRequest


def slo_p99_ms(workload: Workload) -> float:
    """The p99 latency the interactive lane is held to (an offline workload's: the
    default for its task, since it declares no SLO)."""
    declared = workload.slo.p99_ms if isinstance(workload, InteractiveWorkload) else None
    return declared or DEFAULT_P99_MS[workload.task]


def lane_spec(spec: Spec, name: str, lane: Mode, folder: str = "calibrate") -> Spec:
    """`spec` with workload `name` alone, in `lane`'s mode: the keys both modes have,
    and the other mode's defaults (an offline copy reads and writes under `folder`)."""
    workload = spec.workload(name)
    if lane == "offline":
        workload = in_offline_lane(workload, f"{folder}/in/", f"{folder}/out/")
    elif workload.mode != lane:
        shared = workload.model_dump(include=set(WorkloadBase.model_fields) - {"mode"})
        workload = InteractiveWorkload(mode="interactive", **shared)
    return spec.model_copy(update={"workloads": {name: workload}})


def concurrency_levels(max_batch_size: int) -> list[int]:
    """1, 2, 4, ... up to `max_batch_size`, which is always the last."""
    levels = [1]
    while levels[-1] * 2 < max_batch_size:
        levels.append(levels[-1] * 2)
    return levels if levels[-1] == max_batch_size else [*levels, max_batch_size]


def synthetic_items(task: Task, count: int, seed: int = 0, name: str | None = None) -> list[Item]:
    """`count` items for `task`'s workload, the same on every call with the same seed;
    their requests name workload `name` (default: the task's own)."""
    rng = random.Random(seed)
    vocabulary = _VOCABULARY.split()
    name, workload = name or task.name, task.workload
    items = []
    for i in range(count):
        if workload.task == "infer":
            assert isinstance(task, InferTask)
            items.append(_infer_item(task, name, i, np.random.default_rng([seed, i])))
            continue
        words = [rng.choice(vocabulary) for _ in range(rng.randint(3, 30))]
        if workload.task == "embed":
            path, body = "/v1/embeddings", {"model": name, "input": _fitted(task, words)}
        else:
            path, body = "/v1/completions", {"model": name, "prompt": _fitted(task, words[:12])}
        record = {"custom_id": f"c{i}", "method": "POST", "url": path, "body": body}
        items.append(Item(record, HttpRequest(path, body)))
    return items


def _fitted(task: Task, words: list[str]) -> str:
    """The longest leading part of `words` the task takes within its model's context, as
    its own tokenizer counts: embed within `max_length`; generate with room left for
    the workload's `max_new_tokens`, or else for one token. Always at least one word
    (refused even alone, the item's own error says why)."""
    generate = task.workload.task == "generate"
    completions = [task.workload.generation.max_new_tokens, None] if generate else [None]
    for completion in completions:
        for n in range(len(words), 0, -1):
            text = " ".join(words[:n])
            if _fits(task, text, completion):
                return text
    return words[0]


def _fits(task: Task, text: str, completion: int | None) -> bool:
    """Whether `task` takes `text` (with `completion` tokens to generate) without
    refusing it for the context's length; any other refusal is left to the run."""
    try:
        task.check(text if completion is None else {"prompt": text, "max_tokens": completion})
    except InvalidInput as error:
        return error.code != "context_length_exceeded"
    return True


def _infer_item(task: InferTask, name: str, i: int, rng: np.random.Generator) -> Item:
    record: dict[str, Any] = {as_offline(task.workload).fields.id: f"c{i}"}
    tensors = []
    for info in task.inputs.values():
        shape = [d if isinstance(d, int) else 1 for d in info.shape]
        dtype = info.dtype if info.dtype is not None else np.dtype(np.float32)
        if dtype.kind == "f":
            value: Any = rng.normal(size=shape).astype(dtype).tolist()
        elif dtype.kind == "O":
            value = np.full(shape, "", dtype=object).tolist()
        else:
            value = np.zeros(shape, dtype=dtype).tolist()
        record[info.name] = value
        datatype = "BYTES" if dtype.kind == "O" else datatype_of(dtype)
        flat = np.asarray(value, dtype=object if dtype.kind == "O" else dtype).ravel().tolist()
        tensors.append({"name": info.name, "shape": shape, "datatype": datatype, "data": flat})
    return Item(record, HttpRequest(f"/v2/models/{name}/infer", {"inputs": tensors}))


# ---- offline -----------------------------------------------------------------------


def measure_offline(
    spec: Spec,
    name: str,
    settings: Settings,
    count: int,
    progress: Callable[[int], None] = lambda n: None,
) -> tuple[Throughput, list[Item]]:
    """The offline lane's rate over `count` synthetic items, and the items (for the
    interactive lane). `progress(n)`: n more records done."""
    offline = lane_spec(spec, name, "offline")
    workload = as_offline(offline.workload(name))
    runtime = Runtime(settings)
    task = load_task(name, offline, runtime)
    task.warm_up()
    items = synthetic_items(task, count)
    model = Model(task, runtime.providers[0])
    storage = Storage(settings)
    with tempfile.TemporaryDirectory(prefix="lanes-calibrate-") as folder:
        warm = items[: min(len(items), workload.batch_size)]
        _run(offline, name, settings, storage, model, Path(folder) / "warm", warm)
        stats = _run(offline, name, settings, storage, model, Path(folder) / "run", items, progress)
    rate = stats.items / max(stats.seconds, 1e-9)
    record = Throughput(
        workload=name,
        model_key=model_key(spec, spec.workload(name), settings),
        lane="offline",
        items_per_second=rate,
        measured_at=datetime.now(UTC),
        source="calibrate",
        items=stats.items,
        provider=model.provider,
        batch_size=workload.batch_size,
    )
    return record, items


def _run(
    spec: Spec,
    name: str,
    settings: Settings,
    storage: Storage,
    model: Model,
    folder: Path,
    items: list[Item],
    progress: Callable[[int], None] = lambda n: None,
) -> ShardStats:
    job = folder_job(spec, name, folder, settings)
    stats = run_records(job, (item.record for item in items), folder, model, storage, progress)
    if stats.errors:
        first = (folder / "out" / ERRORS / "items.jsonl").read_text().splitlines()[0]
        problem = orjson.loads(first).get("error")
        handler = spec.workload(name).handler
        hint = (
            f" (handler {handler}: a `pre` that wants other input cannot be calibrated on "
            "synthetic items)"
            if handler
            else ""
        )
        raise LanesError(
            f"workload {name!r}: {stats.errors} of {stats.records} synthetic items were "
            f"rejected, so the offline rate would not be this workload's; the first: "
            f"{problem}{hint}"
        )
    return stats


# ---- interactive ---------------------------------------------------------------------


class Endpoint:
    """The serving app on 127.0.0.1 (a free port) in a thread, ready on entry."""

    def __init__(self, spec: Spec, settings: Settings, runtime: Runtime) -> None:
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        # The clients are ours: no key to send.
        app = create_app(spec, settings.model_copy(update={"api_key": None}), runtime)
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )

    def __enter__(self) -> Endpoint:
        self._thread.start()
        try:
            self._wait_ready()
        except BaseException:
            self._stop()
            raise
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._stop()

    def _wait_ready(self) -> None:
        with httpx.Client(base_url=self.url, timeout=5) as client:
            # Polls every 0.1 s: at most READY_TIMEOUT_S / 0.1 tries.
            for _ in range(int(READY_TIMEOUT_S / 0.1)):
                if not self._thread.is_alive():
                    raise LanesError(f"the endpoint at {self.url} stopped while loading")
                try:
                    answer = client.get("/readyz")
                except httpx.TransportError:
                    answer = None
                if answer is not None and answer.status_code == 200:
                    return
                if answer is not None and answer.json().get("status") == "failed":
                    raise ModelError(f"the endpoint could not load: {answer.json()['error']}")
                self._thread.join(0.1)
        raise LanesError(f"the endpoint at {self.url} was not ready in {READY_TIMEOUT_S:.0f} s")

    def _stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=60)
        self._socket.close()


def measure_interactive(
    spec: Spec,
    name: str,
    settings: Settings,
    items: list[Item],
    seconds: float,
    on_level: Callable[[Level], None] = lambda level: None,
) -> tuple[Throughput, list[Level]]:
    """The interactive lane's fair rate (the module docstring), and every level run."""
    served = lane_spec(spec, name, "interactive")
    workload = as_interactive(served.workload(name))
    target = slo_p99_ms(workload)
    runtime = Runtime(settings)
    levels: list[Level] = []
    requests = [item.request for item in items]
    with (
        Endpoint(served, settings, runtime) as endpoint,
        LoadGenerator(endpoint.url, requests) as load,
    ):
        for concurrency in concurrency_levels(workload.batching.max_batch_size):
            level = load.run(concurrency, seconds)
            levels.append(level)
            on_level(level)
            if level.errors or level.p99_ms is None or level.p99_ms > target:
                break
    first = levels[0]
    if first.errors or not first.completed:
        raise LanesError(
            f"workload {name!r}: one client got no good answers from the endpoint "
            f"({first.errors} errors; the first: {first.first_error})"
        )
    meeting = [
        lv for lv in levels if not lv.errors and lv.p99_ms is not None and lv.p99_ms <= target
    ]
    chosen = max(meeting, key=lambda lv: lv.items_per_second) if meeting else first
    record = Throughput(
        workload=name,
        model_key=model_key(spec, spec.workload(name), settings),
        lane="interactive",
        items_per_second=chosen.items_per_second,
        measured_at=datetime.now(UTC),
        source="calibrate",
        items=chosen.completed,
        provider=runtime.providers[0],
        concurrency=chosen.concurrency,
        p99_ms=chosen.p99_ms,
        slo_p99_ms=target,
        meets_slo=bool(meeting),
    )
    return record, levels


# ---- a running endpoint's metrics ----------------------------------------------------------


@dataclass(frozen=True)
class Served:
    """A workload's work so far on a running endpoint, from its /metrics."""

    items: float
    busy_seconds: float


def served_from_metrics(text: str, workload: str) -> Served | None:
    """Items the interactive lane of `workload` ran and the executor time it used, in
    Prometheus text (an endpoint that runs offline items too gives their time to the
    offline lane); None when that lane has run nothing. Items are inputs (embed,
    infer) or sequences finished (generate)."""
    items = busy = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if labels.get("workload") != workload or labels.get("lane") != "interactive":
                continue
            if sample.name == "lanes_lane_busy_seconds_total":
                busy += sample.value
            elif sample.name == "lanes_lane_items_total":
                items += sample.value
    return Served(items, busy) if items > 0 and busy > 0 else None


def read_metrics(spec: Spec, name: str, settings: Settings, url: str) -> Throughput:
    """The interactive lane's rate of `name` from the endpoint at `url`: items per busy
    second since it started."""
    workload = spec.workload(name)
    if workload.mode == "offline":
        raise WrongMode(
            f"workload {name!r} is offline: the endpoint at {url} never serves it, so its "
            f"/metrics hold no rate of it; measure both lanes of its model here with "
            f"`lanes calibrate {name}` (without --from-metrics)"
        )
    headers = {}
    if settings.api_key is not None:
        headers["Authorization"] = f"Bearer {settings.api_key.get_secret_value()}"
    # The scrape URL a Prometheus config holds (.../metrics) names the same endpoint as
    # its root does; appending /metrics to it again would read a 404.
    root = url.rstrip("/").removesuffix("/metrics")
    metrics_url = root + "/metrics"
    try:
        answer = httpx.get(metrics_url, headers=headers, timeout=10)
        answer.raise_for_status()
    except httpx.HTTPStatusError as err:
        raise LanesError(
            f"cannot read {metrics_url}: it answered {err.response.status_code}; give "
            f"--from-metrics the URL of a running `lanes serve`, e.g. http://127.0.0.1:8000"
        ) from None
    except httpx.HTTPError as err:
        raise LanesError(f"cannot read {metrics_url}: {err}") from None
    served = served_from_metrics(answer.text, name)
    if served is None:
        raise LanesError(
            f"{metrics_url}: workload {name!r} has run nothing there yet; send it traffic "
            f"first, or measure it with `lanes calibrate {name}`"
        )
    return Throughput(
        workload=name,
        model_key=model_key(spec, workload, settings),
        lane="interactive",
        items_per_second=served.items / served.busy_seconds,
        measured_at=datetime.now(UTC),
        source=f"metrics {root}",
        items=int(served.items),
        slo_p99_ms=slo_p99_ms(workload),
    )
