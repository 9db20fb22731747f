"""The sections only an interactive workload has: `batching`, `slo` and `deploy` (how
the endpoint batches its requests, the latencies it aims for, and how `lanes render
k8s` runs it).

Apart from lanes.spec, which composes them into `InteractiveWorkload`, so the
endpoint's knobs are read in one place; an offline workload's own sections are in
lanes.specoffline.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field, model_validator

from lanes.quantity import CpuQuantity
from lanes.spectypes import (
    Integer,
    Milliseconds,
    NonNegativeFloat,
    NonNegativeInt,
    Number,
    PositiveInt,
    matching,
)
from lanes.strict import StrictModel


class Batching(StrictModel):
    max_batch_size: PositiveInt = Field(
        32, le=65536, description="Most requests (or sequences in flight) per model run."
    )
    max_wait_ms: NonNegativeFloat = Field(
        0.0, le=60_000, description="How long an idle executor waits for company; 0 runs now."
    )
    max_queue: PositiveInt = Field(
        1024,
        le=1_048_576,
        description="Requests waiting beyond this are refused with 503 and Retry-After.",
    )
    max_prefill_tokens: PositiveInt | None = Field(
        None,
        le=1_048_576,
        description="generate: prompt tokens one step may prefill; a longer prompt is "
        "prefilled in parts over several steps, so rows already decoding keep stepping "
        "(default: whole prompts; slo.ttft_ms, when set, may lower it).",
    )
    max_kv_bytes: PositiveInt | None = Field(
        None,
        description="generate: bytes of KV cache the sequences in flight may take at most. "
        "A sequence joins only while every running sequence's worst case (its prompt and "
        "max_tokens, at most the context, times the model's bytes per token: layers x 2 x "
        "KV heads x head_dim x dtype size) fits it together, so nothing is preempted for "
        "memory; a request whose own worst case is over it is refused with 400 naming "
        "max_tokens. Offline sequences on this engine count in it too (default: no "
        "budget: max_batch_size rows of the whole context may be cached).",
    )
    preempt_offline: bool = Field(
        False,
        description="embed/infer: an interactive request that arrives while an offline "
        "batch runs on this workload's model stops that run, unless the run is expected to "
        "end sooner than it has run (then the request waits at most that long); its items "
        "run again, whole, after it. Interactive latency waits less for offline runs, at "
        "the cost of the stopped runs' work (default: an offline run ends first). Applies "
        "while offline runs take turns with interactive ones (`offline_threads: 0`, and on "
        "a GPU); with `offline_threads`, the turns they take over `offline_beside_until` "
        "are always stopped so.",
    )
    offline_threads: NonNegativeInt | None = Field(
        None,
        le=1024,
        description="embed/infer on the CPU: threads that run offline batches beside the "
        "interactive ones at the operating system's idle priority, on a one-thread session "
        "of the model of their own (loaded with the first offline batch): the OS gives an "
        "interactive run the cores the moment it starts, and offline runs use what it "
        "leaves; the workload's own session then stops spin-waiting when a run ends. 0: "
        "offline runs take turns with interactive ones on the model's own thread, as they "
        "always do on a GPU (default: the cores this process may use where the model runs "
        "on the CPU, the OS has an idle priority and an offline workload of this spec runs "
        "on this one, `runner: {kind: endpoint}`; else 0).",
    )
    offline_beside_until: Number = Field(
        0.8,
        gt=0,
        le=1,
        description="embed/infer with `offline_threads`: while interactive runs keep the "
        "model busier than this share of the last second, offline batches no longer start "
        "beside them and take turns on the model's thread instead, each run stopped by an "
        "interactive arrival as with `preempt_offline`. Beside, every interactive run is a "
        "little slower (the threads share memory bandwidth and caches), and near "
        "saturation that multiplies the queueing. 1: always beside.",
    )


class Slo(StrictModel):
    p50_ms: Milliseconds | None = Field(None, description="Target median latency.")
    p99_ms: Milliseconds | None = Field(None, description="Target 99th percentile latency.")
    ttft_ms: Milliseconds | None = Field(
        None,
        description="Target time to first token; for generate it bounds one step's "
        "prefill (longer prompts are prefilled in parts over several steps).",
    )
    itl_ms: Milliseconds | None = Field(
        None,
        description="Target inter-token latency; for generate it bounds the rows of one "
        "decode step.",
    )
    timeout_ms: Milliseconds | None = Field(
        None, description="Deadline of each request: past it, a queued request gets 504."
    )


# A Kubernetes resource quantity ("500m", "2", "4Gi").
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|Ki|Mi|Gi|Ti)?$"
# Its Deployment is named lanes-GROUP: a DNS label of at most 63 characters.
GROUP_PATTERN = r"^[a-z0-9]([-a-z0-9]{0,55}[a-z0-9])?$"


# `deploy` keys each workload of a group sets for itself; the others are the group's.
PER_WORKLOAD_DEPLOY_KEYS = frozenset({"group", "target_queue_depth"})


class Deploy(StrictModel):
    """How `lanes render k8s` runs an interactive workload. The workloads of one group
    share a Deployment (each pod serves them all, as one `lanes serve` does); the
    group-wide keys must agree across its workloads where they are set."""

    group: Annotated[
        str,
        AfterValidator(
            matching(
                GROUP_PATTERN,
                "a DNS-safe name (lower-case letters, digits and '-', at most 57, starting "
                "and ending alphanumeric)",
            )
        ),
    ] = Field("serve", description="The Deployment lanes-GROUP serves it.")
    device: Literal["cpu", "cuda", "tensorrt"] | None = Field(
        None,
        description="The group's pods' LANES_DEVICE; cuda and tensorrt ask for one "
        "nvidia.com/gpu per pod (default: the renderer's LANES_DEVICE).",
    )
    min_replicas: Integer = Field(
        1, ge=0, le=1000, description="Fewest pods (0: KEDA scales the group to zero)."
    )
    max_replicas: Integer = Field(4, ge=1, le=1000, description="Most pods.")
    cpu: CpuQuantity = Field(
        "1",
        description="CPU per pod (requests = limits): 2, 1.5 or 500m; LANES_THREADS "
        "is its whole cores.",
    )
    memory: Annotated[
        str, AfterValidator(matching(QUANTITY_PATTERN, "a quantity like 2Gi, 512Mi or 1.5G"))
    ] = Field("2Gi", description="Memory per pod (requests = limits).")
    target_queue_depth: PositiveInt | None = Field(
        None,
        le=1_048_576,
        description="Requests waiting (generate: sequences waiting or in flight) per pod "
        "that KEDA keeps the group at (default: the workload's max_batch_size).",
    )

    @model_validator(mode="after")
    def _replicas_in_order(self) -> Deploy:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"expected min_replicas <= max_replicas, found {self.min_replicas} > "
                f"{self.max_replicas}"
            )
        return self
