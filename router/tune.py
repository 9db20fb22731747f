"""Search one interactive workload's batching knobs under closed-loop load (`lanes tune`).

The grid is `batching.max_batch_size` x `batching.max_wait_ms` (embed, infer), or
`max_batch_size` x `batching.max_prefill_tokens` (generate: the rows in flight and
the prompt tokens one step prefills; continuous batching has no wait). Every
configuration of the grid is measured at
every concurrency of `levels`, with router.calibrate's synthetic items and
router.loadgen's closed-loop clients (a child process per configuration).

- **Its own endpoint** (the default): one endpoint in this process serves each
  configuration as a copy of the workload of its own (`tune-1`, `tune-2`, ...), with
  its own session, queue and executor; only the one under load runs. So no server is
  restarted between configurations, and they can take turns.
- **A running endpoint** (`endpoint=URL`): its batching cannot be changed from here,
  so the one configuration is the workload's as the spec declares it, and the curve
  is that server's under this load.

At each concurrency, the configurations take turns, `repeats` slices each, in a
rotation that starts with a different one every round (as bench/serve.py does): the
drift of a shared machine hits all alike. A point pools its slices: answers over
timed seconds, and the percentiles of all their latencies. A configuration far past
the target at one concurrency (`Plan.give_up_ms`) stops there.

`best_point` picks the highest throughput whose p99 meets the target.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lanes.errors import InvalidInput, LanesError
from lanes.generation.steer import MIN_PREFILL_TOKENS
from lanes.router.calibrate import Endpoint, lane_spec, synthetic_items
from lanes.router.loadgen import Level, LoadGenerator
from lanes.router.plot import Chart, Chosen, Curve, CurvePoint
from lanes.runtime import Runtime
from lanes.settings import Settings
from lanes.spec import InteractiveWorkload, Spec
from lanes.specedit import Scalar, set_scalars
from lanes.specfile import parse_bytes
from lanes.specinteractive import Batching
from lanes.tasks import load_task

PAUSE_S = 0.03  # between slices: onnxruntime's threads spin a little after a run
ITEMS = 256  # synthetic requests each configuration's clients cycle through
# generate's default prefill budgets beside whole prompts (the synthetic prompts are
# 3 to 12 words: a budget holds a few of them, or several)
WHOLE_PROMPT_ALTERNATIVES = (64, 256)
WARM_S = 0.25  # each slice's untimed start, at most


@dataclass(frozen=True)
class Config:
    """One point of the grid: the knobs it sets (max_wait_ms None: generate, whose
    max_prefill_tokens None is whole prompts)."""

    max_batch_size: int
    max_wait_ms: float | None = None
    max_prefill_tokens: int | None = None

    @property
    def label(self) -> str:
        return ", ".join(f"{key} {_plain(value)}" for key, value in self.knobs().items())

    @property
    def short(self) -> str:
        """The label of a chart's legend and the progress line."""
        if self.max_wait_ms is not None:
            return f"batch {self.max_batch_size}, wait {self.max_wait_ms:g} ms"
        if self.max_prefill_tokens is not None:
            return f"rows {self.max_batch_size}, prefill {self.max_prefill_tokens}"
        return f"rows {self.max_batch_size}"

    def knobs(self) -> dict[str, Scalar]:
        """The `batching:` keys this configuration sets."""
        knobs: dict[str, Scalar] = {"max_batch_size": self.max_batch_size}
        if self.max_wait_ms is not None:
            knobs["max_wait_ms"] = self.max_wait_ms
        if self.max_prefill_tokens is not None:
            knobs["max_prefill_tokens"] = self.max_prefill_tokens
        return knobs

    def applied(self, batching: Batching) -> Batching:
        return batching.model_copy(update=self.knobs())


@dataclass(frozen=True)
class Point:
    """One configuration at one concurrency, its slices pooled."""

    config: Config
    concurrency: int
    items_per_second: float
    p50_ms: float | None
    p99_ms: float | None
    completed: int
    errors: int
    first_error: str | None = None

    def meets(self, target_p99_ms: float) -> bool:
        return self.errors == 0 and self.p99_ms is not None and self.p99_ms <= target_p99_ms


@dataclass(frozen=True)
class Plan:
    """What to measure: each configuration at each level, `repeats` slices of `seconds`.
    A configuration whose p99 at a level is over `give_up_ms`, or that had errors
    there, is not run at more clients (they would only queue longer)."""

    configs: list[Config]
    levels: list[int]
    seconds: float
    repeats: int
    give_up_ms: float | None = None

    @property
    def slices(self) -> int:
        return len(self.configs) * len(self.levels) * self.repeats

    def estimate_s(self) -> float:
        """Roughly how long the slices take (a slow point holds its window open longer)."""
        return self.slices * (self.seconds + min(self.seconds / 4, WARM_S) + PAUSE_S + 0.05)


