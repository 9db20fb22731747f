"""When to start an offline run so that it finishes by a deadline, as late as it can.

A run of `items` at a measured `items_per_second` takes `items / rate` seconds; lanes
adds a margin (`MARGIN`, a fraction of that, and `STARTUP_S` for the flow run to
start and the model to load) and starts it at the latest moment that still ends
by the deadline. The start must lie inside the off-peak window (from its opening to
the deadline): a run that cannot fit there starts now, and the plan says so. A run
with no measured rate starts when the window opens, and the plan says to measure one.

An offline workload's window (`schedule: {cron, finish_by, timezone}`) opens when its
cron fires (`opening`: the default off-peak window's cron when it names none) and
closes at the first `finish_by` after that; `window_at` finds the one open at a given
moment, or else the next.

Pure: the clock is an argument, so the arithmetic is tested without waiting.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, time, timedelta
from zoneinfo import ZoneInfo

from lanes.schedule import Schedule
from lanes.settings import Settings
from lanes.spec import OfflineWorkload

MARGIN = 0.25  # of the expected run time: rates vary with the input's lengths
STARTUP_S = 60.0  # a flow run's start and the model's load


@dataclass(frozen=True)
class StartPlan:
    """`expected_finish` is the estimate, without the margin: `items / rate` and the
    startup after `start` (None without a measured rate); `on_time` is whether that
    estimate is by the deadline. `fits` is whether the run with its margin fits
    between the window's opening and the deadline: False, it starts now, and may still
    be on time by the estimate (with less than the margin to spare)."""

    start: datetime
    expected_finish: datetime | None
    on_time: bool
    note: str
    fits: bool = True


def plan_start(
    items: int,
    items_per_second: float | None,
    finish_by: datetime,
    window_opens: datetime,
    now: datetime,
) -> StartPlan:
    """The start of a run of `items` that must end by `finish_by`, in the off-peak
    window that opens at `window_opens` (clamped to `now` when already open). Times
    are compared and returned in UTC: arithmetic on a zone's wall clock is off by the
    hour a DST change adds or removes."""
    finish_by, now = finish_by.astimezone(UTC), now.astimezone(UTC)
    opens = max(window_opens.astimezone(UTC), now)
    if items_per_second is None or items_per_second <= 0:
        unmeasured = "(run `lanes calibrate WORKLOAD` or one run to plan by the deadline)"
        if opens >= finish_by:  # waiting for the window would miss the deadline for sure
            return StartPlan(
                now,
                None,
                True,  # unknown without a rate, as below
                f"no measured rate for this model, and the off-peak window opens at "
                f"{_shown(opens)}, past the deadline: starting now {unmeasured}",
                fits=False,
            )
        return StartPlan(
            opens,
            None,
            True,
            f"no measured rate for this model: starting when the off-peak window opens "
            f"{unmeasured}",
        )
    expected = items / items_per_second
    needed = timedelta(seconds=expected * (1 + MARGIN) + STARTUP_S)
    latest = finish_by - needed
    run = timedelta(seconds=expected + STARTUP_S)
    if latest >= opens:
        note = (
            f"{items} items at {items_per_second:g} items/s take {needed.total_seconds():.0f} s "
            f"with a {MARGIN:.0%} margin and {STARTUP_S:.0f} s to start: starting at the "
            f"latest moment that ends by {_shown(finish_by)}"
        )
        return StartPlan(latest, latest + run, True, note)
    finish = now + run
    on_time = finish <= finish_by
    where = "inside the off-peak window" if latest >= now else "even if started now"
    spare = (finish_by - finish).total_seconds()
    if not on_time:
        outcome = f"{-spare:.0f} s after the deadline"
    elif latest < now:  # on time by the estimate, but with less than the margin left
        outcome = f"{spare:.0f} s before the deadline, less than the {MARGIN:.0%} margin"
    else:
        outcome = f"{spare:.0f} s before the deadline"
    note = (
        f"{items} items at {items_per_second:g} items/s need {needed.total_seconds():.0f} s "
        f"with a {MARGIN:.0%} margin, which does not fit by {_shown(finish_by)} {where}: "
        f"starting now, expected to finish at {_shown(finish)} (without the margin), "
        f"{outcome}"
    )
    return StartPlan(now, finish, on_time, note, fits=False)


def _shown(moment: datetime) -> str:
    """A time in a note: ISO format, to the whole second."""
    return moment.isoformat(timespec="seconds")


@dataclass(frozen=True)
class Window:
    """An off-peak window: from `opens` to the deadline `finish_by`."""

    opens: datetime
    finish_by: datetime


def opening(workload: OfflineWorkload, settings: Settings) -> tuple[Schedule, bool]:
    """The schedule whose cron opens the workload's window: its own, or (and True) the
    default off-peak window `settings.offpeak`, for a workload with no schedule or one
    that names only `finish_by`."""
    if workload.schedule is not None and workload.schedule.cron is not None:
        return workload.schedule, False
    return settings.offpeak, True


def deadline_after(opens: datetime, finish_by: str, timezone: str) -> datetime:
    """The first `finish_by` ("HH:MM" in `timezone`) strictly after `opens`: the same
    day, or the next one when the window crosses midnight."""
    zone = ZoneInfo(timezone)
    hour, minute = (int(part) for part in finish_by.split(":"))
    day = opens.astimezone(zone).date()
    deadline = datetime.combine(day, time(hour, minute), tzinfo=zone)
    if deadline <= opens:
        deadline = datetime.combine(day + timedelta(days=1), time(hour, minute), tzinfo=zone)
    return deadline.astimezone(UTC)


def window_at(opens_with: Schedule, finish_by: str, timezone: str, now: datetime) -> Window:
    """The window open at `now` (its cron fired and its deadline has not passed), else
    the next one; in UTC."""
    last = opens_with.last_run(now).astimezone(UTC)
    deadline = deadline_after(last, finish_by, timezone)
    if now < deadline:
        return Window(last, deadline)
    upcoming = opens_with.next_run(now).astimezone(UTC)
    return Window(upcoming, deadline_after(upcoming, finish_by, timezone))


def offpeak_opening(offpeak: Schedule, now: datetime) -> datetime:
    """When the default off-peak window opens for work that arrives at `now`: the
    opening of the window open now (with a `finish_by`: its cron fired and that time
    has not passed), else the cron's next firing; in UTC."""
    if offpeak.finish_by is None:  # a window without an end is only ever next
        return offpeak.next_run(now).astimezone(UTC)
    return window_at(offpeak, offpeak.finish_by, offpeak.timezone, now).opens
