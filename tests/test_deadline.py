"""Deadline scheduling (lanes.deadline) with an injected clock: no waiting, no wall time."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from lanes.deadline import MARGIN, STARTUP_S, offpeak_opening, plan_start
from lanes.schedule import Schedule

NOW = datetime(2030, 1, 1, 22, 0, tzinfo=UTC)
OPENS = datetime(2030, 1, 2, 2, 0, tzinfo=UTC)  # the off-peak window
FINISH_BY = datetime(2030, 1, 2, 7, 0, tzinfo=UTC)


def test_the_start_is_the_latest_that_ends_by_the_deadline() -> None:
    plan = plan_start(36_000, 10.0, FINISH_BY, OPENS, NOW)  # one hour of work
    needed = timedelta(seconds=3600 * (1 + MARGIN) + STARTUP_S)
    assert plan.start == FINISH_BY - needed == datetime(2030, 1, 2, 5, 44, tzinfo=UTC)
    assert plan.expected_finish == plan.start + timedelta(seconds=3600 + STARTUP_S)
    assert plan.on_time and "latest moment" in plan.note


def test_a_run_that_does_not_fit_off_peak_starts_now_and_says_so() -> None:
    plan = plan_start(36_000 * 6, 10.0, FINISH_BY, OPENS, NOW)  # six hours: before 02:00
    assert plan.start == NOW
    assert plan.on_time and "does not fit" in plan.note and "inside the off-peak" in plan.note


def test_an_impossible_deadline_starts_now_and_says_so() -> None:
    plan = plan_start(36_000 * 24, 10.0, FINISH_BY, OPENS, NOW)  # a day of work
    assert plan.start == NOW and not plan.on_time
    assert plan.expected_finish == NOW + timedelta(seconds=24 * 3600 + STARTUP_S)
    assert "even if started now" in plan.note


def test_without_a_measured_rate_a_window_past_the_deadline_is_not_waited_for() -> None:
    """A Batch API batch of 2 h made at 22:00 with the window at 02:00: waiting would
    expire it with nothing done."""
    plan = plan_start(100, None, NOW + timedelta(hours=2), OPENS, NOW)
    assert plan.start == NOW and not plan.fits
    assert "past the deadline" in plan.note and "lanes calibrate" in plan.note


def test_without_a_measured_rate_it_starts_when_the_window_opens() -> None:
    plan = plan_start(100, None, FINISH_BY, OPENS, NOW)
    assert plan.start == OPENS and plan.expected_finish is None
    assert "lanes calibrate" in plan.note
    # A window already open opens now.
    assert plan_start(100, None, FINISH_BY, OPENS, OPENS + timedelta(hours=1)).start == (
        OPENS + timedelta(hours=1)
    )


def test_a_batch_arriving_in_an_open_off_peak_window_starts_in_it() -> None:
    window = Schedule(cron="0 2 * * *", finish_by="06:00")
    inside, after = OPENS + timedelta(hours=1), OPENS + timedelta(hours=5)
    assert offpeak_opening(window, inside) == OPENS  # open: plan_start clamps it to now
    assert offpeak_opening(window, after) == OPENS + timedelta(days=1)  # closed at 06:00
    assert offpeak_opening(window, NOW) == OPENS
    # Without a finish_by the window has no end to be inside of: always its next opening.
    assert offpeak_opening(Schedule(cron="0 2 * * *"), inside) == OPENS + timedelta(days=1)


def test_on_time_without_the_margin_says_so_in_the_note() -> None:
    """370 s with the margin, 343 s without, 360 s left: it does not fit with the margin,
    yet the estimate is on time; the fields and the note say the same."""
    finish_by = NOW + timedelta(seconds=360)
    plan = plan_start(283, 1.0, finish_by, NOW - timedelta(hours=1), NOW)  # 283 s of work
    assert not plan.fits and plan.on_time and plan.start == NOW
    assert plan.expected_finish == NOW + timedelta(seconds=283 + STARTUP_S) <= finish_by
    assert "need 414 s with a 25% margin" in plan.note
    assert "expected to finish at 2030-01-01T22:05:43+00:00 (without the margin)" in plan.note
    assert "17 s before the deadline, less than the 25% margin" in plan.note


def test_a_late_estimate_says_by_how_much() -> None:
    plan = plan_start(400, 1.0, NOW + timedelta(seconds=360), NOW - timedelta(hours=1), NOW)
    assert not plan.fits and not plan.on_time
    assert "100 s after the deadline" in plan.note
