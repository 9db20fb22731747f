"""One model's onnxruntime session, which can be released and loaded again.

The embed and infer tasks hold their session here, so that a workload with
`idle_unload_s` can free the session's memory while idle and keep everything else
it loaded (tokenizer, handler, the model's input and output names): loading again is
the session alone.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import onnxruntime as ort

from lanes.binding import Placement
from lanes.errors import ModelError
from lanes.runtime import Runtime
from lanes.spec import ModelSpec


@runtime_checkable
class Releasable(Protocol):
    """A task whose model session can be released while idle and loaded again."""

    @property
    def loaded(self) -> bool: ...

    def load(self) -> None:
        """Create the session again (a no-op while loaded); `ModelError` if it cannot."""
        ...

    def unload(self) -> None:
        """Release the session and its memory; runs fail until `load`."""
        ...


class SessionSlot:
    """`runtime.session(model)`, loaded at construction; `unload` drops it."""

    def __init__(self, runtime: Runtime, model: ModelSpec) -> None:
        self._runtime = runtime
        self._model = model
        self._session: ort.InferenceSession | None = None
        self.placement: Placement | None = None  # None: runs are not IO-bound
        self.load()

    @property
    def loaded(self) -> bool:
        return self._session is not None

    @property
    def session(self) -> ort.InferenceSession:
        """The session; `ModelError` while unloaded (the server loads it before a run)."""
        if self._session is None:
            raise ModelError(f"the session of {self._model.path} is unloaded; load it first")
        return self._session

    def load(self) -> None:
        if self._session is not None:
            return
        session = self._runtime.session(self._model)
        self.placement = self._runtime.binding(session)
        self._session = session

    def unload(self) -> None:
        # The last reference: onnxruntime frees the session's memory here.
        self._session = None
        self.placement = None
