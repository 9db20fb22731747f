"""The cost of each lane: `lanes plan`'s figures, the manifest's, and `lanes calibrate`
end to end, on tiny real models (an endpoint on 127.0.0.1, load from a child process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from tokenizers import Tokenizer, models, pre_tokenizers
from typer.testing import CliRunner

from lanes.digests import model_key
from lanes.errors import LanesError, WrongMode
from lanes.flows.batch import offline
from lanes.flows.manifest import build_manifest
from lanes.flows.shard import ShardStats
from lanes.measurements import Measurements, Throughput, usd_per_1k_items
from lanes.router.calibrate import (
    concurrency_levels,
    lane_spec,
    measure_interactive,
    measure_offline,
    read_metrics,
    served_from_metrics,
    synthetic_items,
)
from lanes.router.cli import app
from lanes.router.cost_cli import print_costs
from lanes.router.loadgen import HttpRequest, LoadGenerator
from lanes.router.plan import plan
from lanes.runtime import Runtime
from lanes.settings import Settings
from lanes.spec import as_interactive
from lanes.specfile import load_spec
from lanes.tasks import EmbedTask, GenerateTask, load_task
from tests.flows_fixtures import text, write_jsonl, write_spec
from tests.servers import ServerThread

ROOT = Path(__file__).resolve().parent.parent
T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)

WORKLOADS: dict[str, dict[str, Any]] = {
    "search": {
        "mode": "interactive",
        "task": "embed",
        "model": "enc",
        "batching": {"max_batch_size": 4},
        "slo": {"p99_ms": 250},
    },
    "corpus": {
        "mode": "offline",
        "task": "embed",
        "model": "enc",
        "input": "in/",
        "output": "out/",
        "batch_size": 8,
        "retries": 0,
    },
    "scale": {
        "mode": "interactive",
        "task": "infer",
        "model": "affine",
        "batching": {"max_batch_size": 2},
    },
    "complete": {
        "mode": "interactive",
        "task": "generate",
        "model": "dec",
        "batching": {"max_batch_size": 2},
        "generation": {"max_new_tokens": 4, "temperature": 0},
    },
}


def lanes(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lanes.router.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "LANES_HOME": str(home), "LANES_PRICE_PER_DEVICE_HOUR": "3.6"},
        timeout=300,
    )


def measured(
    spec_file: Path, workload: str, lane: str, rate: float, minutes: int = 0, **more: Any
) -> Throughput:
    spec = load_spec(spec_file, Settings())
    return Throughput(
        workload=workload,
        model_key=model_key(spec, spec.workload(workload), Settings()),
        lane=lane,  # type: ignore[arg-type]
        items_per_second=rate,
        measured_at=T0 + timedelta(minutes=minutes),
        source="calibrate",
        **more,
    )


# ---- lanes plan ---------------------------------------------------------------------------


def test_plan_without_measurements_says_how_to_get_them(tmp_path: Path) -> None:
    spec_file = write_spec(tmp_path, WORKLOADS)
    routes = {r.workload: r for r in plan(load_spec(spec_file, Settings()), Settings())}
    search = routes["search"]
    assert (search.cost.lane, search.other_lane_cost.lane) == ("interactive", "offline")
    assert routes["corpus"].cost.lane == "offline"
    assert search.cost.usd_per_1k_items is None and search.cost.items_per_second is None
    assert search.cost.note == "not measured: run lanes calibrate search"
    assert routes["corpus"].other_lane_cost.note == "not measured: run lanes calibrate corpus"


def test_plan_prices_each_lane_from_the_newest_measurement_of_the_model(tmp_path: Path) -> None:
    spec_file = write_spec(tmp_path, WORKLOADS)
    home = tmp_path / "home"
    store = Measurements(home)
    store.save(measured(spec_file, "search", "offline", 100.0, minutes=0))
    store.save(measured(spec_file, "search", "offline", 400.0, minutes=5))  # newer: this one
    store.save(
        measured(
            spec_file, "search", "interactive", 40.0, p99_ms=9.0, slo_p99_ms=250.0, meets_slo=True
        )
    )
    store.save(measured(spec_file, "scale", "interactive", 50.0, meets_slo=False, slo_p99_ms=1.0))

    done = lanes("plan", str(spec_file), "--json", home=home)
    assert done.returncode == 0, done.stderr
    routes = {r["workload"]: r for r in json.loads(done.stdout)}
    own, other = routes["search"]["cost"], routes["search"]["other_lane_cost"]
    assert own["lane"] == "interactive" and own["items_per_second"] == 40.0
    assert own["usd_per_1k_items"] == pytest.approx(usd_per_1k_items(3.6, 40.0))
    assert other["lane"] == "offline" and other["items_per_second"] == 400.0
    assert other["usd_per_1k_items"] == pytest.approx(0.0025)  # $0.001/s over 400 items/s x 1000
    assert other["source"] == "calibrate" and other["measured_at"].startswith("2026-12-01T12:05")
    assert (own["price_per_device_hour"], own["price_is_set"]) == (3.6, True)
    # An offline workload of the same model and task settings is priced by those figures.
    corpus = routes["corpus"]
    assert corpus["cost"]["items_per_second"] == 400.0
    assert corpus["cost"]["measured_for"] == "search"
    assert corpus["other_lane_cost"]["items_per_second"] == 40.0
    assert routes["scale"]["cost"]["note"] == "even one client missed the p99 target of 1 ms"
    assert routes["scale"]["other_lane_cost"]["note"] == "not measured: run lanes calibrate scale"
    assert routes["complete"]["cost"]["usd_per_1k_items"] is None

    table = lanes("plan", str(spec_file), home=home)
    assert table.returncode == 0, table.stderr
    assert "$ per 1k items at $3.6 per device-hour" in table.stdout
    assert (
        "$0.002500" in table.stdout and "not measured: run lanes calibrate complete" in table.stdout
    )


def test_plan_says_which_device_measured_each_rate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A rate measured on the CPU must not pass for a GPU deployment's unsaid.
    spec_file = write_spec(tmp_path, WORKLOADS)
    cpu = measured(spec_file, "search", "interactive", 40.0, provider="CPUExecutionProvider")
    gpu = measured(spec_file, "corpus", "offline", 900.0, provider="CUDAExecutionProvider")
    routes = {
        r.workload: r for r in plan(load_spec(spec_file, Settings()), Settings(), None, [cpu, gpu])
    }
    assert routes["search"].cost.provider == "CPUExecutionProvider"
    assert routes["search"].other_lane_cost.provider == "CUDAExecutionProvider"
    assert routes["search"].as_json()["cost"]["provider"] == "CPUExecutionProvider"
    print_costs([routes["search"]], Settings())
    table = capsys.readouterr().out
    assert "on CPUExecutionProvider" in table and "on CUDAExecutionProvider" in table


def test_plan_without_a_price_says_its_dollars_are_at_the_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # $1 per device-hour is no one's price: the figures must not pass for a chosen one.
    monkeypatch.delenv("LANES_PRICE_PER_DEVICE_HOUR", raising=False)
    spec_file = write_spec(tmp_path, WORKLOADS)
    rate = measured(spec_file, "search", "interactive", 40.0)
    [search, *_] = plan(load_spec(spec_file, Settings()), Settings(), None, [rate])
    for cost in (search.as_json()["cost"], search.as_json()["other_lane_cost"]):
        assert (cost["price_per_device_hour"], cost["price_is_set"]) == (1.0, False)
    print_costs([search], Settings())
    table = " ".join(capsys.readouterr().out.split())
    assert "at $1 per device-hour, the default: set LANES_PRICE_PER_DEVICE_HOUR" in table


def test_plan_shows_very_slow_and_very_cheap_rates_as_what_they_are(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Three significant figures where the fixed decimals would show 0.0 and $0.000000.
    monkeypatch.setenv("LANES_PRICE_PER_DEVICE_HOUR", "3.6")
    spec_file = write_spec(tmp_path, WORKLOADS)
    slow = measured(spec_file, "search", "interactive", 0.004)
    fast = measured(spec_file, "search", "offline", 4_000_000.0)
    [search, *_] = plan(load_spec(spec_file, Settings()), Settings(), None, [slow, fast])
    assert search.cost.items_per_second == 0.004
    assert search.other_lane_cost.usd_per_1k_items == pytest.approx(2.5e-7)
    print_costs([search], Settings())
    table = capsys.readouterr().out
    assert "0.00400" in table and "$0.000000250" in table and "4000000.0" in table


def test_a_sample_that_answers_no_record_plans_without_a_rate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every record of the input is rejected, as its max_error_rate allows: the sample
    # measured nothing, which is no rate of 0 items/s to store (nor a traceback).
    monkeypatch.setenv("LANES_HOME", str(tmp_path / "home"))
    deadline = {"schedule": {"finish_by": "06:00"}, "max_error_rate": 1.0}
    spec_file = write_spec(tmp_path, {"corpus": {**WORKLOADS["corpus"], **deadline}})
    write_jsonl(tmp_path / "in" / "a.jsonl", [{"id": i, "body": text(i)} for i in range(20)])
    settings = Settings()
    [route] = plan(load_spec(spec_file, settings), settings, T0, calibrate=True)
    assert route.deadline is not None
    assert route.deadline["note"].startswith("cannot plan the start: ")
    assert "no record of its input was answered" in route.deadline["note"]
    assert Measurements(settings.home).load() == []


def test_a_sample_measured_under_a_home_that_cannot_keep_it_still_plans(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A worker's home may be read-only: the rate plans this run, kept or not.
    home = tmp_path / "home"
    home.mkdir()
    (home / "measurements").write_text("")  # no folder can be made there
    monkeypatch.setenv("LANES_HOME", str(home))
    deadline = {"schedule": {"finish_by": "06:00"}}
    spec_file = write_spec(tmp_path, {"corpus": {**WORKLOADS["corpus"], **deadline}})
    write_jsonl(tmp_path / "in" / "a.jsonl", [{"id": i, "text": text(i)} for i in range(20)])
    settings = Settings()
    [route] = plan(load_spec(spec_file, settings), settings, T0, calibrate=True)
    assert route.deadline is not None and route.deadline["calibrated"] is True
    assert route.deadline["items_per_second"] > 0
    # The note says the rate was not kept, and why (not that it was stored).
    note = route.deadline["note"]
    assert f"not stored: cannot write under {home / 'measurements'}" in note
    assert "stored with" not in note


# ---- the manifest -------------------------------------------------------------------------


def stats(items: int, host: str = "h1") -> ShardStats:
    return ShardStats(
        input="in/a.jsonl",
        output="out/a.jsonl",
        errors_file="out/_errors/a.jsonl",
        records=items,
        outputs=items,
        errors=0,
        items=items,
        batches=1,
        seconds=1.0,
        host=host,
        provider="CPUExecutionProvider",
        committed_at=T0.isoformat(),
    )


def test_the_manifest_records_the_runs_cost_and_the_interactive_lanes(tmp_path: Path) -> None:
    spec_file = write_spec(tmp_path, WORKLOADS)
    online = measured(spec_file, "search", "interactive", 20.0)
    common: dict[str, Any] = {
        "workload": "corpus",
        "flow_run": None,
        "input": "in/",
        "output": "out/",
        "started": T0,
        "ended": T0 + timedelta(seconds=100),
        "failures": [],
        "price_per_device_hour": 3.6,
    }
    manifest = build_manifest(stats=[stats(600), stats(400, "h2")], interactive=online, **common)
    # Two hosts for 100 s at $0.001 a device-second: $0.20 for 1000 items.
    assert manifest.devices == 2 and manifest.cost_estimate == pytest.approx(0.2)
    assert manifest.cost_per_1k_items == pytest.approx(0.2)
    # On the endpoint at 20 items/s: 50 device-seconds for the same 1000 items.
    assert manifest.interactive_items_per_second == 20.0
    assert manifest.interactive_cost_estimate == pytest.approx(0.05)
    assert manifest.interactive_cost_per_1k_items == pytest.approx(0.05)
    assert (
        manifest.interactive_measured == f"calibrate at {online.measured_at.isoformat()} (search)"
    )

    unmeasured = build_manifest(stats=[stats(0)], interactive=None, **common)
    assert unmeasured.cost_per_1k_items is None
    assert unmeasured.interactive_cost_estimate is None
    assert unmeasured.interactive_items_per_second is None
    assert unmeasured.interactive_measured is None
    summary = unmeasured.summary()
    assert summary["interactive_cost_per_1k_items"] is None and "cost_per_1k_items" in summary


def test_the_manifest_says_which_device_measured_the_interactive_rate(tmp_path: Path) -> None:
    # A GPU run set beside a rate its endpoint measured on the CPU says so.
    spec_file = write_spec(tmp_path, WORKLOADS)
    online = measured(spec_file, "search", "interactive", 20.0, provider="CPUExecutionProvider")
    gpu = replace(stats(100), provider="CUDAExecutionProvider")
    manifest = build_manifest(
        workload="corpus",
        flow_run=None,
        input="in/",
        output="out/",
        started=T0,
        ended=T0 + timedelta(seconds=10),
        stats=[gpu],
        failures=[],
        price_per_device_hour=3.6,
        interactive=online,
    )
    assert manifest.provider == "CUDAExecutionProvider"
    assert manifest.interactive_measured == (
        f"calibrate at {online.measured_at.isoformat()} (search, on CPUExecutionProvider)"
    )


def test_busy_seconds_never_pass_the_wall_time_the_manifest_records() -> None:
    """Shards beside each other each count their model time, so the busy seconds are
    clipped to the run's wall time x devices, as the manifest records that time (to the
    millisecond): a rate per busy second then never falls below the rate per wall
    second, whatever fraction of a millisecond the run took."""
    wall = timedelta(seconds=0.3524)  # recorded as 0.352
    both = [replace(stats(10), busy_seconds=0.2), replace(stats(10), busy_seconds=0.2)]
    manifest = build_manifest(
        workload="corpus",
        flow_run=None,
        input="in/",
        output="out/",
        started=T0,
        ended=T0 + wall,
        stats=both,
        failures=[],
        price_per_device_hour=3.6,
    )
    assert manifest.devices == 1 and manifest.wall_seconds == 0.352
    assert manifest.busy_seconds is not None
    assert manifest.busy_seconds <= manifest.wall_seconds * manifest.devices


def test_a_run_prices_its_items_on_the_endpoint_and_records_its_own_rate(
    prefect_api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("LANES_HOME", str(home))
    monkeypatch.setenv("LANES_PRICE_PER_DEVICE_HOUR", "3600")  # $1 a device-second
    spec_file = write_spec(tmp_path, WORKLOADS)
    online = measured(spec_file, "search", "interactive", 20.0)
    Measurements(home).save(online)
    write_jsonl(tmp_path / "in" / "a.jsonl", [{"id": i, "text": text(i)} for i in range(30)])

    offline(workload="corpus", spec=str(spec_file))

    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert manifest["items"] == 30 and manifest["interactive_items_per_second"] == 20.0
    assert manifest["interactive_cost_estimate"] == pytest.approx(30 / 20.0)
    assert manifest["interactive_cost_per_1k_items"] == pytest.approx(1000 / 20.0)
    # wall_seconds is rounded to the millisecond, the cost to the micro-dollar.
    assert manifest["cost_estimate"] == pytest.approx(manifest["wall_seconds"], abs=1e-3)
    assert manifest["cost_per_1k_items"] == pytest.approx(
        manifest["cost_estimate"] / 30 * 1000, rel=1e-3, abs=1e-3
    )
    assert manifest["interactive_measured"].startswith("calibrate at 2026-12-01T12:00:00")
    records = [r for r in Measurements(home).load() if r.lane == "offline"]
    assert len(records) == 1
    (run,) = records
    assert run.workload == "corpus" and run.source.startswith("manifest ")
    assert run.source.endswith(".json") and "_manifests" in run.source
    assert run.items == 30 and run.batch_size == 8 and run.model_key == online.model_key
    assert run.items_per_second == pytest.approx(30 / manifest["wall_seconds"], rel=0.01)


def test_a_run_of_less_than_two_batches_leaves_the_measured_rate_alone(
    prefect_api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One record's run is mostly its model's loading: 100x the price of 1k items."""
    home = tmp_path / "home"
    monkeypatch.setenv("LANES_HOME", str(home))
    spec_file = write_spec(tmp_path, WORKLOADS)
    earlier = measured(spec_file, "corpus", "offline", 300.0)
    Measurements(home).save(earlier)
    write_jsonl(tmp_path / "in" / "a.jsonl", [{"id": i, "text": text(i)} for i in range(15)])

    offline(workload="corpus", spec=str(spec_file))  # batch_size 8: 15 items, not 2 batches

    assert json.loads((tmp_path / "out" / "_manifest.json").read_text())["items"] == 15
    assert Measurements(home).load() == [earlier]


