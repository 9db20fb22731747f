"""The nested groups of Settings: the Batch API (LANES_BATCH__*) and how a flow retries
an endpoint (LANES_ENDPOINT_RETRIES__*).

Apart from lanes.settings because each is read by one part of lanes only (the Batch
API's server and flows, the endpoint runner), which may take the group alone.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class BatchApi(BaseModel):
    """The OpenAI Batch API of the endpoint (/v1/files, /v1/batches): LANES_BATCH__*."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    store: str | None = Field(
        None,
        description="Folder or s3://bucket/prefix/ holding uploaded files and batches; "
        "default: LANES_HOME/batches. The server and the workers must see the same one. "
        "A relative folder is read against the working directory when the settings load.",
    )
    max_file_bytes: int = Field(
        200 * 1024 * 1024, gt=0, description="Largest file POST /v1/files takes."
    )
    max_store_bytes: int = Field(
        10 * 1024**3,
        gt=0,
        description="Bytes the batch store may hold (one key is one tenant, so this is the "
        "whole store's): uploads, each batch's copy of its input until the batch ends, and "
        "batches' output and error files. An upload or a batch create that would go over is "
        "refused before any of it is stored; a batch's output and error files are always "
        "written, and may take the store over, refusing uploads until room is freed.",
    )
    shard_lines: int = Field(
        1000,
        gt=0,
        le=1_000_000,
        description="Lines per shard of a batch's input: each shard commits on its own "
        "(live request_counts; a cancelled or expired batch keeps its committed shards).",
    )
    start: Literal["now", "latest"] = Field(
        "now",
        description="now: a batch starts at once; latest: at the latest moment that still "
        "ends by created_at + completion_window inside the off-peak window, from the "
        "workload's measured offline items/s (lanes.deadline).",
    )
    batch_size: int = Field(
        256,
        gt=0,
        le=65536,
        description="Records per model run when a batch names an interactive workload "
        "(an offline workload's batches use its own batch_size).",
    )
    sweep_s: float = Field(
        30.0,
        ge=0,
        le=86400,
        description="Seconds between the server's looks at the batches not yet ended, so "
        "that one whose run ended is finalized (its output and error files written, its "
        "folder deleted) and one whose window passed is stopped, polled or not; 0: never, "
        "a batch then ends only when a client retrieves or lists it.",
    )

    @field_validator("store")
    @classmethod
    def _store_is_absolute(cls, store: str | None) -> str | None:
        # A relative folder is read against the working directory once, here: a Prefect
        # worker or a subprocess that starts elsewhere must still find the same store.
        if store is None or "://" in store or not store.strip():
            return store
        absolute = os.path.abspath(store)
        return absolute + "/" if store.endswith("/") else absolute


class EndpointRetries(BaseModel):
    """How a flow with `runner: {kind: endpoint}` retries a batch the endpoint did not
    take: LANES_ENDPOINT_RETRIES__*."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    attempts: int = Field(
        10,
        ge=1,
        le=1000,
        description="Attempts of each batch over a lost or refused connection or a full "
        "offline lane (503); an endpoint that refuses connections through all of them "
        "is gone.",
    )
    backoff_s: float = Field(
        0.5,
        ge=0,
        le=60,
        description="After the n-th lost or refused connection, the next attempt waits n "
        "times this (up to max_wait_s): a restart of the endpoint within the attempts is "
        "ridden through.",
    )
    max_wait_s: float = Field(
        5.0,
        ge=0,
        le=600,
        description="The longest wait between two attempts, the server's Retry-After included.",
    )

    def wait_after(self, attempt: int) -> float:
        """Seconds to wait after the `attempt`-th (from 1) lost connection."""
        return min(attempt * self.backoff_s, self.max_wait_s)
