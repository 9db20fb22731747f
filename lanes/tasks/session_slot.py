"""One model's onnxruntime session, which can be released and loaded again.

The embed and infer tasks hold their session here, so that a workload with
`idle_unload_s` can free the session's memory while idle and keep everything else
it loaded (tokenizer, handler, the model's input and output names): loading again is
the session alone, from an optimized copy of the model that the first load wrote to a
temporary folder of this process (see `Runtime.session`), removed with the slot.
"""

from __future__ import annotations

import copy
import logging
import tempfile
from pathlib import Path
from typing import Protocol, Self, runtime_checkable

import onnxruntime as ort

from lanes.binding import Placement
from lanes.errors import ModelError
from lanes.runtime import Runtime
from lanes.spec import InteractiveWorkload, ModelSpec, Workload

log = logging.getLogger(__name__)


def unloads_when_idle(workload: Workload) -> bool:
    """Whether `workload` may unload its model while idle (`idle_unload_s`)."""
    return isinstance(workload, InteractiveWorkload) and workload.idle_unload_s is not None


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

    def discard_copy(self) -> None:
        """Remove the optimized copy kept to load again from (the server stops)."""
        ...


class SessionSlot:
    """`runtime.session(model)`, loaded at construction; `unload` drops it. With
    `reloads`, it keeps an optimized copy of the model to load again from.
    `offline_threads`: how many threads at idle priority run offline batches beside
    this session's runs (`Runtime.offline_threads`); with any, its threads stop
    spinning when a run ends."""

    def __init__(
        self, runtime: Runtime, model: ModelSpec, reloads: bool = False, offline_threads: int = 0
    ) -> None:
        self._runtime = runtime
        self._model = model
        self.offline_threads = offline_threads
        self._session: ort.InferenceSession | None = None
        self.placement: Placement | None = None  # None: runs are not IO-bound
        self._copies: tempfile.TemporaryDirectory[str] | None = None
        self._optimized: Path | None = None
        if reloads:
            try:  # removed when the slot is, or at exit
                self._copies = tempfile.TemporaryDirectory(prefix="lanes-session-")
            except OSError as err:
                log.warning("no optimized copy of %s to reload from: %s", model.path, err)
            else:
                self._optimized = Path(self._copies.name) / model.path.name
        self.load()

    @classmethod
    def of(
        cls, runtime: Runtime, model: ModelSpec, workload: Workload, backfilled: bool = False
    ) -> SessionSlot:
        """The slot of `workload`'s task: reloadable if it unloads while idle, with the
        offline threads `Runtime.offline_threads` gives it."""
        threads = runtime.offline_threads(workload, backfilled)
        return cls(runtime, model, unloads_when_idle(workload), threads)

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
        spins = self.offline_threads == 0
        session = self._runtime.session(self._model, self._optimized, spin_between_runs=spins)
        self.placement = self._runtime.binding(session)
        self._session = session

    def unload(self) -> None:
        # The last reference: onnxruntime frees the session's memory here.
        self._session = None
        self.placement = None

    def discard_copy(self) -> None:
        """Remove the optimized copy now; a later `load` reads the model's own file.
        Not left to the exit handlers: a server stopped by a signal ends by the signal
        (uvicorn raises it again), which runs none."""
        if self._copies is not None:
            self._copies.cleanup()
            self._copies = None
            self._optimized = None

    def one_thread(self) -> SessionSlot:
        """A slot of its own on the same model file, one intra-op thread, loaded now."""
        options = self._model.session.model_copy(
            update={"intra_op_threads": 1, "inter_op_threads": None}
        )
        return SessionSlot(self._runtime, self._model.model_copy(update={"session": options}))


class SlotSession:
    """What a task holding its session in `self.slot` exposes of it (embed, infer)."""

    slot: SessionSlot

    @property
    def session(self) -> ort.InferenceSession:
        return self.slot.session

    @property
    def placement(self) -> Placement | None:
        return self.slot.placement  # None: runs are not IO-bound

    @property
    def loaded(self) -> bool:
        return self.slot.loaded

    @property
    def offline_threads(self) -> int:
        """Threads at idle priority for offline batches beside this task's runs."""
        return self.slot.offline_threads

    def load(self) -> None:
        """Load the session again after `unload` (see lanes/tasks/session_slot.py)."""
        self.slot.load()

    def unload(self) -> None:
        self.slot.unload()

    def discard_copy(self) -> None:
        self.slot.discard_copy()

    def on_one_thread(self) -> Self:
        """This task with its runs on a session of its own with one intra-op thread
        (everything else shared): what runs offline batches at idle priority beside the
        task's own runs (serving/beside.py)."""
        twin = copy.copy(self)
        twin.slot = self.slot.one_thread()
        return twin
