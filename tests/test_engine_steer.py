"""`slo.ttft_ms` steers the engine's prefill on the demo tinycode decoder (and a
declared `batching.max_prefill_tokens` bounds it the same way): a long prompt is
prefilled in parts, on the cache of its earlier parts, while a decoding row makes a
token at every step, and both get exactly the tokens they get alone.

The clock moves only inside the decoder's prefill runs, by 1 ms a prompt token (the
session is wrapped to move it, and to log each run's shape), so the cost model learns
that cost exactly and the prefill budget it gives is known; what is checked is the
order of the runs, never time.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lanes.runtime import Runtime
from lanes.serving.engine import Engine
from lanes.serving.metrics import Metrics
from lanes.settings import Settings
from lanes.spec import Spec
from lanes.tasks import GenerateTask, load_task
from tests.test_engine import PROMPTS, alone, collect

pytestmark = pytest.mark.slow

PER_TOKEN_S = 0.001
TTFT_MS = 20  # so 20 prompt tokens a step


@dataclass(frozen=True)
class Run:
    rows: int
    new: int  # tokens per row fed
    past: int  # cached positions it ran on


class _PrefillCosts:
    """onnxruntime's session, with a clock that moves on by PER_TOKEN_S per prompt
    token of each run of more than one token (a prefill or a part of one), and a log
    of every run."""

    def __init__(self, session: Any, clock: list[float]) -> None:
        self.session, self.clock = session, clock
        self.runs: list[Run] = []

    def run(self, names: Any, feeds: dict[str, Any]) -> Any:
        ids = feeds["input_ids"]
        if ids.shape[1] > 1:
            self.clock[0] += PER_TOKEN_S * ids.shape[0] * ids.shape[1]
        past = int(feeds["past_key_values.0.key"].shape[2])
        self.runs.append(Run(int(ids.shape[0]), int(ids.shape[1]), past))
        return self.session.run(names, feeds)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.session, name)


# The same budget of 20 tokens a step, steered from the SLO or declared.
BUDGETS = {
    "ttft_ms": {"batching": {"max_batch_size": 4}, "slo": {"ttft_ms": TTFT_MS}},
    "max_prefill_tokens": {"batching": {"max_batch_size": 4, "max_prefill_tokens": TTFT_MS}},
}


def _costed(demo_models: Path, budget: str) -> tuple[GenerateTask, _PrefillCosts, list[float]]:
    """The demo decoder under `budget`, its session costed (`_PrefillCosts`), the clock."""
    folder = demo_models / "tinycode"
    spec = Spec.model_validate(
        {
            "models": {
                "tiny": {"path": folder / "model.onnx", "tokenizer": folder / "tokenizer.json"}
            },
            "workloads": {
                "code": {
                    "mode": "interactive",
                    "task": "generate",
                    "model": "tiny",
                    "generation": {"temperature": 0},
                    **BUDGETS[budget],
                }
            },
        }
    )
    task = load_task("code", spec, Runtime(Settings(device="cpu")))
    assert isinstance(task, GenerateTask)
    now = [1000.0]
    session = _PrefillCosts(task.decoder.session, now)
    task.decoder.session = session  # type: ignore[assignment]
    return task, session, now


@pytest.mark.parametrize("budget", BUDGETS)
async def test_a_long_prompt_is_prefilled_in_parts_while_a_row_keeps_decoding(
    demo_models: Path, budget: str
) -> None:
    task, session, now = _costed(demo_models, budget)
    engine = Engine(task, Metrics(), clock=lambda: now[0])
    engine.start()
    try:
        # One prefill each, of 2 to 11 tokens: the cost model learns 1 ms a token.
        for n in range(2, 12):
            warm = engine.submit(task.prepare({"prompt": list(range(10, 10 + n)), "max_tokens": 1}))
            await collect(warm)
        if budget == "ttft_ms":
            assert engine.steer.prefill_tokens(4096) == TTFT_MS
        assert engine.scheduler.max_prefill_tokens == TTFT_MS

        short = {"prompt": PROMPTS[0][0], "max_tokens": 60}
        long = {"prompt": PROMPTS[5][0], "max_tokens": 6}
        long_request = task.prepare(long)
        length = len(long_request.prompt_ids)
        parts = -(-length // TTFT_MS)
        assert parts >= 3, "the long prompt should take several steps"
        session.runs.clear()
        streams = [engine.submit(task.prepare(short)), engine.submit(long_request)]
        got = [await collect(s) for s in streams]
    finally:
        await engine.stop()
    runs = list(session.runs)  # the engine's (alone() below runs the session too)
    for item, (tokens, text, finish) in zip((short, long), got, strict=True):
        want = alone(task, item)
        assert (tokens, text, finish) == (want.tokens, want.text, want.finish_reason)
    chunks = [i for i, r in enumerate(runs) if r.new > 1 and r.rows == 1]
    chunks = chunks[1:]  # the first is the short prompt's prefill
    assert [(runs[i].new, runs[i].past) for i in chunks] == [
        (min(TTFT_MS, length - start), start) for start in range(0, length, TTFT_MS)
    ], "the long prompt in parts of the budget, each on its earlier parts' cache"
    for before, after in itertools.pairwise(chunks):
        between = runs[before + 1 : after]
        assert any(r.new == 1 for r in between), "the decoding row stepped between parts"


def _busy(metrics: Metrics) -> dict[str, float]:
    """The executor's busy seconds ("executor") and each lane's."""
    found = {
        "executor": metrics.registry.get_sample_value(
            "lanes_executor_busy_seconds_total", {"workload": "code"}
        )
    }
    for lane in ("interactive", "offline"):
        found[lane] = metrics.registry.get_sample_value(
            "lanes_lane_busy_seconds_total", {"workload": "code", "lane": lane}
        )
    return {k: v or 0.0 for k, v in found.items()}


async def test_the_parts_of_a_long_prompt_count_in_its_lane_s_busy_time(
    demo_models: Path,
) -> None:
    """A step that only prefills a part of a prompt (no decoding row beside it) is busy
    time of that prompt's lane: the lanes' busy seconds add up to the executor's. The
    clock moves only in prefill runs, so every busy second is a prefill's or a part's."""
    task, session, now = _costed(demo_models, "max_prefill_tokens")
    metrics = Metrics()
    engine = Engine(task, metrics, clock=lambda: now[0])
    long = {"prompt": PROMPTS[5][0], "max_tokens": 2}
    length = len(task.prepare(long).prompt_ids)
    parts = -(-length // TTFT_MS)
    assert parts >= 3, "the long prompt should take several steps"
    engine.start()
    try:
        await collect(engine.submit(task.prepare(long)))
        interactive = _busy(metrics)
        async with asyncio.timeout(60):
            (done,) = await engine.submit_offline([task.prepare(long)])
        assert not isinstance(done, Exception)
    finally:
        await engine.stop()
    assert sum(r.new > 1 for r in session.runs) == 2 * parts, "each prompt in its parts"
    assert interactive["executor"] == pytest.approx(PER_TOKEN_S * length)
    assert interactive["interactive"] == pytest.approx(interactive["executor"])
    assert interactive["offline"] == 0
    both = _busy(metrics)
    assert both["interactive"] == pytest.approx(interactive["interactive"])
    assert both["offline"] == pytest.approx(both["executor"] - interactive["executor"])
    assert both["offline"] > 0