def best_point(points: Sequence[Point], target_p99_ms: float) -> Point | None:
    """The point of highest throughput among those without errors whose p99 is at most
    `target_p99_ms` (of two as fast, the lower p99); None when no point meets it."""
    meeting = [p for p in points if p.meets(target_p99_ms)]
    if not meeting:
        return None
    return max(meeting, key=lambda p: (p.items_per_second, -(p.p99_ms or 0.0)))


def default_sizes(declared: int) -> list[int]:
    """A quarter of the declared max_batch_size, itself, and twice it."""
    return sorted({max(1, declared // 4), declared, min(2 * declared, 65536)})


def default_waits(declared: float) -> list[float]:
    """No wait, the declared max_wait_ms, and twice it (2 ms when it is 0)."""
    return sorted({0.0, declared, 2 * declared or 2.0})


def default_prefills(declared: int | None) -> list[int | None]:
    """generate: whole prompts and two budgets (a quarter of the declared one, it and
    twice it, when it declares one)."""
    if declared is None:
        return [None, *WHOLE_PROMPT_ALTERNATIVES]
    return [*sorted({max(MIN_PREFILL_TOKENS, declared // 4), declared, 2 * declared})]


def default_levels(largest: int) -> list[int]:
    """1, 4, 16, ... below `largest`, then `largest`: the curve up to the largest batch
    (more clients than rows only queue)."""
    levels = [1]
    while levels[-1] * 4 < largest:
        levels.append(levels[-1] * 4)
    return levels if levels[-1] == largest else [*levels, largest]


def grid(
    workload: InteractiveWorkload,
    sizes: list[int],
    waits: list[float] | None,
    prefills: Sequence[int | None] | None = None,
) -> list[Config]:
    """Every max_batch_size with every max_wait_ms (generate: with every
    max_prefill_tokens)."""
    if workload.task == "generate":
        if waits:
            raise InvalidInput(
                "--waits: a generate workload has no max_wait_ms to tune (continuous "
                "batching takes rows as they come); drop --waits"
            )
        return [Config(size, None, p) for size in sizes for p in (prefills or [None])]
    if prefills:
        raise InvalidInput(
            f"--prefill: max_prefill_tokens bounds a generate workload's prefill; task "
            f"{workload.task!r} has none: drop --prefill"
        )
    return [Config(size, wait) for size in sizes for wait in (waits or [0.0])]


def interactive(spec: Spec, name: str) -> InteractiveWorkload:
    workload = spec.workload(name)
    if not isinstance(workload, InteractiveWorkload):
        raise InvalidInput(
            f"workload {name!r} is offline: lanes tune sets an interactive workload's "
            "batching under load (an offline workload's knob is its batch_size)"
        )
    return workload


def current(workload: InteractiveWorkload) -> Config:
    """The configuration the workload declares."""
    batching = workload.batching
    if workload.task == "generate":
        return Config(batching.max_batch_size, None, batching.max_prefill_tokens)
    return Config(batching.max_batch_size, batching.max_wait_ms)


# ---- measuring -------------------------------------------------------------------------


def measure(
    spec: Spec,
    name: str,
    settings: Settings,
    plan: Plan,
    endpoint: str | None = None,
    on_slice: Callable[[Config, Level], None] = lambda config, level: None,
    on_skip: Callable[[Config, int], None] = lambda config, slices: None,
) -> list[Point]:
    """Every configuration of `plan` at every level (the module docstring), until it
    gives up (`Plan`): on an endpoint of its own, or with `endpoint`, on that running
    server (then `plan` holds one configuration, the one it serves). Points by
    configuration, then level. `on_slice` hears of each slice run, `on_skip` of the
    slices a configuration that gave up leaves out."""
    workload = interactive(spec, name)
    if endpoint is not None and len(plan.configs) != 1:
        raise InvalidInput("a running endpoint serves one configuration: measure one")
    runtime = Runtime(settings)
    # Of the offline copy: a synthetic item holds an offline record beside its request.
    task = load_task(name, lane_spec(spec, name, "offline"), runtime)
    names = [name] if endpoint is not None else [f"tune-{i + 1}" for i in range(len(plan.configs))]
    requests = [
        [item.request for item in synthetic_items(task, ITEMS, name=copy)] for copy in names
    ]
    slices: dict[tuple[int, int], list[Level]] = {}
    with contextlib.ExitStack() as stack:
        if endpoint is None:
            copies = {
                copy: workload.model_copy(update={"batching": config.applied(workload.batching)})
                for copy, config in zip(names, plan.configs, strict=True)
            }
            served = spec.model_copy(update={"workloads": copies})
            url = stack.enter_context(Endpoint(served, settings, runtime)).url
            headers = None
        else:
            url = endpoint.rstrip("/")
            key = settings.api_key
            headers = {"Authorization": f"Bearer {key.get_secret_value()}"} if key else None
        loads = [
            stack.enter_context(LoadGenerator(url, listed, headers=headers)) for listed in requests
        ]
        running = list(range(len(plan.configs)))
        for step, concurrency in enumerate(plan.levels):
            for index, repeat in _turns(running, plan.repeats):
                time.sleep(PAUSE_S)
                level = loads[index].run(concurrency, plan.seconds, min(plan.seconds / 4, WARM_S))
                config = plan.configs[index]
                if concurrency == plan.levels[0] and repeat == 0 and not level.completed:
                    raise LanesError(
                        f"workload {name!r} ({config.label}) at {url}: {concurrency} "
                        f"client(s) got no good answers ({level.errors} errors; the first: "
                        f"{level.first_error})"
                    )
                slices.setdefault((index, concurrency), []).append(level)
                on_slice(config, level)
            for index in list(running):
                point = pooled(plan.configs[index], concurrency, slices[index, concurrency])
                if plan.give_up_ms is not None and not point.meets(plan.give_up_ms):
                    running.remove(index)
                    on_skip(plan.configs[index], (len(plan.levels) - step - 1) * plan.repeats)
    return [
        pooled(config, concurrency, slices[index, concurrency])
        for index, config in enumerate(plan.configs)
        for concurrency in plan.levels
        if (index, concurrency) in slices
    ]


def _turns(order: list[int], repeats: int) -> Iterator[tuple[int, int]]:
    """(configuration, repeat) in rotation: each round starts with the next one."""
    for repeat in range(repeats):
        shift = repeat % len(order) if order else 0
        for index in order[shift:] + order[:shift]:
            yield index, repeat


def pooled(config: Config, concurrency: int, levels: Sequence[Level]) -> Point:
    """One point from its slices: answers over timed seconds, all latencies' percentiles."""
    latencies = np.array([ms for level in levels for ms in level.latencies_ms])
    seconds = sum(level.seconds for level in levels)
    completed = sum(level.completed for level in levels)
    first_errors = [level.first_error for level in levels if level.first_error]
    return Point(
        config=config,
        concurrency=concurrency,
        items_per_second=completed / seconds if seconds > 0 else 0.0,
        p50_ms=float(np.percentile(latencies, 50)) if latencies.size else None,
        p99_ms=float(np.percentile(latencies, 99)) if latencies.size else None,
        completed=completed,
        errors=sum(level.errors for level in levels),
        first_error=first_errors[0] if first_errors else None,
    )


# ---- what tune hands back -----------------------------------------------------------------


def chart(
    name: str, points: Sequence[Point], target_p99_ms: float, best: Point | None, note: str
) -> Chart:
    """The latency/throughput chart of `points`: a curve per configuration."""
    curves: dict[Config, list[CurvePoint]] = {}
    for p in points:
        point = CurvePoint(p.items_per_second, p.p50_ms, p.p99_ms, f"x{p.concurrency}")
        curves.setdefault(p.config, []).append(point)
    chosen = None
    if best is not None:
        label = f"best: {best.config.short}, {clients(best.concurrency)}"
        chosen = Chosen(CurvePoint(best.items_per_second, best.p50_ms, best.p99_ms), label)
    return Chart(
        title=f"lanes tune {name}: latency against throughput",
        curves=[Curve(config.short, listed) for config, listed in curves.items()],
        target_ms=target_p99_ms,
        chosen=chosen,
        note=note,
    )


def clients(n: int) -> str:
    return f"{n} client{'s' if n != 1 else ''}"


def snippet(name: str, config: Config) -> str:
    """The YAML to paste into workloads.yaml (only the knobs tune sets)."""
    knobs = ", ".join(f"{key}: {_plain(value)}" for key, value in config.knobs().items())
    return f"workloads:\n  {name}:\n    batching: {{{knobs}}}\n"


def _plain(value: Scalar) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


def write_knobs(path: Path, name: str, config: Config, settings: Settings) -> Batching:
    """Set `config`'s knobs of workload `name` in the spec file at `path`, every other
    byte kept (lanes.specedit); the new text is validated before it replaces the file.
    Returns the workload's batching as loaded with `settings` (a LANES_WORKLOADS__...
    override still wins over the file)."""
    raw = path.read_bytes()
    bom = b"\xef\xbb\xbf" if raw.startswith(b"\xef\xbb\xbf") else b""
    changes: dict[tuple[str, ...], Scalar] = {
        ("workloads", name, "batching", key): v for key, v in config.knobs().items()
    }
    edited = bom + set_scalars(raw.decode("utf-8-sig"), changes).encode()
    loaded = interactive(parse_bytes(edited, str(path), path.resolve().parent, settings), name)
    # A new file beside it, renamed over it: a reader never sees half a spec.
    draft = path.with_name(f".{path.name}.tune")
    try:
        draft.write_bytes(edited)
        os.chmod(draft, path.stat().st_mode)
        draft.replace(path)
    finally:
        draft.unlink(missing_ok=True)
    return loaded.batching
