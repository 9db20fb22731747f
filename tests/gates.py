"""How tests hold a model run open and move time, so that no test races the wall clock.

- `Gate`: runs wait at it while a test keeps it closed; `allow(n)` lets n through;
  `threads` names the thread each run came on.
  `GatedRuntime` puts a gate in front of every session of the model files it is
  given (the engine's decoder steps); `held` is a handler whose `post` waits at `HELD`
  (a batch worker's runs), `parse_held` one whose `pre` waits at `PARSE_HELD` (the
  preparing of a request's inputs); its `load_gates` hold the creation of a model's
  sessions (a load after `idle_unload_s`).
- `FileGate`: the same between processes: runs wait until a file exists.
- `ManualClock` moves only when told; `JumpClock` is real time plus the jumps a test
  makes (a deadline passes at once, and nothing else changes).
- `wait_until` and `eventually` (on an event loop) poll a condition, with a generous
  bound; `stepping` lets the gated runs through one at a time meanwhile.

Every wait here is bounded by WAIT_S: a test that never opens its gate fails, it
never hangs.
"""

from __future__ import annotations

import asyncio
import collections
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lanes.runtime import Runtime
from lanes.serving.item_cost import INLINE_RUN_S
from lanes.settings import Settings
from lanes.spec import ModelSpec

WAIT_S = 60.0
# A whole `lanes serve` process's start (imports, model loads): on one loaded core, over
# a minute. A generous bound, never a wait.
SERVER_START_S = 180.0
# What a gated handler's item costs at least: a worker never runs a batch measured
# above INLINE_RUN_S per item on its event loop, where waiting at a gate would stop
# the server that should let it through.
PAD_S = 2 * INLINE_RUN_S
GATE_FILE_ENV = "TESTS_GATE_FILE"


class Gate:
    """Open until `close()`; then each run waits in `wait()` until `allow()` or `open()`."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._open = True
        self._permits = 0
        self._row_permits: collections.Counter[int] = collections.Counter()  # allow(rows=)
        self._held: list[int] = []  # the rows of each run waiting now
        self.passed = 0  # runs let through so far
        self.threads: list[str] = []  # the thread of each run that came, in order

    def close(self) -> None:
        with self._changed:
            self._open, self._permits = False, 0
            self._row_permits.clear()

    def open(self) -> None:
        with self._changed:
            self._open = True
            self._changed.notify_all()

    def allow(self, runs: int = 1, rows: int | None = None) -> None:
        """While closed, let `runs` more runs through; with `rows`, only runs of that
        many rows (which of two runs at the gate goes first, when they differ so)."""
        with self._changed:
            if rows is None:
                self._permits += runs
            else:
                self._row_permits[rows] += runs
            self._changed.notify_all()

    @contextmanager
    def closed(self) -> Iterator[Gate]:
        """Closed inside the block, open again however it ends."""
        self.close()
        try:
            yield self
        finally:
            self.open()

    def wait(self, rows: int = 1) -> None:
        """A run's turn: returns once the gate lets it through."""
        with self._changed:
            if not (self._open or self._permits):
                _refuse_on_an_event_loop()
            self._held.append(rows)
            self.threads.append(threading.current_thread().name)
            self._changed.notify_all()
            try:
                passable = self._changed.wait_for(
                    lambda: self._open or self._permits or self._row_permits[rows], WAIT_S
                )
                if not passable:
                    raise TimeoutError(f"a run waited {WAIT_S} s at a gate that never opened")
                if self._open:
                    pass
                elif self._row_permits[rows]:
                    self._row_permits[rows] -= 1
                else:
                    self._permits -= 1
                self.passed += 1
            finally:
                self._held.remove(rows)

    def held_rows(self) -> int:
        """Rows of the runs waiting at the gate now."""
        with self._changed:
            return sum(self._held)

    def blocked(self) -> int:
        """Runs waiting at the gate and not let through yet. A run `allow()` just let
        through may still be in `wait()`, not yet awake: it does not count."""
        with self._changed:
            return self._blocked()

    def _blocked(self) -> int:
        if self._open:
            return len(self._held)
        rows = self._row_permits.items()
        allowed = self._permits + sum(min(n, self._held.count(r)) for r, n in rows)
        return len(self._held) - allowed

    def wait_held(self, runs: int = 1) -> None:
        """Block until `runs` runs are `blocked()` (from a test: `asyncio.to_thread`),
        so `allow(1); wait_held()` waits for the next run, never for the one just
        allowed."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._blocked() >= runs, WAIT_S):
                raise TimeoutError(f"{runs} run(s) did not reach the gate within {WAIT_S} s")


def _refuse_on_an_event_loop() -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError("a run would wait at a gate on an event loop's thread: that loop stops")


class GatedSession:
    """A real onnxruntime session whose every run first passes `gate`; with `pad_s`,
    each of its rows costs at least that (PAD_S: a batch worker never runs it on its
    event loop)."""

    def __init__(self, session: Any, gate: Gate, pad_s: float = 0.0) -> None:
        self._session = session
        self._gate = gate
        self._pad_s = pad_s

    def run(self, output_names: Any, input_feed: Mapping[str, Any], run_options: Any = None) -> Any:
        first = next(iter(input_feed.values()))
        rows = int(first.shape[0]) if first.ndim else 1
        if self._pad_s:
            time.sleep(self._pad_s * rows)
        self._gate.wait(rows)
        return self._session.run(output_names, input_feed, run_options)

    def io_binding(self) -> RowsBinding:
        return RowsBinding(self._session.io_binding())

    def run_with_iobinding(self, binding: RowsBinding, run_options: Any = None) -> Any:
        if self._pad_s:
            time.sleep(self._pad_s * binding.rows)
        self._gate.wait(binding.rows)
        return self._session.run_with_iobinding(binding.binding, run_options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)


class RowsBinding:
    """A real IO binding that notes the rows of the first array bound in, for the gate."""

    def __init__(self, binding: Any) -> None:
        self.binding = binding
        self.rows = 0

    def bind_cpu_input(self, name: str, array: Any) -> None:
        self.rows = self.rows or (int(array.shape[0]) if array.ndim else 1)
        self.binding.bind_cpu_input(name, array)

    def bind_input(
        self, name: str, device: str, index: int, dtype: Any, shape: Any, at: int
    ) -> None:
        self.rows = self.rows or (int(shape[0]) if len(shape) else 1)
        self.binding.bind_input(name, device, index, dtype, shape, at)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.binding, name)


class GatedRuntime(Runtime):
    """The real runtime, whose sessions of the model files in `gates` run behind a gate,
    and whose loads of the files in `load_gates` wait at theirs first. `loads` counts
    the sessions created, per model file."""

    def __init__(
        self,
        settings: Settings,
        gates: Mapping[Path, Gate],
        pad_s: float = 0.0,
        load_gates: Mapping[Path, Gate] | None = None,
    ) -> None:
        super().__init__(settings)
        self.gates = dict(gates)
        self.pad_s = pad_s
        self.load_gates = dict(load_gates or {})
        self.loads: collections.Counter[Path] = collections.Counter()

    def session(
        self, model: ModelSpec, optimized: Path | None = None, spin_between_runs: bool = True
    ) -> Any:
        load_gate = self.load_gates.get(model.path)
        if load_gate is not None:
            load_gate.wait()
        session = super().session(model, optimized, spin_between_runs)
        self.loads[model.path] += 1
        gate = self.gates.get(model.path)
        return session if gate is None else GatedSession(session, gate, self.pad_s)


class GatedPost:
    """A handler whose `post` waits at `gate`, each item costing at least PAD_S."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    def post(self, output: Any) -> Any:
        time.sleep(PAD_S)
        self.gate.wait()
        return output


