"""Reporting periods from ISO 8601 text, shared by the admin API and the CLI.

A period is half-open, `[start, end)` in UTC, like the usage ledger's queries. A date alone
means a whole day: as a start, its first instant; as an end, the instant after its last, so
`--from 2024-05-01 --to 2024-05-31` is all of May and consecutive months never overlap.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

from loraplex.platform.quotas import month_start, next_month_start


def parse_moment(text: str, *, end: bool = False, name: str = "date") -> datetime:
    """An aware UTC datetime from an ISO 8601 date or datetime (naive datetimes are UTC)."""
    text = text.strip()
    try:
        day = date.fromisoformat(text)
    except ValueError:
        pass
    else:
        moment = datetime(day.year, day.month, day.day, tzinfo=UTC)
        return moment + timedelta(days=1) if end else moment
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(
            f"{name}: {text!r} is not an ISO 8601 date or datetime "
            "(e.g. 2024-05-31 or 2024-05-31T12:00:00Z)"
        ) from None
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def period(
    start: str | None,
    end: str | None,
    *,
    now: datetime | None = None,
    names: tuple[str, str] = ("start", "end"),
) -> tuple[datetime, datetime]:
    """`[start, end)` in UTC; a missing bound is that of the current (UTC) month."""
    now = now or datetime.now(UTC)
    lo = parse_moment(start, name=names[0]) if start else month_start(now)
    hi = parse_moment(end, end=True, name=names[1]) if end else next_month_start(now)
    if hi <= lo:
        raise ValueError(
            f"empty period: {names[1]} ({hi.isoformat()}) is not after "
            f"{names[0]} ({lo.isoformat()})"
        )
    return lo, hi


def last_day(end: datetime) -> date:
    """The last day a period ending (exclusively) at `end` touches, for file names and tables."""
    return (end - timedelta(microseconds=1)).date()
