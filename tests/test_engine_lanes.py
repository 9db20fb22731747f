"""The online engine's two lanes on the demo tinycode decoder, without HTTP: offline
sequences fill free rows, give them up to interactive requests at the next step, and
finish with exactly the tokens they make alone (`Decoder.complete`), whether their
cache was kept or recomputed when they resumed.

The decoder runs behind a gate (tests/gates.py), so which run holds which rows is
forced step by step, never timed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from lanes.errors import LanesError, RequestTooLarge
from lanes.generation.preempt import KEEP_BYTES
from lanes.serving.engine import Engine
from lanes.serving.engine_offline import OFFLINE_MAX_SEQUENCES
from lanes.serving.metrics import Metrics
from lanes.settings import Settings
from lanes.spec import Spec
from lanes.tasks import GenerateTask, load_task
from lanes.tasks.decoder import Completion
from tests.gates import Gate, GatedRuntime, eventually
from tests.test_engine import LAYOUTS, alone, collect

pytestmark = pytest.mark.slow

GATE = Gate()
ROWS = 3
OFFLINE = [
    ("def f(x", 14),
    ("class Foo:\n    def __init__(self, name", 16),
    ("import os\nimport sys\n", 18),
    ("for i in range(", 12),
]
INTERACTIVE = ("    return self._", 3)
# How the rows draw: greedy, or sampled, each row seeded (hot enough that a token drawn
# twice, or a generator reset or shared, would change what follows).
DRAWS = {"greedy": {}, "seeded": {"temperature": 1.5, "top_k": 0}}


@pytest.fixture(scope="module", params=LAYOUTS)
def task(demo_models: Path, request: pytest.FixtureRequest) -> Iterator[GenerateTask]:
    folder = demo_models / "tinycode"
    spec = Spec.model_validate(
        {
            "models": {
                "tinycode": {"path": folder / request.param, "tokenizer": folder / "tokenizer.json"}
            },
            "workloads": {
                "code": {
                    "mode": "interactive",
                    "task": "generate",
                    "model": "tinycode",
                    "batching": {"max_batch_size": ROWS},
                    "generation": {"temperature": 0},
                }
            },
        }
    )
    runtime = GatedRuntime(Settings(device="cpu"), {spec.models["tinycode"].path: GATE})
    loaded = load_task("code", spec, runtime)
    assert isinstance(loaded, GenerateTask)
    yield loaded


def sample(metrics: Metrics, name: str, lane: str) -> float:
    value = metrics.registry.get_sample_value(name, {"workload": "code", "lane": lane})
    return 0.0 if value is None else value


async def held() -> int:
    """The rows of the next decoder run, once it waits at the closed gate."""
    await asyncio.to_thread(GATE.wait_held)
    return GATE.held_rows()


def drawn(draws: str, i: int) -> dict[str, object]:
    """An item's sampling fields: none (greedy), or sampled with a seed of its own."""
    return {**DRAWS[draws], "seed": 100 + i} if DRAWS[draws] else {}


