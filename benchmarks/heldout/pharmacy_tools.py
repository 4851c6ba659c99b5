"""Tools of the held-out pharmacy playbook: a few prescriptions, in memory."""

from __future__ import annotations

from typing import Any

from playbooks import tool

OPENING = "Monday to Saturday 8:00 to 19:00, closed on Sundays and public holidays"
_prescriptions = {
    "44719": {"medicine": "amoxicillin", "refills_left": 2},
    "30152": {"medicine": "lisinopril", "refills_left": 0},
}
_orders: list[dict[str, Any]] = []


@tool
def opening_times() -> str:
    """The pharmacy's opening times."""
    return OPENING


@tool
def prescription_status(prescription_number: str) -> dict[str, Any]:
    """Whether a prescription exists and can be refilled.

    Args:
        prescription_number: The five-digit number on the label, like 12345.
    """
    number = "".join(c for c in prescription_number if c.isdigit())
    found = _prescriptions.get(number)
    if found is None:
        return {"found": False, "prescription_number": number}
    return {"found": True, "prescription_number": number, **found}


@tool
def order_refill(prescription_number: str, pickup_day: str) -> dict[str, Any]:
    """Order a refill for the caller to pick up.

    Args:
        prescription_number: The five-digit number on the label, like 12345.
        pickup_day: Day of the week the caller will come, like monday.
    """
    status = prescription_status(prescription_number)
    if not status["found"] or status["refills_left"] <= 0:
        return {"ordered": False, "why": "no refill left: the doctor must renew it"}
    day = pickup_day.strip().lower()
    if day == "sunday":
        return {"ordered": False, "why": "closed on Sundays"}
    order = {"reference": f"P{len(_orders) + 31}", "pickup_day": day, **status}
    _orders.append(order)
    return {"ordered": True, **order}
