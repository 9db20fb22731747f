"""What a run on the endpoint's sessions costs: the model time its items used there
(each batch's answer says it), not its wall time, which holds every wait for
interactive traffic."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from lanes.backfill import BUSY_HEADER
from lanes.flows.batch import offline
from lanes.measurements import Measurements, cost_basis_of, newest
from lanes.router.calibrate import served_from_metrics
from lanes.router.cost_cli import print_costs
from lanes.router.plan import plan
from lanes.serving.batching import DeviceShare
from lanes.serving.metrics import Metrics
from lanes.serving.worker import BatchWorker
from lanes.settings import Settings
from lanes.specfile import load_spec
from tests.flows_fixtures import text, write_jsonl, write_spec
from tests.gates import eventually
from tests.servers import ServerThread
from tests.test_backfill import (
    KEY,
    OFFLINE,
    SPIN_X,
    batch,
    live,
    metric,
    on_endpoint,
    send_batch,
    spin_task,
)

PRICE = 3600.0  # $ per device-hour: a dollar per device-second, so no figure rounds to 0


def records_of(task: str) -> list[dict[str, Any]]:
    if task == "generate":
        # The test decoder completes a -> b -> c -> d, then eos; some end at their first
        # token, which goes out before its step is reported.
        prompts = ["a", "b", "c", "a b", "d a", "b c a"]
        return [
            {"id": f"g{i}", "prompt": prompts[i % 6], "max_tokens": 1 + i % 4} for i in range(32)
        ]  # two batches of 16: a smaller run records no rate (flows.batch)
    return [{"id": f"d{i}", "text": text(i)} for i in range(40)]


@pytest.mark.parametrize("task", ["embed", "generate"])
def test_an_endpoint_run_is_priced_on_its_offline_lane_busy_seconds(
    prefect_api: str,
    serve: type[ServerThread],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    task: str,
) -> None:
    monkeypatch.setenv("LANES_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("LANES_PRICE_PER_DEVICE_HOUR", str(PRICE))
    rows = {"batching": {"max_batch_size": 4}} if task == "generate" else {}
    spec = write_spec(
        tmp_path, {"live": live(task, **rows), "remote": batch(task, runner=on_endpoint())}
    )
    records = records_of(task)
    write_jsonl(tmp_path / "in" / "a.jsonl", records[:10])
    write_jsonl(tmp_path / "in" / "b.jsonl", records[10:])
    with serve(spec, internal_key=KEY) as server:
        monkeypatch.setenv("LANES_ENDPOINT", server.url)
        monkeypatch.setenv("LANES_INTERNAL_KEY", KEY)
        offline(workload="remote", spec=str(spec))
        lane_busy = metric(server, "lanes_lane_busy_seconds_total", workload="live", lane="offline")
    manifest = orjson.loads((tmp_path / "out" / "_manifest.json").read_bytes())

    busy = manifest["busy_seconds"]
    assert manifest["cost_basis"] == "busy_seconds"
    # At most the run's wall time: runs beside each other on the CPU's cores (both
    # shards at once) each count their own time.
    most = manifest["wall_seconds"] * manifest["devices"]
    assert 0 < busy <= most + 1e-3
    shards = [s["busy_seconds"] for s in manifest["shard_stats"]]
    assert len(shards) == 2 and all(s > 0 for s in shards)
    # Nothing else ran offline: the run's shares add up to the lane's busy time (each
    # batch's figure rounded to a microsecond), the run's wall time at most.
    assert lane_busy is not None
    rounding = 1e-6 * (sum(s["batches"] for s in manifest["shard_stats"]) + 1)
    assert sum(shards) == pytest.approx(lane_busy, abs=rounding)
    assert busy == pytest.approx(min(sum(shards), most), abs=1e-3)
    assert manifest["device_hours"] == pytest.approx(busy / 3600, abs=1e-6)
    assert manifest["cost_estimate"] == pytest.approx(busy / 3600 * PRICE, abs=1e-6)
    assert "busy seconds" in cost_basis_of(manifest)

    settings = Settings()
    stored = Measurements(settings.home).load()
    routes = {r.workload: r for r in plan(load_spec(spec, settings), settings, measurements=stored)}
    cost = routes["remote"].cost
    items = manifest["items"]
    assert cost.cost_basis == "busy_seconds"
    # lanes plan shows rates to the hundredth (router/plan.py): at a slow run's rate that is
    # more than a relative 1e-4.
    assert cost.items_per_busy_second == pytest.approx(items / busy, abs=0.005 + 1e-9)
    assert cost.usd_per_1k_items == pytest.approx(PRICE / 3600 / (items / busy) * 1000, rel=1e-6)
    # Wall time would have priced each item higher (or the same, never lower).
    record = newest(stored, "offline", stored[0].model_key, "remote")
    assert record is not None and record.items_per_second <= record.priced_rate
    print_costs(list(routes.values()), settings)
    assert "busy seconds" in capsys.readouterr().out


def test_an_answer_says_its_batch_busy_seconds(serve: type[ServerThread], tmp_path: Path) -> None:
    spec = write_spec(tmp_path, {"search": live(), "corpus": batch(runner=on_endpoint())})
    with serve(spec, internal_key=KEY) as server:
        from lanes.runtime import Runtime
        from lanes.tasks import load_task

        task = load_task("search", load_spec(spec, Settings()), Runtime(Settings(device="cpu")))
        response = send_batch(server, "search", [task.prepare(text(i)) for i in range(6)], KEY)
        lane_busy = metric(
            server, "lanes_lane_busy_seconds_total", workload="search", lane="offline"
        )
    assert response.status_code == 200
    seconds = float(response.headers[BUSY_HEADER])
    assert seconds > 0 and lane_busy is not None
    assert seconds == pytest.approx(lane_busy, abs=1e-6)


def test_metrics_give_the_interactive_lanes_rate_without_the_offline_items(
    serve: type[ServerThread], tmp_path: Path
) -> None:
    # `lanes calibrate --from-metrics` of an endpoint that also runs offline items: the
    # interactive lane's items over its own busy time, not over the offline lane's too
    # (which the lanes share on the model's thread, as on a GPU).
    turns = live(batching={"offline_threads": 0})
    spec = write_spec(tmp_path, {"search": turns, "corpus": batch(runner=on_endpoint())})
    with serve(spec, internal_key=KEY) as server:
        from lanes.runtime import Runtime
        from lanes.tasks import load_task

        task = load_task("search", load_spec(spec, Settings()), Runtime(Settings(device="cpu")))
        items = [task.prepare(text(i)) for i in range(40)]
        assert send_batch(server, "search", items, KEY).status_code == 200
        body = {"model": "search", "input": [text(1), text(2)]}
        assert httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=30).status_code == 200
        scraped = httpx.get(f"{server.url}/metrics", timeout=10).text
        interactive = metric(
            server, "lanes_lane_busy_seconds_total", workload="search", lane="interactive"
        )
    served = served_from_metrics(scraped, "search")
    assert served is not None and served.items == 2
    assert interactive is not None and served.busy_seconds == pytest.approx(interactive)


def test_callers_whose_items_share_a_run_share_its_time_by_items(tmp_path: Path) -> None:
    """One offline run holds one item of one caller and three of another: each gets its
    items' part of the run's time, and together the lane's busy time."""
    task, gate = spin_task(tmp_path, preempt=False)
    quick = task.prepare({"x": SPIN_X, "spin": [[0]]})

    async def scenario() -> tuple[DeviceShare, DeviceShare, int, Metrics]:
        metrics = Metrics()
        worker = BatchWorker(task, metrics)
        worker.start()
        one, three = DeviceShare(), DeviceShare()
        with gate.closed():
            held = asyncio.create_task(worker.submit([quick]))  # holds the model
            await asyncio.to_thread(gate.wait_held)
            first = asyncio.create_task(worker.submit_offline([quick], one))
            second = asyncio.create_task(worker.submit_offline([quick] * 3, three))
            await eventually(lambda: len(worker.lanes.offline) == 4, "both callers queued")
            gate.allow(1)
            await asyncio.to_thread(gate.wait_held)  # the next run: the offline one
            rows = gate.held_rows()
            gate.allow(1)
            await asyncio.wait_for(asyncio.gather(held, first, second), 60)
        await asyncio.wait_for(worker.stop(), 60)
        return one, three, rows, metrics

    one, three, rows, metrics = asyncio.run(scenario())
    assert rows == 4, "the four offline items ran as one run"
    busy = metrics.registry.get_sample_value("lanes_lane_busy_seconds_total", OFFLINE)
    assert busy is not None and one.seconds > 0
    assert three.seconds == pytest.approx(3 * one.seconds)
    assert one.seconds + three.seconds == pytest.approx(busy)


def test_a_local_run_and_an_older_manifest_are_on_wall_time(
    prefect_api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LANES_HOME", str(tmp_path / "home"))
    spec = write_spec(tmp_path, {"corpus": batch()})
    write_jsonl(tmp_path / "in" / "a.jsonl", records_of("embed")[:32])  # two batches
    offline(workload="corpus", spec=str(spec))
    manifest = orjson.loads((tmp_path / "out" / "_manifest.json").read_bytes())
    assert manifest["cost_basis"] == "wall_seconds" and manifest["busy_seconds"] is None
    assert manifest["device_hours"] == pytest.approx(manifest["wall_seconds"] / 3600, abs=1e-6)
    assert cost_basis_of(manifest) == "wall time"
    del manifest["cost_basis"], manifest["busy_seconds"]  # as a manifest from before them
    assert cost_basis_of(manifest) == "wall time (a manifest without cost_basis)"
    [record] = Measurements(Settings().home).load()
    assert record.cost_basis == "wall_seconds"
    assert record.priced_rate == record.items_per_second
