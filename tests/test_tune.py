"""`lanes tune`: the choice of the best point, the grid, and real runs on tiny models (an
endpoint on 127.0.0.1, load from child processes)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml
from typer.testing import CliRunner

from lanes.errors import InvalidInput, LanesError
from lanes.router.cli import app
from lanes.router.plot import Chart, Curve, CurvePoint, plotting_missing, save_chart
from lanes.router.tune import (
    Config,
    Plan,
    Point,
    best_point,
    default_levels,
    default_prefills,
    default_sizes,
    default_waits,
    grid,
    measure,
    snippet,
    write_knobs,
)
from lanes.router.tune_cli import parse_ms, parse_prefills
from lanes.settings import Settings
from lanes.spec import InteractiveWorkload
from lanes.specfile import load_spec
from tests.flows_fixtures import write_spec
from tests.servers import ServerThread

ROOT = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

SMALL, LARGE = Config(4, 0.0), Config(16, 2.0)


def point(config: Config, clients: int, rate: float, p99: float | None, errors: int = 0) -> Point:
    p50 = None if p99 is None else p99 / 2
    return Point(config, clients, rate, p50, p99, completed=100, errors=errors)


# ---- choosing ---------------------------------------------------------------------------


def test_the_best_point_is_the_fastest_whose_p99_meets_the_target() -> None:
    points = [
        point(SMALL, 1, 100, 5),
        point(SMALL, 4, 300, 12),
        point(SMALL, 16, 350, 60),  # the fastest of SMALL misses 50 ms
        point(LARGE, 1, 90, 6),
        point(LARGE, 16, 500, 40),  # the fastest that meets it
        point(LARGE, 64, 700, 51),  # faster, but just over
    ]
    assert best_point(points, 50) == points[4]
    assert best_point(points, 51) == points[5]  # at the target meets it
    assert best_point(points, 12) == points[1]
    assert best_point(points, 4) is None


def test_a_point_with_errors_or_no_timed_answer_is_never_chosen() -> None:
    points = [point(SMALL, 1, 100, 5), point(LARGE, 4, 900, 5, errors=1), point(LARGE, 8, 0, None)]
    assert best_point(points, 50) == points[0]
    assert best_point(points[1:], 50) is None


def test_of_two_as_fast_the_lower_p99_wins() -> None:
    points = [point(SMALL, 4, 300, 30), point(LARGE, 4, 300, 20), point(LARGE, 8, 300, 25)]
    assert best_point(points, 50) == points[1]


def test_the_default_grid_is_around_the_declared_knobs() -> None:
    assert default_sizes(32) == [8, 32, 64]
    assert default_sizes(1) == [1, 2]
    assert default_waits(0.0) == [0.0, 2.0]
    assert default_waits(1.0) == [0.0, 1.0, 2.0]
    assert default_levels(64) == [1, 4, 16, 64]
    assert default_levels(32) == [1, 4, 16, 32]
    assert default_levels(1) == [1]
    embed = InteractiveWorkload(mode="interactive", task="embed", model="m")
    assert grid(embed, [4, 16], [0.0, 2.0]) == [
        Config(4, 0.0),
        Config(4, 2.0),
        Config(16, 0.0),
        Config(16, 2.0),
    ]
    generate = InteractiveWorkload(mode="interactive", task="generate", model="m")
    assert grid(generate, [4, 16], None) == [Config(4), Config(16)]
    assert grid(generate, [4, 16], None, [None, 64]) == [
        Config(4),
        Config(4, None, 64),
        Config(16),
        Config(16, None, 64),
    ]
    assert default_prefills(None) == [None, 64, 256]
    assert default_prefills(512) == [128, 512, 1024]
    assert default_prefills(32) == [16, 32, 64]
    with pytest.raises(InvalidInput, match="no max_wait_ms to tune"):
        grid(generate, [4], [1.0])
    with pytest.raises(InvalidInput, match=r"--prefill: .* task 'embed' has none"):
        grid(embed, [4], [0.0], [64])


def test_prefill_budgets_are_read_as_whole_or_token_counts() -> None:
    assert parse_prefills("whole,256,64") == [None, 64, 256]
    assert parse_prefills("64, 64") == [64]
    assert parse_prefills("whole") == [None]
    for bad in ("", "0", "64,big", "1.5"):
        with pytest.raises(InvalidInput, match="--prefill"):
            parse_prefills(bad)


def test_the_yaml_to_paste_holds_the_knobs_alone() -> None:
    pasted = yaml.safe_load(snippet("search", Config(16, 2.0)))
    assert pasted == {
        "workloads": {"search": {"batching": {"max_batch_size": 16, "max_wait_ms": 2}}}
    }
    assert yaml.safe_load(snippet("complete", Config(8))) == {
        "workloads": {"complete": {"batching": {"max_batch_size": 8}}}
    }
    assert yaml.safe_load(snippet("complete", Config(8, None, 64))) == {
        "workloads": {"complete": {"batching": {"max_batch_size": 8, "max_prefill_tokens": 64}}}
    }
    assert Config(8, None, 64).label == "max_batch_size 8, max_prefill_tokens 64"
    assert Config(16, 0.5).label == "max_batch_size 16, max_wait_ms 0.5"


# ---- the chart ------------------------------------------------------------------------------


def test_without_matplotlib_the_message_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    assert plotting_missing() is None  # the dev extra has it
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    missing = plotting_missing()
    assert missing is not None and "pip install 'lanes[plot]'" in missing


def test_a_chart_is_a_png(tmp_path: Path) -> None:
    points = [
        CurvePoint(100, 2, 5, "x1"),
        CurvePoint(400, 5, 20, "x4"),
        CurvePoint(450, None, None),
    ]
    chart = Chart("t", [Curve("a", points), Curve("b", [])], target_ms=10, note="n")
    path = save_chart(chart, tmp_path / "deep" / "chart.png")
    assert path.read_bytes().startswith(PNG_MAGIC)


# ---- real runs ------------------------------------------------------------------------------

# Comments, blank lines, flow and block styles: --write keeps every byte but the knobs.
COMMENTED = """\
# Tiny workloads for lanes tune.
version: 1