# ---- lanes calibrate --------------------------------------------------------------------------


def test_concurrency_levels_double_up_to_the_batch_size() -> None:
    assert concurrency_levels(1) == [1]
    assert concurrency_levels(4) == [1, 2, 4]
    assert concurrency_levels(12) == [1, 2, 4, 8, 12]


@pytest.mark.slow
def test_calibrate_measures_and_stores_both_lanes_then_plan_prices_them(tmp_path: Path) -> None:
    spec_file = write_spec(tmp_path, WORKLOADS)
    home = tmp_path / "home"
    done = lanes(
        "calibrate", "search", "--file", str(spec_file), "-s", "0.3", "-n", "40", home=home
    )
    assert done.returncode == 0, done.stderr
    assert "offline lane" in done.stderr and "interactive lane" in done.stderr  # the progress
    assert "p99 target 250 ms" in done.stdout and "chosen" in done.stdout
    records = {r.lane: r for r in Measurements(home).load()}
    assert set(records) == {"offline", "interactive"}
    spec = load_spec(spec_file, Settings())
    key = model_key(spec, spec.workloads["search"], Settings())
    for r in records.values():
        assert r.workload == "search" and r.model_key == key and r.source == "calibrate"
        assert r.items_per_second > 0 and r.provider == "CPUExecutionProvider"
    assert records["offline"].items == 40 and records["offline"].batch_size == 256
    online = records["interactive"]
    assert online.concurrency in (1, 2, 4) and online.slo_p99_ms == 250.0
    assert online.p99_ms is not None and isinstance(online.meets_slo, bool)
    assert online.items > 0

    planned = lanes("plan", str(spec_file), "--json", home=home)
    assert planned.returncode == 0, planned.stderr
    routes = {r["workload"]: r for r in json.loads(planned.stdout)}
    assert routes["search"]["cost"]["items_per_second"] == round(online.items_per_second, 2)
    assert routes["corpus"]["cost"]["items_per_second"] == round(
        records["offline"].items_per_second, 2
    )
    assert routes["corpus"]["other_lane_cost"]["measured_for"] == "search"


