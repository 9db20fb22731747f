"""Per-lane measurements: stored under a home, read back newest first; $ per 1k items."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from lanes.measurements import Measurements, Throughput, newest, usd_for, usd_per_1k_items

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def record(
    workload: str = "w",
    lane: str = "offline",
    rate: float = 100.0,
    minutes: int = 0,
    key: str = "k1",
    **more: object,
) -> Throughput:
    return Throughput(
        workload=workload,
        model_key=key,
        lane=lane,  # type: ignore[arg-type]
        items_per_second=rate,
        measured_at=T0 + timedelta(minutes=minutes),
        source="calibrate",
        **more,  # type: ignore[arg-type]
    )


def test_records_come_back_whole_and_newest_first(tmp_path: Path) -> None:
    store = Measurements(tmp_path)
    older = record(minutes=0, rate=10.0, items=500, provider="CPUExecutionProvider")
    newer = record(
        lane="interactive", minutes=5, rate=20.0, concurrency=4, p99_ms=3.5, meets_slo=True
    )
    paths = [store.save(older), store.save(newer)]
    assert all(p.parent == tmp_path / "measurements" / "w" for p in paths)
    assert sorted(p.name for p in (tmp_path / "measurements" / "w").iterdir()) == sorted(
        p.name for p in paths
    ), "no temporary file is left beside the records"
    assert store.load() == [newer, older]


def test_an_unreadable_record_is_skipped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = Measurements(tmp_path)
    good = record()
    store.save(good)
    (tmp_path / "measurements" / "w" / "broken.json").write_text('{"workload": "w"')
    (tmp_path / "measurements" / "w" / "wrong.json").write_text('{"workload": "w", "lane": "x"}')
    with caplog.at_level(logging.WARNING, logger="lanes.measurements"):
        assert store.load() == [good]
    assert "broken.json" in caplog.text and "wrong.json" in caplog.text


def test_a_record_that_cannot_price_an_item_is_skipped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Hand-edited or written by something else: each reads as a record, none can be
    # priced or ordered beside the others, and none may fail a plan or a run's manifest.
    store = Measurements(tmp_path)
    good = record()
    store.save(good)
    folder = tmp_path / "measurements" / "w"
    written = (folder / next(folder.iterdir()).name).read_text()
    bad = {
        "zero": written.replace('"items_per_second": 100.0', '"items_per_second": 0.0'),
        "nan": written.replace('"items_per_second": 100.0', '"items_per_second": NaN'),
        "busy": written.replace('"items_per_busy_second": null', '"items_per_busy_second": -1'),
        "naive": written.replace("2026-12-01T12:00:00+00:00", "2026-12-01T13:00:00"),
    }
    for name, text in bad.items():
        assert text != written, name
        (folder / f"{name}.json").write_text(text)
    with caplog.at_level(logging.WARNING, logger="lanes.measurements"):
        assert store.load() == [good]
    assert all(f"{name}.json" in caplog.text for name in bad)
    with pytest.raises(ValueError, match="items_per_second"):
        store.save(record(rate=float("nan")))


def test_a_home_without_measurements_has_none(tmp_path: Path) -> None:
    assert Measurements(tmp_path / "nowhere").load() == []


def test_a_rate_that_is_not_positive_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="items_per_second"):
        Measurements(tmp_path).save(record(rate=0.0))
    with pytest.raises(ValueError, match="items_per_second"):
        usd_per_1k_items(1.0, 0.0)


def test_dollars_per_1k_items_is_the_device_second_price_over_the_rate() -> None:
    # $3.60 an hour is $0.001 a second: at 1 item/s, 1000 items take 1000 s.
    assert usd_per_1k_items(3.6, 1.0) == pytest.approx(1.0)
    assert usd_per_1k_items(3.6, 1000.0) == pytest.approx(0.001)
    assert usd_per_1k_items(0.0, 5.0) == 0.0
    assert usd_for(3.6, 2.0, 500) == pytest.approx(0.25)
    assert record(rate=4.0).usd_per_1k_items(7.2) == pytest.approx(0.5)


def test_newest_prefers_the_workloads_own_then_its_models_and_keeps_lanes_apart() -> None:
    own = record("a", minutes=1, rate=1.0)
    other_newer = record("b", minutes=9, rate=2.0)
    other_model = record("a", minutes=10, rate=3.0, key="k2")
    online = record("a", lane="interactive", minutes=11, rate=4.0)
    records = sorted(
        [own, other_newer, other_model, online], key=lambda r: r.measured_at, reverse=True
    )
    assert newest(records, "offline", "k1", "a") == own
    assert newest(records, "offline", "k1", "c") == other_newer  # another workload, same model
    assert newest(records, "offline", "k2", "a") == other_model
    assert newest(records, "interactive", "k1", "b") == online
    assert newest(records, "interactive", "k2", "a") is None
    assert newest([], "offline", "k1") is None
