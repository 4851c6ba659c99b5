"""Tools of the llmrtc-shaped ``support-bot.json``, in plain snake_case Python.

The playbook defines each tool inline, with camelCase parameters (``orderId``); Vocable binds
each definition to the ``@tool`` function of the same name and hands it the arguments under its
own names (``order_id``). Results are canned, and say what the function was given, so a test can
tell the arguments arrived.

``classify_issue`` is not here: the tests serve it over HTTP (a ``"url"`` on its definition).
``open_resolution_log`` is the resolution stage's ``onEnter`` hook and ``caller_gave_up`` the
``evaluate`` function of a ``custom`` transition.
"""

from __future__ import annotations

from typing import Any, Literal

from playbooks import tool
from playbooks.context import PlaybookContext, current_context
from playbooks.engine import TransitionContext

ORDERS: dict[str, dict[str, Any]] = {
    "SC-123456": {
        "items": ["Shimano 105 rear derailleur"],
        "status": "delivered",
        "delivered": "2025-05-28",
        "tracking": "YRK0042",
    },
    "SC-654321": {
        "items": ["Gravel frame, 56 cm"],
        "status": "in transit",
        "estimate": "2025-06-04",
        "tracking": "YRK0077",
    },
}

RESOLUTION_LOG: list[PlaybookContext] = []
"""The context ``open_resolution_log`` was called with, each time the resolution stage began."""


@tool(side_effects=False)
def verify_customer(customer_email: str, order_id: str | None = None) -> dict[str, Any]:
    """Check that an email address belongs to a customer, optionally matching an order."""
    verified = customer_email.endswith("@example.com")
    matched = order_id in ORDERS if order_id is not None else None
    return {
        "verified": verified,
        "customerId": "C-1042" if verified else None,
        "customerEmail": customer_email,
        "orderId": order_id,
        "orderMatches": matched,
    }


@tool(side_effects=False)
def get_order(order_id: str) -> dict[str, Any]:
    """Fetch an order's items, status, delivery estimate and tracking number."""
    order = ORDERS.get(order_id)
    if order is None:
        return {"orderId": order_id, "found": False}
    return {"orderId": order_id, "found": True, **order}


@tool
def book_repair(
    order_id: str,
    preferred_date: str,
    drop_off_store: Literal["leeds", "york", "harrogate"] = "leeds",
) -> dict[str, Any]:
    """Reserve a workshop slot for a bike or part from an order."""
    return {
        "bookingRef": f"WS-{preferred_date.replace('-', '')}-{drop_off_store[:3].upper()}",
        "orderId": order_id,
        "date": preferred_date,
        "store": drop_off_store,
    }


@tool
def issue_refund(order_id: str, amount: float, reason: str) -> dict[str, Any]:
    """Refund part or all of an order, within the stage's ``refundLimitGbp``."""
    context = current_context()
    limit = context.stage_metadata.get("refundLimitGbp", 0) if context is not None else 0
    if amount > limit:
        return {"refunded": False, "orderId": order_id, "why": f"over the {limit} limit"}
    return {"refunded": True, "orderId": order_id, "amount": amount, "reason": reason}


@tool
def open_case(
    customer_email: str,
    summary: str,
    priority: Literal["low", "normal", "urgent"],
    related_order_ids: list[str] | None = None,
) -> dict[str, Any]:
    """Open a case for the workshop team."""
    return {
        "caseId": "CASE-7781",
        "customerEmail": customer_email,
        "priority": priority,
        "summary": summary,
        "relatedOrderIds": related_order_ids or [],
    }


@tool(side_effects=False)
def search_help_centre(query: str, max_results: int = 3) -> list[dict[str, str]]:
    """Search the help articles."""
    articles = [
        {"title": "Indexing a rear derailleur", "url": "https://help.example.com/indexing"},
        {"title": "Returns and refunds", "url": "https://help.example.com/returns"},
        {"title": "Frame sizing", "url": "https://help.example.com/sizing"},
    ]
    return [{**article, "query": query} for article in articles[:max_results]]


def open_resolution_log(context: PlaybookContext) -> None:
    """``onEnter`` of the resolution stage."""
    RESOLUTION_LOG.append(context)


def caller_gave_up(context: TransitionContext) -> bool:
    """``evaluate`` of the custom transition out of authentication."""
    said = (context.last_user_message or "").lower()
    return "forget it" in said or "never mind" in said