@pytest.mark.slow
@pytest.mark.parametrize("workload", ["scale", "complete", "corpus"])
def test_calibrate_runs_both_lanes_of_each_task(workload: str, tmp_path: Path) -> None:
    spec_file = write_spec(tmp_path, WORKLOADS)
    settings = Settings()
    spec = load_spec(spec_file, settings)
    done: list[int] = []
    offline_rate, items = measure_offline(spec, workload, settings, 12, done.append)
    assert sum(done) == 12 and len(items) == 12
    assert offline_rate.lane == "offline" and offline_rate.items == 12
    levels = []
    served = lane_spec(spec, workload, "interactive")
    online, ran = measure_interactive(spec, workload, settings, items, 0.2, levels.append)
    assert (
        ran == levels
        and [lv.concurrency for lv in ran]
        == concurrency_levels(as_interactive(served.workload(workload)).batching.max_batch_size)[
            : len(ran)
        ]
    )
    assert all(lv.errors == 0 for lv in ran)
    assert online.lane == "interactive" and online.items_per_second > 0
    assert online.concurrency in [lv.concurrency for lv in ran]


def short_context(folder: Path) -> Path:
    """WORKLOADS' spec, where `enc` takes 8 tokens and `complete` asks for 60 of the 64
    in `dec`'s context: most synthetic texts of 3-30 words would not fit."""
    spec_file = write_spec(folder, WORKLOADS)
    raw = yaml.safe_load(spec_file.read_text())
    raw["models"]["enc"]["max_length"] = 8
    raw["workloads"]["complete"]["generation"]["max_new_tokens"] = 60
    spec_file.write_text(yaml.safe_dump(raw, sort_keys=False))
    return spec_file