@pytest.mark.parametrize("draws", list(DRAWS))
@pytest.mark.parametrize("keep_bytes", [KEEP_BYTES, 0], ids=["kept", "recomputed"])
async def test_an_interactive_request_takes_an_offline_row_at_the_next_step(
    task: GenerateTask, keep_bytes: int, draws: str
) -> None:
    """Offline sequences fill every row; an interactive request arrives during their
    decode; the very next run is its prefill (an offline row was preempted for it).
    Every sequence, the preempted one too, ends with the tokens it makes alone, greedy
    or sampled with a seed (its generator goes on where it stopped, as vLLM's does)."""
    metrics = Metrics()
    engine = Engine(task, metrics, "continuous", max_padding=1e9, keep_bytes=keep_bytes)
    engine.start()
    try:
        offline_items = [
            {"prompt": p, "max_tokens": n, **drawn(draws, i)}
            for i, (p, n) in enumerate(OFFLINE[:ROWS])
        ]
        requests = [task.prepare(item) for item in offline_items]
        item = {"prompt": INTERACTIVE[0], "max_tokens": INTERACTIVE[1], **drawn(draws, ROWS)}
        with GATE.closed():
            backfill = asyncio.create_task(engine.submit_offline(requests))
            assert await held() == ROWS, "the offline prompts prefill together"
            GATE.allow(1)
            assert await held() == ROWS, "every row is an offline one, decoding"
            stream = engine.submit(task.prepare(item))
            GATE.allow(1)
            assert await held() == 1, "the next run is the interactive prompt's prefill"
            assert sample(metrics, "lanes_lane_preemptions_total", "offline") == 1
            GATE.allow(1)
            await eventually(lambda: stream.completion_tokens == 1, "its first token")
            assert not backfill.done()
        tokens, text, finish = await collect(stream)
        async with asyncio.timeout(60):
            done = await backfill
    finally:
        await engine.stop()

    want = alone(task, item)
    assert (tokens, text, finish) == (want.tokens, want.text, want.finish_reason)
    for got, offline_item in zip(done, offline_items, strict=True):
        assert isinstance(got, Completion)
        expected = alone(task, offline_item)
        assert (got.tokens, got.text, got.finish_reason) == (
            expected.tokens,
            expected.text,
            expected.finish_reason,
        ), "no token lost or made twice"
    assert engine.preempted.recomputed == (1 if keep_bytes == 0 else 0)
    assert engine.preempted.kept_bytes == 0, "a resumed cache is no longer held"
    assert sample(metrics, "lanes_lane_items_total", "offline") == ROWS
    assert sample(metrics, "lanes_lane_items_total", "interactive") == 1
    for lane in ("interactive", "offline"):
        assert sample(metrics, "lanes_lane_busy_seconds_total", lane) > 0
        assert sample(metrics, "lanes_lane_queue_depth", lane) == 0
    # Offline tokens are nobody's time to first token.
    ttft = metrics.registry.get_sample_value(
        "lanes_time_to_first_token_seconds_count", {"workload": "code"}
    )
    assert ttft == 1


@pytest.mark.parametrize("draws", list(DRAWS))
async def test_offline_sequences_beyond_the_rows_wait_and_all_finish_as_alone(
    task: GenerateTask, draws: str
) -> None:
    """More offline prompts than rows, interactive ones arriving in between, preempting
    again and again: each gets its tokens alone (greedy or seeded), none lost, none twice."""
    metrics = Metrics()
    engine = Engine(task, metrics, "continuous", keep_bytes=0)
    engine.start()
    try:
        offline_items = [
            {"prompt": p, "max_tokens": n, **drawn(draws, i)} for i, (p, n) in enumerate(OFFLINE)
        ]
        backfill = asyncio.create_task(
            engine.submit_offline([task.prepare(i) for i in offline_items])
        )
        interactive_items = [{"prompt": p, "max_tokens": 4} for p, _ in OFFLINE]
        streams = []
        with GATE.closed():
            for item in interactive_items:
                await held()
                streams.append(engine.submit(task.prepare(item)))
                GATE.allow(2)
        got = [await collect(s) for s in streams]
        async with asyncio.timeout(60):
            done = await backfill
    finally:
        await engine.stop()
    for (tokens, _, _), item in zip(got, interactive_items, strict=True):
        assert tokens == alone(task, item).tokens
    for completion, item in zip(done, offline_items, strict=True):
        assert not isinstance(completion, LanesError)
        assert completion.tokens == alone(task, item).tokens
    assert sample(metrics, "lanes_lane_preemptions_total", "offline") >= 1


async def test_an_offline_batch_larger_than_the_lane_is_too_large_not_busy(
    task: GenerateTask,
) -> None:
    """A batch of more sequences than the offline lane ever holds is refused as too
    large (the flow's endpoint runner sends it in halves), not as a full lane that
    would refuse it as often as the flow retries."""
    engine = Engine(task, Metrics(), "continuous")
    engine.start()
    try:
        request = task.prepare({"prompt": OFFLINE[0][0], "max_tokens": 1})
        with pytest.raises(RequestTooLarge, match=f"at most {OFFLINE_MAX_SEQUENCES}") as big:
            await engine.submit_offline([request] * (OFFLINE_MAX_SEQUENCES + 1))
        # No setting to raise: the lane's own bound, which a smaller batch_size meets.
        assert "its offline lane's queue" in str(big.value) and "max_queue" not in str(big.value)
    finally:
        await engine.stop()