class GatedPre:
    """A handler whose `pre` waits at `gate`, then passes the input on unchanged."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    def pre(self, item: Any) -> Any:
        self.gate.wait()
        return item


class FileGate:
    """A gate between processes at the path in $TESTS_GATE_FILE: runs wait until that
    file exists, and while one waits, the file's name + ".held" exists.

    A held run in a flow-run process that Prefect is cancelling (its main thread
    unwinds the TerminationSignal of SIGTERM, and waits for the shard threads, one of
    them held here) ends the process at once, as the SIGKILL after Prefect's 30 s
    grace would, instead of holding it for the grace.
    """

    @staticmethod
    def wait() -> None:
        where = os.environ.get(GATE_FILE_ENV)
        if where is None:
            raise RuntimeError(f"a file-gated run, but {GATE_FILE_ENV} names no gate file")
        path = Path(where)
        if path.exists():
            return
        held_marker(path).touch()
        deadline = time.monotonic() + WAIT_S
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"a run waited {WAIT_S} s for {path}, which never appeared")
            if _terminating():
                os._exit(1)
            time.sleep(0.01)


def _terminating() -> bool:
    """Whether the main thread is unwinding Prefect's TerminationSignal."""
    from prefect.exceptions import TerminationSignal

    unwinding: Any = sys._current_exceptions().get(threading.main_thread().ident or 0)
    if isinstance(unwinding, tuple):  # Python 3.11: an exc_info triple
        unwinding = unwinding[1]
    return isinstance(unwinding, TerminationSignal)


def held_marker(gate_file: Path) -> Path:
    return gate_file.with_name(gate_file.name + ".held")


class FileGatedPost:
    """`GatedPost` at the `FileGate`, for a server in another process."""

    @staticmethod
    def post(output: Any) -> Any:
        time.sleep(PAD_S)
        FileGate.wait()
        return output


class ManualClock:
    """A clock that moves only when told to."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now
        self._lock = threading.Lock()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


class JumpClock:
    """time.monotonic() plus every jump so far."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset

    def jump(self, seconds: float) -> None:
        self.offset += seconds


def wait_until(
    check: Callable[[], bool], what: str, timeout: float = WAIT_S, interval: float = 0.01
) -> None:
    """Poll `check()` until it holds, every `interval` seconds: a check that costs
    other processes work (a request that asks a Prefect server) takes a longer one."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(interval)


def stepping(gate: Gate, check: Callable[[], bool]) -> Callable[[], bool]:
    """`check`, letting one run blocked at `gate` through on each call: for waiting on
    what the engine does at its next step (an abort, say), whose run the gate holds."""

    def stepped() -> bool:
        if gate.blocked():
            gate.allow(1)
        return check()

    return stepped


async def eventually(check: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    """Poll `check()` from a coroutine (other tasks run meanwhile) until it holds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        await asyncio.sleep(0.01)


# The handlers of the tests' gated workloads (`handler: tests.gates:held`).
HELD = Gate()
held = GatedPost(HELD)
held_by_file = FileGatedPost()
PARSE_HELD = Gate()
parse_held = GatedPre(PARSE_HELD)
