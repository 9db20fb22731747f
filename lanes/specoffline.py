"""The sections only an offline workload has: `runner` (where its shard tasks run) and
`fields` (where the parts of a plain record are).

Apart from lanes.spec, which composes them into `OfflineWorkload`, so the batch
lane's knobs are read in one place; an interactive workload's own sections are in
lanes.specinteractive.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from lanes.spectypes import PositiveInt, matching
from lanes.strict import StrictModel
from lanes.template import Template, is_template


class Runner(StrictModel):
    """Where an offline workload's shard tasks run. `runner: dask` is short for `{kind: dask}`."""

    kind: Literal["local", "dask", "endpoint"] = Field(
        "local",
        description="local: threads in the flow's own process; dask: a Dask cluster "
        "through prefect-dask; endpoint: the serving endpoint's own sessions, in its "
        "offline lane (batches run only while no interactive request waits).",
    )
    address: (
        Annotated[
            str,
            AfterValidator(
                matching(r"^[a-z][a-z0-9+.-]*://[^\s/]+$", "an address like tcp://10.0.0.5:8786")
            ),
        ]
        | None
    ) = Field(
        None,
        max_length=255,
        description="Dask scheduler address, e.g. tcp://10.0.0.5:8786 (kind: dask); "
        "none starts a local cluster.",
    )
    workers: PositiveInt = Field(
        2, le=1024, description="Processes of the local Dask cluster started when no address."
    )
    max_concurrent_shards: PositiveInt = Field(
        2, le=4096, description="Shards in flight at once: reading one overlaps running another."
    )
    url: (
        Annotated[
            str,
            AfterValidator(
                matching(r"^https?://[^\s/]+(/[^\s]*)?$", "a URL like http://10.0.0.5:8000")
            ),
        ]
        | None
    ) = Field(
        None,
        max_length=2000,
        description="kind: endpoint: the serving endpoint, e.g. http://10.0.0.5:8000; "
        "none: the LANES_ENDPOINT setting. The flow authenticates with LANES_INTERNAL_KEY "
        "(else LANES_API_KEY), which the server must hold too.",
    )
    workload: str | None = Field(
        None,
        min_length=1,
        max_length=1000,
        description="kind: endpoint: the interactive workload whose sessions run the "
        "batches (same model and task), or the name of that model; none: the one "
        "interactive workload of the same model and task.",
    )

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return {"kind": value} if isinstance(value, str) else value


# A kept field may not take the name of the output line's own id.
RESERVED_OUTPUT_FIELDS = ("id", "custom_id")


class Fields(StrictModel):
    """Where the parts of a plain offline record are (OpenAI batch lines have their own)."""

    id: str = Field(
        "id", min_length=1, description="The field holding each record's id (a string or integer)."
    )
    text: str | None = Field(
        None,
        min_length=1,
        description="embed: the field holding the text, or a template of fields such as "
        '"{subject}\\n\\n{body}"; default: the field `text`.',
    )
    prompt: str | None = Field(
        None,
        min_length=1,
        description="generate: the field holding the prompt, or a template of fields; "
        "default: the record's fields but the id and `keep` are the request "
        "(prompt, max_tokens, ...); a kept prompt or generation option is still the "
        "request's.",
    )
    keep: list[str] = Field(
        default_factory=list,
        description="Fields copied from each record into its output line, beside the id; "
        "a copied prompt or generation option still applies.",
    )

    @field_validator("text", "prompt")
    @classmethod
    def _valid_template(cls, value: str | None) -> str | None:
        if value is not None and is_template(value):
            Template.parse(value)  # its ValueError says what is wrong and where
        return value

    @field_validator("keep")
    @classmethod
    def _valid_keep(cls, value: list[str]) -> list[str]:
        for name in value:
            if not name:
                raise ValueError("expected field names, found an empty one")
            if name in RESERVED_OUTPUT_FIELDS:
                raise ValueError(
                    f"{name!r} names the output line's id (the record's `fields.id`); "
                    "it cannot be kept under that name"
                )
        twice = sorted({n for n in value if value.count(n) > 1})
        if twice:
            raise ValueError(f"expected each field once, found {', '.join(twice)} twice")
        return value
