"""Settings from the environment (prefix LANES_), built once at an entry point and passed down.

The nested groups (LANES_BATCH__*, LANES_ENDPOINT_RETRIES__*) are lanes.settings_groups';
which variable a bad value came from, lanes.settings_origin's.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Literal

import pydantic_settings
from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from lanes.envsource import LanesEnvironment
from lanes.errors import Problem, SettingsError
from lanes.logs import LogFormat, LogLevel
from lanes.schedule import Schedule
from lanes.settings_groups import BatchApi, EndpointRetries
from lanes.settings_origin import problem_source, variable_of
from lanes.specproblems import dotted, from_pydantic

Device = Literal["auto", "cpu", "cuda", "tensorrt"]
OFFPEAK_CRON = "0 2 * * *"  # the default off-peak window opens at 02:00
IoBinding = Literal["auto", "on", "off"]
HttpImplementation = Literal["auto", "httptools", "h11"]


class Settings(BaseSettings):
    """Everything lanes reads from the environment.

    `workloads` and `models` hold overrides of spec fields:
    LANES_WORKLOADS__SEARCH_QUERY__BATCHING__MAX_WAIT_MS=5 sets
    workloads.search-query.batching.max_wait_ms (a '-' in a name is '_' here).
    A bad value raises `SettingsError`, one problem per variable.
    """

    # No setting means anything at NaN or infinity; pydantic's message for one that is
    # bounded would name the bound, not the NaN.
    model_config = SettingsConfigDict(
        env_prefix="LANES_",
        env_nested_delimiter="__",
        extra="ignore",
        frozen=True,
        allow_inf_nan=False,
    )

    spec: Path = Field(Path("workloads.yaml"), description="The workloads.yaml to load.")
    home: Path = Field(
        Path(".lanes"),
        description="Job state, measurements and local outputs (models are where the spec "
        "names them; `lanes models build` puts the demo's there). A relative folder is "
        "read against the working directory when the settings load.",
    )
    host: str = Field("127.0.0.1", description="Address `lanes serve` binds.")
    port: int = Field(8000, ge=0, le=65535)
    http: HttpImplementation = Field(
        "auto",
        description="uvicorn's HTTP/1 implementation for `lanes serve`: auto picks "
        "httptools (lanes installs uvicorn[standard]), the fastest, else h11. "
        "httptools sends a streamed answer chunked even to an HTTP/1.0 client, which "
        "cannot read that; h11 sends it such a client unchunked, ended by closing the "
        "connection, as HTTP/1.0 reads it.",
    )
    endpoint: str = Field("http://127.0.0.1:8000", description="Where the SDK client calls.")
    api_key: SecretStr | None = Field(None, description="Bearer key the server requires.")
    internal_key: SecretStr | None = Field(
        None,
        description="Bearer key of the endpoint's internal batch route (offline workloads "
        "with `runner: {kind: endpoint}`), held by the server and the flow; default: "
        "api_key. With neither, the server refuses the route.",
    )
    preempted_cache_bytes: int = Field(
        256 * 1024 * 1024,
        ge=0,
        description="Bytes of KV cache a generate workload's engine keeps for offline "
        "sequences preempted by interactive ones; beyond, a preempted sequence's cache is "
        "recomputed when it resumes.",
    )
    prefix_cache_bytes: int = Field(
        64 * 1024 * 1024,
        ge=0,
        description="Bytes of KV cache a generate workload keeps of recent prompts (its "
        "engine, and each offline batch), up to 32 per opening (first 32 tokens), so "
        "that a later prompt starting with a long part of one runs only its rest; 0 "
        "keeps none.",
    )
    device: Device = Field(
        "auto",
        description="auto: CUDA when a GPU is there, else the CPU; TensorRT is opt-in (tensorrt).",
    )
    io_binding: IoBinding = Field(
        "auto",
        description="Run sessions with onnxruntime's IO binding (outputs allocated on the "
        "session's device, a decoder's past kept there between steps): auto binds on a "
        "GPU only; on binds on the CPU too (the same code path, which the tests use).",
    )
    threads: int | None = Field(
        None,
        gt=0,
        le=1024,
        description="onnxruntime intra-op threads; default: onnxruntime's choice.",
    )
    max_body_bytes: int = Field(
        8 * 1024 * 1024, gt=0, description="Largest request body; a larger one gets 413."
    )
    max_inputs_per_request: int = Field(
        2048,
        gt=0,
        description="Most inputs (texts, prompts) one request may carry; a request of more "
        "gets 413 before any of them is tokenized.",
    )
    offload_body_bytes: int = Field(
        16 * 1024,
        ge=0,
        description="Bodies larger than this are parsed and tokenized on a worker thread, "
        "so that the event loop keeps answering other requests meanwhile; smaller ones "
        "cost less than the hand-off.",
    )
    discard_body_bytes: int = Field(
        64 * 1024 * 1024,
        ge=0,
        description="Most bytes of an unread body (a request answered 413, 401 or 503 "
        "before its body was read) the server reads and drops before it closes the "
        "connection, so that the client gets the answer rather than a reset.",
    )
    body_timeout_s: float = Field(
        15.0,
        gt=0,
        le=3600,
        description="Longest wait for the next part of a request's body: a client that "
        "stalls mid-body longer gets 408 and its connection closes, so a slow or dead "
        "client holds no connection, nor a stopping server, for ever.",
    )
    drain_s: float = Field(
        5.0,
        ge=0,
        le=3600,
        description="After SIGTERM, how long /readyz answers 503 (draining) while requests "
        "are still served, each answer closing its connection, so that load balancers stop "
        "sending before the listener closes; a second signal stops at once.",
    )
    s3_endpoint: str | None = Field(None, description="S3 endpoint URL (e.g. a MinIO server).")
    # Long enough that a renewal (every third of it) outlives an S3 hiccup and boto3's
    # retries; short enough that a killed run holds its output a minute, not a night.
    s3_lease_s: float = Field(
        60.0,
        gt=0,
        description="Seconds a run's lease on an S3 output (<output>/_running) lasts "
        "unrenewed: a killed run's is taken over this long (and a second) after it died.",
    )
    # Off only where nothing relies on the conditions (one process at a time writes each
    # output and the batch store): on a store that ignores them, each lease is then void.
    s3_check_conditional_writes: bool = Field(
        True,
        description="Before the first conditional write in an S3 bucket (a run's lease on "
        "an output, the Batch API's records), check once that the store honours "
        "If-None-Match and If-Match, and refuse one that ignores them. Set false only "
        "where one process at a time writes each output and the Batch API's store.",
    )
    work_pool: str = Field("lanes", description="Prefect work pool offline deployments use.")
    prefect_api_url: str | None = Field(
        None,
        description="The Prefect API the endpoint's Batch API runs batches on; default: "
        "Prefect's own PREFECT_API_URL.",
    )
    # Validated as a value of this field (not built by a factory), so that a default that
    # fails to load (no time zone database) is reported at offpeak.timezone, as the default.
    offpeak: Schedule = Field(
        default={"cron": OFFPEAK_CRON, "timezone": "UTC"},
        validate_default=True,
        description="Off-peak window for offline workloads without a schedule "
        "(LANES_OFFPEAK__CRON, LANES_OFFPEAK__TIMEZONE).",
    )
    price_per_device_hour: float = Field(
        1.0, ge=0, description="Cost estimate basis for job manifests, in dollars."
    )
    allowed_input_roots: tuple[str, ...] = Field(
        (),
        description="Folders and s3:// prefixes a job may read besides its workload's own "
        "input and staging area (a submitted URI, `lanes run --input`), as a JSON list: "
        'LANES_ALLOWED_INPUT_ROOTS=\'["s3://shared/corpora/", "/data/"]\'. Relative '
        "folders are read against the spec's folder. Set it where jobs are submitted and "
        "where they run: the worker refuses the rest.",
    )
    allowed_output_roots: tuple[str, ...] = Field(
        (),
        description="Folders and s3:// prefixes a job may write besides its workload's own "
        "output folder and the Batch API's store (a flow run's `output`, `lanes run "
        "--output`), as a JSON list: "
        'LANES_ALLOWED_OUTPUT_ROOTS=\'["s3://shared/results/", "/results/"]\'. Relative '
        "folders are read against the spec's folder. Set it where jobs run: the worker "
        "refuses the rest.",
    )
    log_format: LogFormat = Field(
        "text", description="Log lines as text or as one JSON object per line."
    )
    log_level: LogLevel = Field("INFO", description="The threshold of every log line.")
    access_log_level: LogLevel = Field(
        "INFO",
        description="The threshold of the access lines (one per request, at INFO): "
        "WARNING turns them off.",
    )
    tracing: bool = Field(
        False,
        description="Export OpenTelemetry spans over OTLP/HTTP, as the OTEL_* variables "
        "say (needs the otel extra).",
    )
    batch: BatchApi = Field(default_factory=BatchApi, description="The OpenAI Batch API.")
    endpoint_retries: EndpointRetries = Field(
        default_factory=EndpointRetries,
        description="How an offline flow on the endpoint (`runner: {kind: endpoint}`) "
        "retries its batches.",
    )
    workloads: dict[str, Any] = Field(default_factory=dict, description="Workload overrides.")
    models: dict[str, Any] = Field(default_factory=dict, description="Model overrides.")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, LanesEnvironment(settings_cls), dotenv_settings, file_secret_settings

    def batch_key(self) -> str | None:
        """The key of the internal batch route: internal_key, else api_key."""
        key = self.internal_key or self.api_key
        return key.get_secret_value() if key is not None else None

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as err:
            problems = []
            for loc, message, _ in from_pydantic(err, (), type(self)):
                source, inside = problem_source(loc, values)
                problems.append(Problem(source, None, None, dotted(inside), message))
            raise SettingsError(problems) from None
        except pydantic_settings.SettingsError as err:  # a complex value that is not JSON
            named = re.search(r'field "(\w+)"', str(err))
            source = variable_of((named.group(1),))[0] if named else "env LANES_*"
            message = "expected JSON (a list or an object), found a value that does not parse"
            raise SettingsError([Problem(source, None, None, "", message)]) from None

    def shared_env(self) -> dict[str, str]:
        """The LANES_ variables that give another process the settings chosen here that
        lanes' processes elsewhere must agree on: the S3 endpoint and the Batch API's
        store (the server writes a batch's input there, the flow run reads it), and,
        where set here, the roots a job may read and write (a flow run refuses what the
        submitter allowed otherwise), the off-peak window (a deployment fires on the one it was
        compiled with; its runs plan their deadlines on it), the price (manifests,
        the server's metric) and whether S3 stores are checked for conditional writes
        (a flow run takes its lease on the same store). Unset ones are left out: the
        other process keeps its own.
        `lanes render k8s` puts them in every pod's env, `lanes compile` in each
        deployment's job variables."""
        env = {}
        if self.s3_endpoint:
            env["LANES_S3_ENDPOINT"] = self.s3_endpoint
        if self.batch.store:
            env["LANES_BATCH__STORE"] = self.batch.store
        chosen = self.model_fields_set
        if "allowed_input_roots" in chosen:
            env["LANES_ALLOWED_INPUT_ROOTS"] = json.dumps(list(self.allowed_input_roots))
        if "allowed_output_roots" in chosen:
            env["LANES_ALLOWED_OUTPUT_ROOTS"] = json.dumps(list(self.allowed_output_roots))
        if "offpeak" in chosen:
            offpeak = self.offpeak
            for key in sorted(offpeak.model_fields_set | {"cron", "timezone"}):
                value = getattr(offpeak, key)
                if value is not None:
                    env[f"LANES_OFFPEAK__{key.upper()}"] = str(value)
        if "s3_check_conditional_writes" in chosen:
            env["LANES_S3_CHECK_CONDITIONAL_WRITES"] = str(self.s3_check_conditional_writes)
        if "price_per_device_hour" in chosen:
            env["LANES_PRICE_PER_DEVICE_HOUR"] = repr(self.price_per_device_hour)
        return env

    def overrides_env(self) -> dict[str, str]:
        """LANES_WORKLOADS and LANES_MODELS holding, as JSON, the overrides of the spec
        chosen here (however they were given: LANES_WORKLOADS__NIGHTLY__BATCH_SIZE comes
        back inside LANES_WORKLOADS), so that another process loading the same
        workloads.yaml with them loads the same spec. Keys sorted: the same overrides
        give the same text."""
        env = {}
        if self.workloads:
            env["LANES_WORKLOADS"] = json.dumps(self.workloads, sort_keys=True)
        if self.models:
            env["LANES_MODELS"] = json.dumps(self.models, sort_keys=True)
        return env

    def batch_store(self) -> str:
        """Where the Batch API keeps files and batches (a folder or s3:// prefix, with '/')."""
        store = self.batch.store or str((self.home / "batches").resolve())
        return store if store.endswith("/") else store + "/"

    @field_validator("offpeak", mode="before")
    @classmethod
    def _offpeak_keeps_its_cron(cls, value: object) -> object:
        # LANES_OFFPEAK__TIMEZONE or __FINISH_BY alone reaches here as an object of that
        # key only, which would replace the whole default window, cron included: the
        # default window's opening stays unless a cron is given.
        if isinstance(value, dict) and "cron" not in value:
            return {"cron": OFFPEAK_CRON, **value}
        return value

    @field_validator("offpeak")
    @classmethod
    def _offpeak_opens(cls, offpeak: Schedule) -> Schedule:
        if offpeak.cron is None:
            raise ValueError("expected a cron (LANES_OFFPEAK__CRON): the default window's opening")
        return offpeak

    @field_validator("api_key", "internal_key")
    @classmethod
    def _a_key(cls, key: SecretStr | None) -> SecretStr | None:
        # An empty key is no key to the server, which would then answer everyone without
        # a word; a Kubernetes Secret whose value is empty gives one. Fail closed.
        if key is not None and not key.get_secret_value().strip():
            raise ValueError(
                "expected a key, found an empty value; unset the variable to serve without one"
            )
        # No client can send it: a header's token is read without the whitespace around
        # it, so the server would refuse every call. A Secret made from a file with its
        # last newline gives one.
        if key is not None and key.get_secret_value() != key.get_secret_value().strip():
            raise ValueError(
                "expected a key without whitespace around it, found one that starts or ends "
                "with a space or a line break (a file's last newline?): remove it"
            )
        return key

    @field_validator("work_pool")
    @classmethod
    def _a_pool_name(cls, pool: str) -> str:
        # Prefect refuses such a name only when `lanes deploy` creates the pool; `lanes
        # compile` would write it into every deployment first.
        if not pool.strip() or any(c in pool for c in "/%&<>"):
            raise ValueError(
                f"expected a Prefect work pool name (not blank, none of / % & < >), found {pool!r}"
            )
        return pool

    @field_validator("spec", "home", mode="before")
    @classmethod
    def _a_path(cls, value: object) -> object:
        if isinstance(value, str) and not value.strip():
            raise ValueError("expected a path, found an empty value")
        return value

    @field_validator("home")
    @classmethod
    def _home_is_absolute(cls, home: Path) -> Path:
        # Read against the working directory once, at load: a later chdir (a Prefect
        # worker's flow run, a subprocess started elsewhere) keeps the same folder.
        return Path(os.path.abspath(home))

    @field_validator("s3_endpoint")
    @classmethod
    def _an_endpoint_url(cls, value: str | None) -> str | None:
        # boto3 takes any string here and fails at the first S3 call with a traceback.
        if value and not re.fullmatch(r"https?://[^\s/]+(/\S*)?", value):
            raise ValueError(f"expected an http:// or https:// URL, found {value!r}")
        return value

    @field_validator("allowed_input_roots", "allowed_output_roots")
    @classmethod
    def _roots_are_folders(cls, roots: tuple[str, ...]) -> tuple[str, ...]:
        for root in roots:
            if not root.strip() or any(c in root for c in "*?["):
                raise ValueError(
                    f"expected folders and s3:// prefixes without wildcards, found {root!r}"
                )
        return roots