def test_synthetic_items_fit_the_models_context_by_its_own_tokenizer(tmp_path: Path) -> None:
    settings = Settings()
    spec = load_spec(short_context(tmp_path), settings)
    runtime = Runtime(settings)
    embed = load_task("search", lane_spec(spec, "search", "offline"), runtime)
    assert isinstance(embed, EmbedTask)
    texts = [item.record["body"]["input"] for item in synthetic_items(embed, 64)]
    tokens = [len(embed.tokenizer.encode(t).ids) for t in texts]
    assert max(tokens) == 8  # [CLS] 6 words [SEP]: cut to fit, not to nothing
    generate = load_task("complete", lane_spec(spec, "complete", "offline"), runtime)
    assert isinstance(generate, GenerateTask)
    prompts = [item.request.body["prompt"] for item in synthetic_items(generate, 16)]
    assert max(len(generate.decoder.encode(p)) for p in prompts) + 60 == 64


def test_synthetic_items_a_model_refuses_say_why_without_blaming_a_handler(
    tmp_path: Path,
) -> None:
    """`enc`'s tokenizer knows no word of the synthetic texts and has no unknown token
    (and the workload lets its shards commit whatever is refused)."""
    corpus = {**WORKLOADS["corpus"], "max_error_rate": 1.0}
    spec_file = write_spec(tmp_path, {**WORKLOADS, "corpus": corpus})
    tokenizer = Tokenizer.from_file(str(tmp_path / "models" / "enc" / "tokenizer.json"))
    words = tokenizer.get_vocab()
    strict = Tokenizer(models.WordLevel(words))
    strict.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    strict.save(str(tmp_path / "models" / "enc" / "tokenizer.json"))
    settings = Settings()
    with pytest.raises(LanesError, match="items were rejected") as refused:
        measure_offline(load_spec(spec_file, settings), "corpus", settings, 8)
    assert "this model's tokenizer cannot encode the text" in str(refused.value)
    assert "handler" not in str(refused.value)


