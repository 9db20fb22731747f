"""An offline workload's off-peak window (`schedule:` in workloads.yaml): a cron that
opens it, a time of day to finish by, and the time zone both are read in."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError, available_timezones

from croniter import CroniterError, croniter
from pydantic import Field, field_validator, model_validator

from lanes.errors import shown
from lanes.strict import StrictModel

# A cron that fires less often than this is taken for one that never fires (Feb 29
# fires at most 8 years apart).
MAX_YEARS_BETWEEN_RUNS = 9
# Each field of a cron expression: its name and the values it takes.
CRON_FIELDS = (
    ("minute", "0-59"),
    ("hour", "0-23"),
    ("day of month", "1-31"),
    ("month", "1-12 or jan-dec"),
    ("day of week", "0-6 or sun-sat"),
)
# Longest is 32 characters ("America/Argentina/ComodRivadavia").
TIMEZONE_PATTERN = re.compile(r"^[A-Za-z0-9_+-]{1,40}(/[A-Za-z0-9_+-]{1,40}){0,3}$")
# "07:00": hours 00-23, minutes 00-59, both two digits.
FINISH_BY_PATTERN = re.compile(r"^([01][0-9]|2[0-3]):[0-5][0-9]$")


def _as_yaml_read(number: int) -> str:
    """Which unquoted times YAML 1.1 reads as `number`: ", which is how YAML reads an
    unquoted 0700 (octal) or 7:28 (base 60)" for 448; empty when none is a time."""
    written = []
    octal = f"0{number:o}"
    if re.fullmatch(r"0[0-7]{3}", octal) and int(octal[:2]) < 24 and int(octal[2:]) < 60:
        written.append(f"{octal} (octal)")
    if 60 <= number < 24 * 60:
        written.append(f"{number // 60}:{number % 60:02d} (base 60)")
    return f", which is how YAML reads an unquoted {' or '.join(written)}" if written else ""


class Schedule(StrictModel):
    """An offline workload's off-peak window: it opens when `cron` fires and, with
    `finish_by`, must be done by that time of day (the first after the opening). Either
    may be given alone: without `finish_by` a run starts when the window opens; without
    `cron` the window opens with the default off-peak one (`Settings.offpeak`)."""

    cron: str | None = Field(
        None,
        max_length=200,
        description='Five-field cron of the window\'s opening, e.g. "0 2 * * *"; default: '
        "the LANES_OFFPEAK window's.",
    )
    timezone: str = Field("UTC", description="IANA time zone the cron and finish_by are read in.")
    finish_by: str | None = Field(
        None,
        description='"HH:MM": the time of day the run must be done by; lanes starts it at '
        "the latest moment that still finishes then, from the measured items/s.",
    )

    @model_validator(mode="after")
    def _opens_or_ends(self) -> Schedule:
        if self.cron is None and self.finish_by is None:
            raise ValueError(
                'expected a `cron` (when the window opens), a `finish_by` ("HH:MM"), or both'
            )
        return self

    @field_validator("finish_by", mode="before")
    @classmethod
    def _valid_finish_by(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            raise ValueError(
                f'expected a time of day as "HH:MM" in quotes, e.g. finish_by: "07:00", found '
                f"the number {value}{_as_yaml_read(value)}: quote the time"
            )
        if isinstance(value, str) and not FINISH_BY_PATTERN.match(value):
            hint = ""
            if re.fullmatch(r"[0-9]{4}", value):
                hint = f'; write it with a colon, "{value[:2]}:{value[2:]}"'
            raise ValueError(
                f'expected a time of day as "HH:MM" (00:00 to 23:59), e.g. "07:00", '
                f"found {shown(value)}{hint}"
            )
        return value

    @field_validator("cron")
    @classmethod
    def _valid_cron(cls, value: str | None) -> str | None:
        if value is None:
            return None
        expected = f'expected a five-field cron expression like "0 2 * * *", found {shown(value)}'
        if not (len(value.split()) == 5 and _cron_is_valid(value)):
            raise ValueError(expected + _bad_cron_field(value.split()))
        try:
            _next_fire(value, datetime.now(UTC))
        except CroniterError:
            raise ValueError(
                f"{shown(value)} never fires (no such date in {MAX_YEARS_BETWEEN_RUNS} years, "
                'e.g. "31 2" is February 31st); check the day and month fields'
            ) from None
        return value

    @field_validator("timezone")
    @classmethod
    def _valid_timezone(cls, value: str) -> str:
        expected = f'expected an IANA time zone like "UTC" or "Europe/Paris", found {shown(value)}'
        if not TIMEZONE_PATTERN.match(value):
            raise ValueError(expected)
        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError, OSError):
            if not available_timezones():  # no zone loads here, not even "UTC"
                raise ValueError(
                    f"expected a time zone this system can load, found {shown(value)}: it "
                    "has no IANA time zone database; install the tzdata package (or the "
                    "OS's tzdata)"
                ) from None
            raise ValueError(expected) from None
        return value

    def next_run(self, after: datetime | None = None) -> datetime:
        """The first time strictly after `after` (default: now) that the cron fires.
        ValueError for a schedule without one (the default window's opens it)."""
        zone = ZoneInfo(self.timezone)
        return _next_fire(self._cron(), (after or datetime.now(zone)).astimezone(zone))

    def last_run(self, at: datetime) -> datetime:
        """The latest time at or before `at` that the cron fires."""
        zone = ZoneInfo(self.timezone)
        found = croniter(
            self._cron(),
            (at + timedelta(seconds=1)).astimezone(zone),
            max_years_between_matches=MAX_YEARS_BETWEEN_RUNS,
        )
        result: datetime = found.get_prev(datetime)
        return result

    def _cron(self) -> str:
        if self.cron is None:
            raise ValueError("this schedule has no cron: its window opens with the default one")
        return self.cron


def _next_fire(cron: str, start: datetime) -> datetime:
    """CroniterBadDateError when `cron` does not fire within MAX_YEARS_BETWEEN_RUNS."""
    found = croniter(cron, start, max_years_between_matches=MAX_YEARS_BETWEEN_RUNS)
    result: datetime = found.get_next(datetime)
    return result


def _cron_is_valid(expression: str) -> bool:
    try:
        return bool(croniter.is_valid(expression))
    except Exception:  # croniter's parser raises more than its own errors on odd text
        return False


def _bad_cron_field(fields: list[str]) -> str:
    """Of five cron fields, the first that croniter refuses on its own, as the end of a
    message (": its hour field, '25', is not within 0-23"); empty when none is."""
    if len(fields) != len(CRON_FIELDS):
        return ""
    for n, (name, values) in enumerate(CRON_FIELDS):
        alone = ["*"] * len(CRON_FIELDS)
        alone[n] = fields[n]
        if not _cron_is_valid(" ".join(alone)):
            return f": its {name} field, {shown(fields[n])}, is not within {values}"
    return ""
