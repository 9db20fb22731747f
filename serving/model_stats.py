"""Each workload's figures in the shape of Triton's statistics extension
(`GET /v2/models[/{name}[/versions/1]]/stats`, tritonclient's
`get_inference_statistics`, which perf_analyzer reads for its server-side figures).

What lanes measures, and where each figure comes from:

- `success` and `fail`: every inference request the server knew the workload of
  (`/v2/models/{name}/infer`, `/v1/embeddings`, `/v1/completions`,
  `/v1/chat/completions`), counted at the edge (serving/app.py) with its time from
  arrival to the end of its answer; an answer of 400 or more, or a stream that ended
  in an error event, is a failure, a 503 that shed it included.
- `queue` and `compute_infer`: for each request (embed and infer) or each sequence
  (generate: one per prompt) that ran, its wait from arrival to its run's start, and
  its run's time: the batch's whole run for embed and infer, the time from its
  prefill's start to its last token for generate (its rows share each step with
  others). lanes times a run whole, from stacking the inputs to splitting the
  outputs, so `compute_input` and `compute_output` count the same runs at 0 ns: their
  time is inside `compute_infer`.
- `inference_count`: the rows of those requests that succeeded, as Triton counts each
  row of a batched request an inference (an infer request's first dim, or one where
  the model's first dim is fixed; an embed request one per text; a generate request
  one per prompt), and `execution_count` with `batch_stats`: the model's runs, by their
  rows (all the rows of an embed or infer batch, a run per shape of the dims after
  the rows where an infer batch's differ, or where an infer model's first dim is
  fixed, a run of one per request, the batch's time shared evenly; a generate
  step's prefill and decode are a run each, their rows those of the sequences in it,
  whichever lane they are in). An embed or infer
  workload's offline items (runner kind endpoint) are the offline lane's, in the
  lanes_lane_* series of /metrics only.
- `last_inference`: when the last request succeeded, in ms since the epoch.

lanes has no response cache: `cache_hit` and `cache_miss` are always zero.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lanes.protocols.v2 import MODEL_VERSION


@dataclass
class Duration:
    """Triton's `{count, ns}`: how many, and their time summed."""

    count: int = 0
    ns: int = 0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.ns += max(round(seconds * 1e9), 0)

    def as_json(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass
class _Figures:
    """The counters behind one workload's statistics (held under `ModelStats`' lock)."""

    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute: Duration = field(default_factory=Duration)  # compute_infer; see the docstring
    inferences: int = 0
    last_inference_ms: int = 0
    runs: dict[int, Duration] = field(default_factory=dict)  # rows -> the runs of that many


class ModelStats:
    """One workload's statistics, written by its executor (a batch worker's loop, or a
    generate engine's threads) and by the edge, read by the stats route."""

    def __init__(self, name: str, now: Callable[[], float]) -> None:
        self.name = name
        self.now = now  # the wall clock, of last_inference
        self._lock = threading.Lock()
        self._figures = _Figures()

    def answered(self, ok: bool, seconds: float) -> None:
        """An inference request answered after `seconds`, a success or not."""
        now_ms = int(self.now() * 1000) if ok else 0
        with self._lock:
            if ok:
                self._figures.success.add(seconds)
                self._figures.last_inference_ms = now_ms
            else:
                self._figures.fail.add(seconds)

    def ran(self, rows: int, seconds: float) -> None:
        """One run of the model, of `rows` rows (an execution)."""
        with self._lock:
            self._figures.runs.setdefault(rows, Duration()).add(seconds)

    def served(self, queue_s: float, compute_s: float, inferences: int) -> None:
        """One request's (or generate sequence's) wait and run, its `inferences` items
        answered."""
        with self._lock:
            self._figures.queue.add(queue_s)
            self._figures.compute.add(compute_s)
            self._figures.inferences += inferences

    def as_triton(self) -> dict[str, Any]:
        """This workload's entry of Triton's `model_stats`."""
        with self._lock:
            f = self._figures
            compute = f.compute.as_json()
            untimed = {"count": f.compute.count, "ns": 0}  # inside compute_infer
            return {
                "name": self.name,
                "version": MODEL_VERSION,
                "last_inference": f.last_inference_ms,
                "inference_count": f.inferences,
                "execution_count": sum(d.count for d in f.runs.values()),
                "inference_stats": {
                    "success": f.success.as_json(),
                    "fail": f.fail.as_json(),
                    "queue": f.queue.as_json(),
                    "compute_input": untimed,
                    "compute_infer": compute,
                    "compute_output": untimed,
                    "cache_hit": {"count": 0, "ns": 0},
                    "cache_miss": {"count": 0, "ns": 0},
                },
                "batch_stats": [
                    {
                        "batch_size": rows,
                        "compute_input": {"count": d.count, "ns": 0},
                        "compute_infer": d.as_json(),
                        "compute_output": {"count": d.count, "ns": 0},
                    }
                    for rows, d in sorted(f.runs.items())
                ],
                "memory_usage": [],
            }


class Statistics:
    """Every workload's `ModelStats`, made on first use; one per app (in `Metrics`).
    `now` is the wall clock of `last_inference`."""

    def __init__(self, now: Callable[[], float]) -> None:
        self.now = now
        self._lock = threading.Lock()
        self._by_name: dict[str, ModelStats] = {}

    def of(self, name: str) -> ModelStats:
        with self._lock:
            found = self._by_name.get(name)
            if found is None:
                found = self._by_name[name] = ModelStats(name, self.now)
            return found