@pytest.mark.parametrize("seconds", ["nan", "inf"])
def test_calibrate_refuses_seconds_that_are_no_finite_number(seconds: str, tmp_path: Path) -> None:
    # Before measuring anything: nan timed no level at all, and inf never ended.
    spec_file = write_spec(tmp_path, WORKLOADS)
    command = ["calibrate", "search", "--file", str(spec_file), "-s", seconds, "-n", "8"]
    done = CliRunner().invoke(app, command, env={"LANES_HOME": str(tmp_path / "home")})
    assert done.exit_code != 0
    assert f"--seconds: expected a positive number of seconds, found {seconds}" in done.output
    assert Measurements(tmp_path / "home").load() == []


@pytest.mark.slow
def test_calibrate_measures_a_model_of_a_short_context(tmp_path: Path) -> None:
    """A valid workload whose model takes 8 tokens: no synthetic item is refused."""
    spec_file = short_context(tmp_path)
    command = ["calibrate", "search", "--file", str(spec_file), "-s", "0.2", "-n", "40"]
    home = {"LANES_HOME": str(tmp_path / "home")}
    done = CliRunner().invoke(app, command, env=home, prog_name="lanes")
    assert done.exit_code == 0, done.output
    records = {r.lane: r for r in Measurements(tmp_path / "home").load()}
    assert set(records) == {"offline", "interactive"} and records["offline"].items == 40


