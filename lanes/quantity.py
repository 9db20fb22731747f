"""Kubernetes CPU quantities in workloads.yaml (`deploy.cpu`): what a pod may use, and
the whole cores that allows onnxruntime's threads."""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Annotated, Any

from pydantic import BeforeValidator

# Cores ("2", "1.5") or millicores ("500m"): what Kubernetes writes for CPU.
CPU_PATTERN = re.compile(r"^([0-9]+(\.[0-9]+)?)(m?)$")


def cpu_cores(text: str) -> Decimal:
    """The cores a CPU quantity names ("500m" -> 0.5). ValueError unless it matches."""
    found = CPU_PATTERN.match(text)
    if found is None:
        raise ValueError(f"expected CPUs such as 2, 1.5 or 500m, found {text!r}")
    number = Decimal(found.group(1))
    return number / 1000 if found.group(3) else number


def whole_cores(text: str) -> int:
    """The threads a pod of `text` CPUs runs without oversubscribing its quota: the whole
    cores, rounded down (1.5 -> 1: a second thread would get half a core and stall every
    parallel operator at its barrier while the quota throttles it), at least 1."""
    return max(1, int(cpu_cores(text)))


def _cpu(value: Any) -> Any:
    # YAML writes `cpu: 3` as an integer, as most Kubernetes YAML does; a bool is no count.
    if isinstance(value, int | float) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        return value  # the str type says what is wrong
    if cpu_cores(value) <= 0:
        raise ValueError(f"expected more than 0 CPUs, found {value!r}")
    return value


CpuQuantity = Annotated[str, BeforeValidator(_cpu)]
