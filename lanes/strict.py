"""The base of every model of workloads.yaml (lanes.spec, lanes.schedule)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """Unknown keys are errors; infinities and NaN are refused; nothing is coerced that
    would surprise (a number is not a string, a mapping is not a name)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
