"""How lanes reads its LANES_ variables (lanes.settings' source): as pydantic-settings
reads them, but for the spec's overrides, merged deeper over shallower in any order."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, get_origin

from pydantic.fields import FieldInfo
from pydantic_settings import EnvSettingsSource


class LanesEnvironment(EnvSettingsSource):
    """The LANES_ variables, read as pydantic-settings reads them but for the spec's
    overrides, where a variable and one below it (LANES_WORKLOADS__A__BATCHING='{...}'
    and LANES_WORKLOADS__A__BATCHING__MAX_WAIT_MS) both set a key: pydantic-settings keeps
    whichever the environment lists later, an order nobody chooses, and leaves a whole
    workload's JSON (LANES_WORKLOADS__A='{...}') as text. Here each variable is read on
    its own, a workload's or model's JSON decoded, and the deeper merged over the
    shallower, as `set_by` (lanes.settings_origin) names them."""

    def explode_env_vars(
        self, field_name: str, field: FieldInfo, env_vars: Mapping[str, str | None]
    ) -> dict[str, Any]:
        if get_origin(field.annotation) is not dict:
            return super().explode_env_vars(field_name, field, env_vars)
        delimiter = self.env_nested_delimiter or "__"
        merged: dict[str, Any] = {}
        for name in sorted(env_vars, key=lambda name: name.count(delimiter)):
            one = super().explode_env_vars(field_name, field, {name: env_vars[name]})
            _merge(merged, {key: _object(value) for key, value in one.items()})
        return merged

    def decode_complex_value(self, field_name: str, field: FieldInfo, value: Any) -> Any:
        try:
            return super().decode_complex_value(field_name, field, value)
        except RecursionError:
            # json.loads recurses once per level; pydantic-settings takes a ValueError.
            raise ValueError(f"{field_name}: JSON nested too deep") from None


def _object(value: Any) -> Any:
    """`value`, or the object its text holds as JSON."""
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            return json.loads(value)
        except (ValueError, RecursionError):
            return value  # the spec's check says what it expected
    return value


def _merge(into: dict[str, Any], values: dict[str, Any]) -> None:
    for key, value in values.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value
