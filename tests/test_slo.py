"""Latency targets that steer: `slo.p99_ms` sizes the dynamic batches by the cost model,
`slo.timeout_ms` (or X-Timeout-Ms) refuses at once a request that cannot finish by it.

The planner is pure (serving/slo.py), tested on fabricated fits. The worker and the
server run on a ManualClock: the tests' handler (tests/slo_hooks.py) moves it by a
fixed cost per item, the tests move it to make requests wait, and a gate holds a run
on the model; nothing depends on the machine's speed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from lanes.costmodel import Fit, Seen
from lanes.errors import DeadlineExceeded
from lanes.runtime import Runtime
from lanes.serving.batching import UNREACHABLE, BatchQueue
from lanes.serving.metrics import Metrics
from lanes.serving.slo import Waiting, plan_batch
from lanes.serving.state import ServingState
from lanes.serving.worker import BatchWorker
from lanes.settings import Settings
from lanes.specfile import load_spec
from lanes.tasks import load_task
from tests.flows_fixtures import write_spec as fixture_spec
from tests.gates import WAIT_S, ManualClock, eventually
from tests.servers import ServerThread, write_spec
from tests.slo_hooks import costly

MS = 0.001
# 1 ms a run and 1 ms an item: a batch of k takes (1 + k) ms; fitted on runs of every
# size up to 32 (a refusal stands on the sizes seen: Fit.at_least).
EVERY_SIZE = Seen.of(range(1, 33), [0] * 32)
LINEAR = Fit(fixed_s=MS, per_item_s=MS, per_token_s=0.0, spread=1.0, samples=64, seen=EVERY_SIZE)


def arrived(*ages_ms: float, now: float = 100.0, deadline_ms: float | None = None) -> list[Waiting]:
    """Requests that arrived `ages_ms` before `now`, with a deadline `deadline_ms` after
    their arrival."""
    return [
        Waiting(
            now - age * MS,
            None if deadline_ms is None else now - age * MS + deadline_ms * MS,
            0,
        )
        for age in ages_ms
    ]


def test_the_batch_keeps_the_oldest_budget_with_the_most_items() -> None:
    # p99 10 ms, all just arrived: (1 + k) ms <= 10 ms holds up to k = 9.
    assert plan_batch(arrived(*[0] * 20), 100.0, LINEAR, 10 * MS, 32).size == 9
    # The head waited 4.5 ms: 5.5 ms are left, a batch of 4 (5 ms) fits, 5 does not.
    assert plan_batch(arrived(4.5, *[0] * 19), 100.0, LINEAR, 10 * MS, 32).size == 4
    # Never more than max_batch_size, nor more than wait.
    assert plan_batch(arrived(*[0] * 20), 100.0, LINEAR, 10 * MS, 3).size == 3
    assert plan_batch(arrived(0, 0), 100.0, LINEAR, 10 * MS, 32).size == 2
    # No target: the largest batch, the most items per second.
    assert plan_batch(arrived(*[0] * 20), 100.0, LINEAR, None, 32).size == 20


def test_requests_already_past_p99_are_served_and_do_not_shrink_the_batch() -> None:
    # The first two can no longer make 10 ms even alone; the third arrived now: the
    # batch is as large as the third's budget allows (9 in all), the late ones in it.
    plan = plan_batch(arrived(20, 15, *[0] * 20), 100.0, LINEAR, 10 * MS, 32)
    assert plan.size == 9 and plan.unreachable == ()
    # Every one late (overload): the most throughput, the whole batch.
    assert plan_batch(arrived(*[30] * 20), 100.0, LINEAR, 10 * MS, 32).size == 20
    # The spread scales the prediction: at 1.5x, (1 + k) x 1.5 <= 10 holds up to k = 5.
    wide = Fit(MS, MS, 0.0, 1.5, 64)
    assert plan_batch(arrived(*[0] * 20), 100.0, wide, 10 * MS, 32).size == 5


def test_padding_picks_the_size_with_the_most_items_per_second() -> None:
    # 1 ms a run, 0.01 ms a padded token; the third request pads the batch to 100
    # tokens a row: 2 items in 1.2 ms beat 3 in 4 ms, within any budget.
    fit = Fit(MS, 0.0, 0.01 * MS, 1.0, 64)
    waiting = [Waiting(100.0, None, 10), Waiting(100.0, None, 10), Waiting(100.0, None, 100)]
    assert plan_batch(waiting, 100.0, fit, None, 32).size == 2
    assert plan_batch(waiting[:2], 100.0, fit, None, 32).size == 2


def test_a_deadline_bounds_the_batch_and_an_unreachable_one_is_refused() -> None:
    # Deadline 4.5 ms after arrival, no p99: (1 + k) ms <= 4.5 ms up to k = 3.
    assert plan_batch(arrived(*[0] * 10, deadline_ms=4.5), 100.0, LINEAR, None, 32).size == 3
    # The head waited 3.5 ms of its 4.5: its own run (2 ms) ends past it, so it is
    # refused; the others (deadline 10 ms, just arrived) form a batch of 9.
    waiting = arrived(3.5, deadline_ms=4.5) + arrived(*[0] * 12, deadline_ms=10)
    plan = plan_batch(waiting, 100.0, LINEAR, None, 32)
    assert plan.unreachable == (0,) and plan.size == 9
    # Alone, a request whose `upper` but not its expected run misses its deadline
    # still runs: the deadline refuses by the expected time.
    wide = Fit(MS, MS, 0.0, 2.0, 64, EVERY_SIZE)
    plan = plan_batch(arrived(0, deadline_ms=3), 100.0, wide, None, 32)
    assert plan.unreachable == () and plan.size == 1
    # Nor is one refused by the fit's extrapolation below the sizes it saw (8 to 32
    # here): 1.5 ms left, less than (1 + 1) ms, more than an item's share of a run of
    # 8 (9 / 8 ms), which a lone run takes at least. Its deadline bounds the batch.
    young = Fit(MS, MS, 0.0, 1.0, 8, Seen.of(range(8, 33), [0] * 25))
    plan = plan_batch(arrived(3, deadline_ms=4.5), 100.0, young, None, 32)
    assert plan.unreachable == () and plan.size == 1
    plan = plan_batch(arrived(3.5, deadline_ms=4.5), 100.0, young, None, 32)
    assert plan.unreachable == (0,)  # 1 ms left: less than that share


# ---- the worker: its queue's batches sized by its cost model ---------------------------


def worker_for(
    tmp_path: Path, clock: ManualClock, slo: dict[str, float], task: str = "infer"
) -> BatchWorker:
    """A worker (not started: the tests take its batches themselves) of an infer workload
    (model affine), or of an embed one (model enc)."""
    workload = {
        "mode": "interactive",
        "task": task,
        "model": "affine" if task == "infer" else "enc",
        "batching": {"max_batch_size": 32, "max_wait_ms": 0},
        "slo": slo,
    }
    spec = load_spec(fixture_spec(tmp_path, {"live": workload}), Settings())
    task = load_task("live", spec, Runtime(Settings(device="cpu")))
    return BatchWorker(task, Metrics(), clock)


async def test_the_worker_sizes_each_batch_to_the_budget_left(tmp_path: Path) -> None:
    """20 requests wait; the cost model says 1 ms an item (fabricated runs, on the
    worker's clock). The first batch is what fits in the head's p99 budget after its
    wait; then the rest are late, and go together."""
    clock = ManualClock()
    worker = worker_for(tmp_path, clock, {"p99_ms": 10})
    assert worker.steers
    size = worker.steering.batch_size
    for n in (1, 2, 4, 8) * 3:
        worker.cost.observe(n, 0, n * MS)
    pendings = [worker.queue.put(i) for i in range(20)]
    clock.advance(5.5 * MS)  # they waited 5.5 ms: 4.5 ms of budget left, 4 items
    first = await worker.queue.take(size=size)
    assert [p.item for p in first] == [0, 1, 2, 3]
    clock.advance(4 * MS)  # that batch's run: now every one waiting is past 10 ms
    second = await worker.queue.take(size=size)
    assert [p.item for p in second] == list(range(4, 20))
    assert not any(p.future.done() for p in pendings)  # late for p99 is not refused


async def test_without_an_slo_or_a_fit_the_queue_forms_batches_as_before(
    tmp_path: Path,
) -> None:
    clock = ManualClock()
    unsteered = worker_for(tmp_path, clock, {})
    assert not unsteered.steers  # its loop passes no sizing at all (tests/test_batching.py)

    worker = worker_for(tmp_path, clock, {"p99_ms": 10})
    for i in range(20):
        worker.queue.put(i)
    clock.advance(5.5 * MS)
    assert worker.cost.fit is None  # too few runs yet: the whole batch
    assert len(await worker.queue.take(size=worker.steering.batch_size)) == 20


async def test_a_queued_request_past_its_deadline_by_prediction_is_answered_first(
    tmp_path: Path,
) -> None:
    clock = ManualClock()
    worker = worker_for(tmp_path, clock, {"timeout_ms": 10})
    for n in (1, 2, 4, 8) * 3:
        worker.cost.observe(n, 0, n * MS)
    doomed = worker.queue.put("doomed", deadline=clock() + 10 * MS)
    clock.advance(9.5 * MS)  # 0.5 ms left of its deadline; its run takes 1 ms
    fine = worker.queue.put("fine", deadline=clock() + 10 * MS)
    batch = await worker.queue.take(size=worker.steering.batch_size)
    assert [p.item for p in batch] == ["fine"]
    with pytest.raises(DeadlineExceeded, match="cannot finish by its deadline") as refused:
        await doomed.future
    assert refused.value.code == UNREACHABLE
    assert not fine.future.done()


async def test_a_young_fit_refuses_no_request_shorter_than_the_runs_it_has_seen(
    tmp_path: Path,
) -> None:
    """The fit knows only full batches (a burst: 32 rows of 64 tokens, 100 ms a run), so
    it puts the tokens' cost on the items: 3 ms an item, a 1-token one too. A 1-token
    request with 2 ms to its deadline is served (its run takes no time on the worker's
    clock), not refused at once: no run that small was ever seen."""
    clock = ManualClock()
    worker = worker_for(tmp_path, clock, {"timeout_ms": 2}, task="embed")
    for _ in range(8):
        worker.cost.observe(32, 32 * 64, 0.1)
    fit = worker.cost.fit
    assert fit is not None and fit.seconds(1, 1) > 2 * MS  # the young fit's extrapolation
    one_token = worker.task.prepare([5])
    assert one_token.n_tokens == 1
    worker.start()
    try:
        [embedded] = await asyncio.wait_for(worker.submit([one_token]), WAIT_S)
    finally:
        await worker.stop()
    assert len(embedded) == worker.task.dimensions  # type: ignore[attr-defined]
    # A request as long as the rows seen can be refused: an item of a batch of 32 takes
    # no longer than alone, so a lone one takes at least 100 / 32 ms.
    with pytest.raises(DeadlineExceeded, match="cannot finish by its deadline"):
        worker.steering.check_reachable([worker.task.prepare([5] * 64)], clock(), clock(), False)


async def test_a_batch_past_the_sizes_seen_refuses_nobody_beside_it_on_extrapolation(
    tmp_path: Path,
) -> None:
    """Runs of 1 to 4 items, each item cheaper in a larger batch (2, 3, 4 ms): the linear
    fit, past 4 items, grows faster than what it saw. A batch of 32 starts; a request
    beside it, with 10 ms left, is refused only if even the most that the sizes seen
    say of that batch (4 ms, a run of 4) plus its own run (2 ms) ends past it."""
    clock = ManualClock()
    worker = worker_for(tmp_path, clock, {"timeout_ms": 10})
    for items, seconds in [(1, 2 * MS), (2, 3 * MS), (4, 4 * MS)] * 3:
        worker.cost.observe(items, 0, seconds)
    fit = worker.cost.fit
    assert fit is not None and fit.seconds(32, 0) > 10 * MS  # the extrapolation
    steering = worker.steering
    steering.started(clock(), list(range(32)))
    assert steering.check_reachable([0], clock(), clock() + 10 * MS, busy=True) >= 2 * MS
    with pytest.raises(DeadlineExceeded, match="cannot finish by its deadline"):
        steering.check_reachable([0], clock(), clock() + 5 * MS, busy=True)


# ---- through the server: 504 at once, p99 only a target, the fit on /metrics ------------

ITEM_S = costly.item_s
WORKLOADS = f"""\
  costly:                    # each item costs {ITEM_S:g} s on the server's clock
    mode: interactive
    task: embed
    model: minilm
    handler: tests.slo_hooks:costly
    batching: {{max_batch_size: 8, max_wait_ms: 0}}
    slo: {{p99_ms: {1.5 * ITEM_S * 1000:.0f}, timeout_ms: {3 * ITEM_S * 1000:.0f}}}
"""
EMBED = "/v1/embeddings"
TEXT = {"model": "costly", "input": "an embedding, please"}


def ms(runs: float) -> dict[str, str]:
    """An X-Timeout-Ms header of `runs` items' run time."""
    return {"X-Timeout-Ms": f"{runs * ITEM_S * 1000:.0f}"}


@pytest.fixture(scope="module")
def server(demo_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    spec = write_spec(tmp_path_factory.mktemp("slo"), demo_models, WORKLOADS)
    with ServerThread(spec, clock=costly.clock) as running:
        yield running


def cost_metric(server: ServerThread, name: str) -> float | None:
    text = httpx.get(f"{server.url}/metrics", timeout=WAIT_S).text
    for line in text.splitlines():
        if line.startswith(f'{name}{{workload="costly"}} '):
            return float(line.rpartition(" ")[2])
    return None


@pytest.mark.slow
async def test_the_server_refuses_at_once_what_cannot_finish_and_serves_what_is_late(
    server: ServerThread,
) -> None:
    state: ServingState = server.app.state
    worker = state.workers["costly"]
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        # Before a fit: no prediction, and the fit's series say 0 samples.
        assert cost_metric(server, "lanes_cost_samples") == 0
        short = await client.post(EMBED, json=TEXT, headers=ms(0.01))
        assert short.status_code == 200  # not refused: nothing is known yet
        for _ in range(worker.cost.min_samples):
            assert (await client.post(EMBED, json=TEXT)).status_code == 200
        # The fit, on /metrics: every run was one item of ITEM_S.
        assert cost_metric(server, "lanes_cost_per_item_seconds") == pytest.approx(ITEM_S)
        assert cost_metric(server, "lanes_cost_fixed_seconds") == 0
        assert cost_metric(server, "lanes_cost_spread") == pytest.approx(1.0)
        assert cost_metric(server, "lanes_cost_samples") == worker.cost.min_samples + 1

        # A deadline shorter than one run: 504 at once, the model never sees it.
        ran = costly.items
        short = await client.post(EMBED, json=TEXT, headers=ms(0.5))
        assert short.status_code == 504
        assert short.json()["error"] == {
            "message": short.json()["error"]["message"],
            "type": "server_error",
            "param": None,
            "code": UNREACHABLE,
            "request_id": short.headers["x-request-id"],
        }
        assert "cannot finish by its deadline" in short.json()["error"]["message"]
        assert "retry-after" not in short.headers
        assert costly.items == ran

        with costly.gate.closed():
            running = asyncio.create_task(client.post(EMBED, json=TEXT))
            await asyncio.to_thread(costly.gate.wait_held)  # on the model, ITEM_S in
            # Queued behind it: one whose deadline (1.5 runs) it will miss once the
            # clock moves, and one that will miss p99 but not its deadline (3 runs).
            # (Their timers fire a run before their deadlines, in real time: 5 s on, after
            # this test on any machine but a stalled one, and then with the same answer.)
            doomed = asyncio.create_task(client.post(EMBED, json=TEXT, headers=ms(1.5)))
            await eventually(lambda: len(worker.queue) == 1, "the first one queued")
            late = asyncio.create_task(client.post(EMBED, json=TEXT))
            await eventually(lambda: len(worker.queue) == 2, "both queued")
            costly.clock.advance(ITEM_S)  # they waited one run: 0.5 left of doomed's 1.5
            assert not doomed.done() and not late.done()
        # The run ends; the next batch is formed: doomed is answered 504 without
        # running, late (2 runs of its 1.5 p99, within its 3 of timeout) is served.
        assert (await running).status_code == 200
        refused, served = await doomed, await late
        assert refused.status_code == 504 and refused.json()["error"]["code"] == UNREACHABLE
        assert served.status_code == 200
        assert costly.items == ran + 2


async def test_a_queued_timer_fires_one_expected_run_before_the_deadline() -> None:
    """The queue's timer for a request whose own run takes `early_s` fires that long
    before its deadline: from then on it can only be late (here a minute early)."""
    queue = BatchQueue(max_batch_size=8, max_wait_s=0, max_queue=10)
    doomed = queue.put("doomed", deadline=time.monotonic() + WAIT_S, early_s=WAIT_S - 0.01)
    with pytest.raises(DeadlineExceeded, match="cannot finish by its deadline") as refused:
        await asyncio.wait_for(doomed.future, WAIT_S / 2)
    assert refused.value.code == UNREACHABLE
    assert len(queue) == 0
