"""Where a session's tensors live, and runs with onnxruntime's IO binding.

`session.run` takes numpy inputs and returns numpy outputs: on a GPU provider every
run copies each input to the device and each output back, and allocates both.
With IO binding the inputs are bound once per run (host arrays copied to the device
by onnxruntime, or OrtValues already there bound as they are), and outputs are
allocated on the session's device: a decoder's past key/values can then stay there
between steps (lanes/tasks/device_past.py). On the CPU provider a bound run is the
same code path with the device being the host, which is how the tests exercise it.

`Placement.of(session)` says where a session runs; `uses_io_binding` is the pure
decision of whether to bind (the `io_binding` setting); `run` runs a session one way
or the other and returns numpy outputs either way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import onnxruntime as ort

from lanes.settings import IoBinding

Array = np.ndarray[Any, Any]

# Providers whose tensors live in CUDA memory (TensorRT allocates through CUDA).
_CUDA_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider")


@dataclass(frozen=True)
class Placement:
    """A device as onnxruntime names it in `OrtValue`s and bindings: ("cpu", 0), ("cuda", 1)."""

    device_type: Literal["cpu", "cuda"]
    device_id: int = 0

    @classmethod
    def of(cls, session: ort.InferenceSession) -> Placement:
        """Where `session` runs: its first provider (the one that takes every node it
        can) decides; the CUDA device id comes from that provider's options."""
        provider = session.get_providers()[0]
        if provider not in _CUDA_PROVIDERS:
            return cls("cpu")
        options = session.get_provider_options().get(provider, {})
        return cls("cuda", int(options.get("device_id", 0) or 0))

    @property
    def on_gpu(self) -> bool:
        return self.device_type == "cuda"

    def __str__(self) -> str:
        return f"{self.device_type}:{self.device_id}"


def uses_io_binding(setting: IoBinding, placement: Placement) -> bool:
    """Pure: `on` and `off` are what they say; `auto` binds on a GPU, where it saves a
    copy of every input and output per run, and not on the CPU, where `session.run`
    already reads and writes host memory."""
    if setting == "auto":
        return placement.on_gpu
    return setting == "on"


def bind_inputs(binding: ort.IOBinding, feeds: Mapping[str, Array | ort.OrtValue]) -> None:
    """Host arrays are bound with `bind_cpu_input` (onnxruntime copies them to the
    device once, when the run needs them there); OrtValues are bound where they are."""
    for name, value in feeds.items():
        if isinstance(value, ort.OrtValue):
            binding.bind_ortvalue_input(name, value)
        else:
            binding.bind_cpu_input(name, np.ascontiguousarray(value))


def run(
    session: ort.InferenceSession,
    names: Sequence[str],
    feeds: Mapping[str, Array],
    placement: Placement | None,
    options: ort.RunOptions | None = None,
) -> list[Any]:
    """`session.run(names, feeds)`, IO-bound when `placement` is given: inputs bound
    once, outputs allocated on that device and copied to the host once, after the run
    (numeric tensors only: `Runtime.binding` gives None for other models). Each call
    makes its own binding, so runs from many threads do not share one. `options`: the
    run's, whose `terminate` another thread may set to end it early (it raises)."""
    if placement is None:
        return list(session.run(list(names), dict(feeds), options))
    binding = session.io_binding()
    bind_inputs(binding, feeds)
    for name in names:
        binding.bind_output(name, placement.device_type, placement.device_id)
    session.run_with_iobinding(binding, options)
    return list(binding.copy_outputs_to_cpu())