def test_metrics_of_a_running_endpoint_give_items_per_busy_second(tmp_path: Path) -> None:
    spec_file = write_spec(tmp_path, WORKLOADS)
    with ServerThread(spec_file) as server:
        settings = server.settings
        with httpx.Client(base_url=server.url, timeout=30) as client:
            for i in range(5):
                body = {"model": "search", "input": [text(i), text(i + 1)]}
                assert client.post("/v1/embeddings", json=body).status_code == 200
            for _ in range(3):
                body = {"model": "complete", "prompt": "a", "max_tokens": 3}
                assert client.post("/v1/completions", json=body).status_code == 200
            metrics = client.get("/metrics").text
        embedded = served_from_metrics(metrics, "search")
        assert embedded is not None and embedded.items == 10 and embedded.busy_seconds > 0
        completed = served_from_metrics(metrics, "complete")
        assert completed is not None and completed.items == 3 and completed.busy_seconds > 0
        assert served_from_metrics(metrics, "scale") is None  # never ran

        record = read_metrics(server.spec, "search", settings, server.url)
        assert record.lane == "interactive" and record.items == 10
        assert record.source == f"metrics {server.url}"
        assert record.items_per_second == pytest.approx(10 / embedded.busy_seconds)
        with pytest.raises(LanesError, match="has run nothing there yet"):
            read_metrics(server.spec, "scale", settings, server.url)
        # An offline workload never runs there under its name: said so, not "nothing yet".
        with pytest.raises(WrongMode, match=r"'corpus' is offline: the endpoint at .* never"):
            read_metrics(server.spec, "corpus", settings, server.url)


