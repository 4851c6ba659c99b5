"""Tools of the held-out bike shop playbook: one week's repair slots, in memory."""

from __future__ import annotations

from typing import Any

from playbooks import tool

HOURS = "Monday to Friday 9:00 to 18:00, Saturday 10:00 to 14:00, closed on Sundays"
PRICES = {"puncture": 12, "brakes": 25, "gears": 30, "service": 60}
_free = {"monday": 0, "tuesday": 2, "wednesday": 1, "thursday": 3, "friday": 0, "saturday": 1}
_bookings: list[dict[str, Any]] = []


@tool
def shop_hours() -> str:
    """The shop's opening hours."""
    return HOURS


@tool
def repair_price(job: str) -> dict[str, Any]:
    """The price of a repair job.

    Args:
        job: One of puncture, brakes, gears or service.
    """
    price = PRICES.get(job.strip().lower())
    if price is None:
        return {"known": False, "jobs": sorted(PRICES)}
    return {"known": True, "job": job, "euros": price}


@tool
def free_slots(day: str) -> dict[str, Any]:
    """How many repair slots are free on a day of this week.

    Args:
        day: Day of the week, like thursday.
    """
    day = day.strip().lower()
    if day == "sunday":
        return {"day": day, "free": 0, "why": "closed on Sundays"}
    return {"day": day, "free": _free.get(day, 0)}


@tool
def book_repair(day: str, name: str, job: str) -> dict[str, Any]:
    """Book a repair slot.

    Args:
        day: Day of the week, like thursday.
        name: The caller's name.
        job: What needs fixing, like brakes.
    """
    day = day.strip().lower()
    if _free.get(day, 0) <= 0:
        return {"booked": False, "why": "no free slot that day"}
    _free[day] -= 1
    booking = {"reference": f"R{len(_bookings) + 7}", "day": day, "name": name, "job": job}
    _bookings.append(booking)
    return {"booked": True, **booking}
