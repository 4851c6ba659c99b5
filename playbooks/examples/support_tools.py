"""Tools of the support example: a tiny in-file order book."""

from __future__ import annotations

from typing import Any

from playbooks import tool

ORDERS: dict[str, dict[str, Any]] = {
    "A1001": {
        "status": "shipped",
        "items": ["blue kettle"],
        "delivery": "Tuesday",
        "cancellable": False,
    },
    "A1002": {
        "status": "processing",
        "items": ["two mugs", "tea sampler"],
        "delivery": "Friday",
        "cancellable": True,
    },
    "A1003": {
        "status": "delivered",
        "items": ["toaster"],
        "delivery": "last Monday",
        "cancellable": False,
    },
}


def _normalise(order_id: str) -> str:
    return order_id.strip().upper().replace(" ", "").replace("-", "")


@tool
def lookup_order(order_id: str) -> dict[str, Any]:
    """Look up an order: its status, items and delivery day.

    Args:
        order_id: The order number, like A1001.
    """
    order = ORDERS.get(_normalise(order_id))
    if order is None:
        return {"found": False, "order_id": order_id}
    return {"found": True, "order_id": _normalise(order_id), **order}


@tool
def cancel_order(order_id: str, reason: str = "not given") -> dict[str, Any]:
    """Cancel an order the caller has confirmed they want cancelled.

    Args:
        order_id: The order number, like A1002.
        reason: Why the caller cancels, in their words.
    """
    key = _normalise(order_id)
    order = ORDERS.get(key)
    if order is None:
        return {"cancelled": False, "why": "no such order"}
    if not order["cancellable"]:
        return {"cancelled": False, "why": f"the order is already {order['status']}"}
    order["status"] = "cancelled"
    order["cancellable"] = False
    return {"cancelled": True, "order_id": key, "reason": reason}