def test_metrics_may_be_named_by_their_scrape_url(tmp_path: Path) -> None:
    """`--from-metrics http://host:8000/metrics`, as a Prometheus config holds it, reads
    that page (not /metrics/metrics, a 404); a page that is not there is one line."""
    spec_file = write_spec(tmp_path, WORKLOADS)
    with ServerThread(spec_file) as server:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            body = {"model": "search", "input": [text(1), text(2)]}
            assert client.post("/v1/embeddings", json=body).status_code == 200
        for url in (server.url + "/metrics", server.url + "/metrics/"):
            record = read_metrics(server.spec, "search", server.settings, url)
            assert record.items == 2 and record.source == f"metrics {server.url}"
        with pytest.raises(LanesError, match=r"/nope/metrics: it answered 404; give") as err:
            read_metrics(server.spec, "search", server.settings, server.url + "/nope")
        assert "\n" not in str(err.value)


def test_the_load_generator_counts_refused_requests_as_errors(tmp_path: Path) -> None:
    spec_file = write_spec(tmp_path, WORKLOADS)
    with ServerThread(spec_file) as server:
        good = HttpRequest("/v1/embeddings", {"model": "search", "input": "w1 w2"})
        with LoadGenerator(server.url, [good]) as load:
            level = load.run(2, 0.2, warm_s=0.0)
        assert level.concurrency == 2 and level.errors == 0 and level.completed > 0
        assert level.p50_ms is not None and level.p99_ms is not None
        bad = HttpRequest("/v1/embeddings", {"model": "nobody", "input": "w1"})
        with LoadGenerator(server.url, [bad]) as load:
            refused = load.run(1, 0.2, warm_s=0.0)
        assert refused.completed == 0 and refused.errors > 0 and refused.p99_ms is None
        assert refused.first_error is not None and refused.first_error.startswith("HTTP 404")
