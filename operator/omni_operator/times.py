"""Timestamps as the API server writes them (RFC 3339), read and written in one place."""

from __future__ import annotations

import datetime as dt


def parse_time(value: str | None) -> dt.datetime | None:
    """An RFC 3339 timestamp as the API server writes it (``Z`` or an offset), or None."""
    if not value:
        return None
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))


def format_time(value: dt.datetime) -> str:
    """RFC 3339 in UTC with seconds, as Kubernetes writes timestamps."""
    return value.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
