"""Tools of the restaurant example: one evening's tables, in memory."""

from __future__ import annotations

import re
from typing import Any

from playbooks import TransitionContext, tool

SEATS_PER_SLOT = 20
OPENING = "Tuesday to Sunday, 18:00 to 22:30; closed on Mondays"
_booked: dict[tuple[str, str], int] = {("friday", "20:00"): 18}
_bookings: list[dict[str, Any]] = []


@tool
def opening_hours() -> str:
    """The restaurant's opening hours."""
    return OPENING


@tool
def check_availability(day: str, time: str, guests: int) -> dict[str, Any]:
    """Whether a table for this many guests is free at a day and time.

    Args:
        day: Day of the week, like friday.
        time: Time in 24-hour form, like 19:30.
        guests: Number of guests.
    """
    if day.strip().lower() == "monday":
        return {"available": False, "why": "closed on Mondays"}
    taken = _booked.get((day.strip().lower(), time.strip()), 0)
    return {"available": taken + guests <= SEATS_PER_SLOT, "seats_left": SEATS_PER_SLOT - taken}


@tool
def book_table(day: str, time: str, guests: int, name: str) -> dict[str, Any]:
    """Book a table once the caller has agreed to the details.

    Args:
        day: Day of the week, like friday.
        time: Time in 24-hour form, like 19:30.
        guests: Number of guests.
        name: The name the booking is under.
    """
    if not check_availability(day, time, guests)["available"]:
        return {"booked": False, "why": "no longer available"}
    key = (day.strip().lower(), time.strip())
    _booked[key] = _booked.get(key, 0) + guests
    booking = {
        "reference": f"T{len(_bookings) + 101}",
        "day": day,
        "time": time,
        "guests": guests,
        "name": name,
    }
    _bookings.append(booking)
    return {"booked": True, **booking}


def is_large_party(context: TransitionContext) -> bool:
    """Custom condition: the caller asked for more than 12 guests."""
    numbers = re.findall(r"\b(\d+)\s*(?:people|guests|persons)\b", context.last_user_message or "")
    return any(int(n) > 12 for n in numbers)