models:
  enc: {{path: {enc}, tokenizer: {tokenizer}}}   # the test encoder

workloads:
  search:            # someone waits
    mode: interactive
    task: embed
    model: enc
    batching: {{max_batch_size: 2, max_wait_ms: 0}}   # rows, ms
    slo:
      p99_ms: 2000   # generous: a loaded machine still meets it

  other:    # untouched
    mode: interactive
    task: embed
    model: enc
    batching:
      max_batch_size: 2
"""


def test_write_sets_a_generate_workloads_prefill_budget_beside_its_rows(tmp_path: Path) -> None:
    dec = load_spec(write_spec(tmp_path / "fixture", {}), Settings()).models["dec"]
    original = (
        f"version: 1\nmodels:\n  dec: {{path: {dec.path}, tokenizer: {dec.tokenizer}}}\n"
        "workloads:\n  complete:   # someone waits\n    mode: interactive\n"
        "    task: generate\n    model: dec\n    batching: {max_batch_size: 4}   # rows\n"
    )
    spec_file = tmp_path / "workloads.yaml"
    spec_file.write_text(original)
    batching = write_knobs(spec_file, "complete", Config(8, None, 64), Settings())
    assert (batching.max_batch_size, batching.max_prefill_tokens) == (8, 64)
    assert spec_file.read_text() == original.replace(
        "{max_batch_size: 4}", "{max_batch_size: 8, max_prefill_tokens: 64}"
    )


@pytest.mark.slow
def test_tune_measures_a_grid_draws_it_and_writes_only_the_two_knobs(tmp_path: Path) -> None:
    fixture = write_spec(tmp_path / "fixture", {})
    enc = load_spec(fixture, Settings()).models["enc"]
    spec_file = tmp_path / "workloads.yaml"
    original = COMMENTED.format(enc=enc.path, tokenizer=enc.tokenizer)
    spec_file.write_text(original)
    png = tmp_path / "out" / "search.png"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "lanes.router.cli", "tune", "search", "--spec", str(spec_file)),
            *("--sizes", "1,2", "--waits", "1", "-c", "1,2", "-s", "0.2", "-r", "1"),
            *("--png", str(png), "--write"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "LANES_HOME": str(tmp_path / "home")},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "p99 target 2000 ms (slo.p99_ms)" in done.stdout and "best" in done.stdout
    rows = [line for line in done.stdout.splitlines() if re.search(r"│\s+[12]\s+│", line)]
    assert len(rows) == 4  # 2 configurations x 2 concurrencies
    assert "tuning search" in done.stderr and "4/4" in done.stderr  # the progress
    assert f"chart: {png}" in done.stdout and png.read_bytes().startswith(PNG_MAGIC)

    wrote = re.search(r"wrote max_batch_size (\d+), max_wait_ms (\d+)", done.stdout)
    assert wrote is not None, done.stdout
    size, wait = wrote.groups()
    assert spec_file.read_text() == original.replace(
        "{max_batch_size: 2, max_wait_ms: 0}   # rows",
        f"{{max_batch_size: {size}, max_wait_ms: {wait}}}   # rows",
    )
    batching = load_spec(spec_file, Settings()).workloads["search"].batching  # type: ignore[union-attr]
    assert (batching.max_batch_size, batching.max_wait_ms) == (int(size), float(wait))


def test_tune_says_where_it_stopped_a_configuration_past_the_target(tmp_path: Path) -> None:
    """In this process (the app `lanes` runs): a target no run can meet stops every
    configuration after the first concurrency, and tune says so instead of leaving the
    planned levels out of the table without a word."""
    fixture = write_spec(tmp_path / "fixture", {})
    enc = load_spec(fixture, Settings()).models["enc"]
    spec_file = tmp_path / "workloads.yaml"
    spec_file.write_text(COMMENTED.format(enc=enc.path, tokenizer=enc.tokenizer))
    command = ["tune", "search", "--spec", str(spec_file), "--sizes", "1", "--waits", "1"]
    command += ["-c", "1,2", "-s", "0.2", "-r", "1", "--p99", "0.001ms"]
    home = {"LANES_HOME": str(tmp_path / "home")}
    done = CliRunner().invoke(app, command, env=home, prog_name="lanes")
    assert done.exit_code == 1, done.output
    stopped = "batch 1, wait 1 ms: stopped after 1 client, its p99 past twice the target"
    assert f"{stopped} (0.002 ms)" in done.stderr
    assert "no point met the p99 target of 0.001 ms" in done.stderr


def test_tune_measures_a_model_of_a_short_context(tmp_path: Path) -> None:
    """A valid workload whose model takes 8 tokens: its synthetic texts are cut to fit,
    so no request is refused with a 400."""
    fixture = write_spec(tmp_path / "fixture", {})
    enc = load_spec(fixture, Settings()).models["enc"]
    spec_file = tmp_path / "workloads.yaml"
    spec_file.write_text(
        COMMENTED.format(enc=enc.path, tokenizer=enc.tokenizer).replace(
            "tokenizer: ", "max_length: 8, tokenizer: "
        )
    )
    command = ["tune", "search", "--spec", str(spec_file), "--sizes", "1", "--waits", "1"]
    command += ["-c", "1", "-s", "0.2", "-r", "1"]
    home = {"LANES_HOME": str(tmp_path / "home")}
    done = CliRunner().invoke(app, command, env=home, prog_name="lanes")
    assert done.exit_code == 0, done.output
    assert "best" in done.stdout


@pytest.mark.slow
def test_tune_measures_a_running_endpoint_as_it_serves(tmp_path: Path) -> None:
    workloads = {
        "complete": {
            "mode": "interactive",
            "task": "generate",
            "model": "dec",
            "batching": {"max_batch_size": 2},
            "generation": {"max_new_tokens": 3, "temperature": 0},
        }
    }
    spec_file = write_spec(tmp_path, workloads)
    with ServerThread(spec_file, api_key="the-key") as server:
        settings = Settings(api_key="the-key")  # the clients send it
        plan = Plan([Config(2)], [1, 2], seconds=0.2, repeats=2)
        seen: list[int] = []
        points = measure(
            server.spec,
            "complete",
            settings,
            plan,
            server.url,
            lambda c, lv: seen.append(lv.completed),
        )
        # A target no answer meets: after the first level the configuration gives up.
        hopeless = Plan([Config(2)], [1, 2, 4], seconds=0.2, repeats=1, give_up_ms=1e-6)
        skipped: list[tuple[Config, int]] = []
        first = measure(
            server.spec,
            "complete",
            settings,
            hopeless,
            server.url,
            on_skip=lambda c, n: skipped.append((c, n)),
        )
    assert [p.concurrency for p in first] == [1] and skipped == [(Config(2), 2)]
    assert len(seen) == 4 and all(n > 0 for n in seen)  # every slice got answers
    assert [(p.config, p.concurrency) for p in points] == [(Config(2), 1), (Config(2), 2)]
    for p in points:
        assert p.errors == 0 and p.items_per_second > 0 and p.p99_ms is not None
        assert p.p50_ms is not None and p.p50_ms <= p.p99_ms


def test_a_level_that_fails_stops_sending_at_once(tmp_path: Path) -> None:
    """A wrong key: each of the 4 clients' first answer is a 401, and none sends again
    (it sent thousands a second while the level ran its time)."""
    spec_file = write_spec(
        tmp_path, {"search": {"mode": "interactive", "task": "embed", "model": "enc"}}
    )
    with ServerThread(spec_file, api_key="the-key") as server:
        plan = Plan([Config(2)], [4], seconds=1.0, repeats=1)
        with pytest.raises(
            LanesError, match=r"got no good answers \(\d errors; the first: HTTP 401"
        ):
            measure(server.spec, "search", Settings(api_key="wrong"), plan, server.url)
        key = {"Authorization": "Bearer the-key"}
        text = httpx.get(f"{server.url}/metrics", headers=key).text
    refused = sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("lanes_responses_total{") and 'code="401"' in line
    )
    assert 1 <= refused <= 4


def test_tune_refuses_what_a_running_endpoint_cannot_do(tmp_path: Path) -> None:
    spec_file = write_spec(
        tmp_path, {"search": {"mode": "interactive", "task": "embed", "model": "enc"}}
    )
    done = subprocess.run(
        [
            *(sys.executable, "-m", "lanes.router.cli", "tune", "search", "-f", str(spec_file)),
            *("--endpoint", "http://127.0.0.1:9", "--write"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 2 and "need tune's own endpoint" in done.stderr


def test_the_p99_target_is_read_in_ms_or_s() -> None:
    assert parse_ms("50ms", "--p99") == 50.0
    assert parse_ms("50", "--p99") == 50.0
    assert parse_ms("0.25s", "--p99") == 250.0
    for bad in ("", "fast", "-5ms", "0", "5 min"):
        with pytest.raises(InvalidInput, match="--p99: expected a positive time"):
            parse_ms(bad, "--p99")
