"""Call transfers: the built-in ``transfer_call`` tool puts the caller through to a person.

A stage with a ``transfer`` (its own, else the playbook's) is offered ``transfer_call``. The
LLM calls it like any tool; the conversation hands a :class:`TransferRequest` to its
:data:`Transferrer` (the voice call's transport, set by the server; none in a text chat) and the
:class:`TransferOutcome` becomes the tool's result. A failed transfer (busy, no answer, refused,
not supported) is a result the LLM reads and tells the caller about, and the conversation goes
on; a transfer that went through ends the turn without an answer (the caller is with the person
now). Where the line can only ask for a transfer and never learns whether it happened (a media
stream's platform acting on an event), the outcome is ``requested``: the LLM is told it is not
confirmed, the caller may still be there, and the conversation goes on until the platform moves
or ends the call. Either way the history keeps the call and its result: the transfer is on
record.

Nothing here knows SIP or HTTP: how a call is transferred is the transport's business.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from .models import Transfer
from .tools import InvalidToolCall, tool_arguments

__all__ = [
    "TRANSFER_TOOL",
    "TransferOutcome",
    "TransferRequest",
    "Transferrer",
    "parse_transfer_call",
    "transfer_prompt",
    "transfer_tool_schema",
]

TRANSFER_TOOL = "transfer_call"
"""The built-in tool of a stage with a ``transfer``."""

TransferStatus = Literal["answered", "requested", "failed"]
FailureReason = Literal[
    "busy", "no_answer", "rejected", "refused", "not_supported", "cancelled", "failed"
]
"""Why a transfer failed: the person's line was ``busy``, it rang out (``no_answer``), the
person (``rejected``) or the caller's side (``refused``: REFER or the provider's API said no)
turned it down, the call cannot be transferred at all (``not_supported``), the call ended
meanwhile (``cancelled``), or anything else (``failed``)."""

_SPOKEN_REASONS: dict[str, str] = {
    "busy": "the line is busy",
    "no_answer": "nobody answered",
    "rejected": "the call was declined",
    "refused": "the phone system refused the transfer",
    "not_supported": "this call cannot be transferred",
    "cancelled": "the call ended during the transfer",
    "failed": "the transfer failed",
}


@dataclass(frozen=True)
class TransferRequest:
    """What the transport is asked to do: put the caller through to ``destination`` (a SIP URI
    or a phone number). ``say`` is for the caller first (the server's voice layer speaks it);
    ``summary`` is what the person hears first in a ``warm`` transfer."""

    destination: str
    mode: Literal["blind", "warm"]
    say: str | None
    summary: str | None
    reason: str | None
    ring_timeout_s: float


@dataclass(frozen=True)
class TransferOutcome:
    """How a transfer ended. ``answered``: the caller is with the person (``how`` says by
    what: ``refer``, ``bridge``, ``provider``...); ``requested``: the platform was asked (by
    ``how``) and nothing confirms it acted; ``failed``: ``reason`` says why, ``detail`` in words
    a log can use (a SIP status line, an HTTP status)."""

    status: TransferStatus
    how: str | None = None
    reason: FailureReason | None = None
    detail: str | None = None

    @classmethod
    def failed(cls, reason: FailureReason, detail: str | None = None) -> TransferOutcome:
        return cls("failed", reason=reason, detail=detail)

    @classmethod
    def requested(cls, how: str) -> TransferOutcome:
        return cls("requested", how=how)

    @property
    def ok(self) -> bool:
        """Whether the caller is known to be with the person."""
        return self.status == "answered"

    def for_llm(self, request: TransferRequest) -> str:
        """The tool's JSON result."""
        result: dict[str, Any] = {"transferred": self.ok, "destination": request.destination}
        if request.say:
            result["said_to_caller"] = request.say
        if self.ok:
            result["how"] = self.how
            return json.dumps(result, ensure_ascii=False)
        if self.status == "requested":
            result |= {
                "status": "requested, not confirmed",
                "how": self.how,
                "note": "The phone platform was asked to put the caller through and has not"
                " confirmed it: the caller may still be on the line.",
                "next": "Tell the caller in one short sentence that they are being put through"
                " and to hold. Do not say goodbye. If they speak again, they are still with"
                " you: go on helping.",
            }
            return json.dumps(result, ensure_ascii=False)
        reason = self.reason or "failed"
        result["reason"] = reason
        result["error"] = f"the transfer did not go through: {_SPOKEN_REASONS[reason]}"
        if self.detail:
            result["detail"] = self.detail
        result["next"] = "Tell the caller the transfer did not work, and go on helping them."
        return json.dumps(result, ensure_ascii=False)


Transferrer = Callable[[TransferRequest], Awaitable[TransferOutcome]]
"""Carries out a transfer for one call; returns its outcome (never raises but for
cancellation)."""


def transfer_tool_schema(transfer: Transfer) -> dict[str, Any]:
    """The ``transfer_call`` tool of a stage whose transfer is ``transfer``; a ``summary`` is
    required for a warm transfer."""
    warm = transfer.mode == "warm"
    required = ["reason", "summary"] if warm else ["reason"]
    summary = "What the person taking the call needs to know: what the caller wants and every fact"
    summary += " gathered so far; spoken to them before the caller is joined." if warm else "."
    return {
        "type": "function",
        "function": {
            "name": TRANSFER_TOOL,
            "description": (
                "Put the caller through to a person (a human agent). "
                + (transfer.description or "Use it when the caller asks for a person.")
            ),
            "parameters": {
                "type": "object",
                "properties": {
                    "reason": {"type": "string", "description": "Why the caller needs a person."},
                    "summary": {"type": "string", "description": summary},
                },
                "required": required,
            },
        },
    }


def transfer_prompt(transfer: Transfer) -> str:
    """The system prompt's line about the transfer."""
    when = transfer.description or "when the caller asks for a person"
    return (
        f"You can put the caller through to a person with {TRANSFER_TOOL} ({when.rstrip('.')})."
        " The caller is told before the transfer starts; do not announce it yourself. If the"
        " transfer fails, say so briefly and go on helping."
    )


def parse_transfer_call(arguments: str, transfer: Transfer) -> TransferRequest:
    """The request a ``transfer_call`` call makes; raises InvalidToolCall."""
    parsed = tool_arguments(arguments)
    summary = parsed.get("summary")
    summary = summary.strip() if isinstance(summary, str) and summary.strip() else None
    if summary is None and transfer.mode == "warm":
        raise InvalidToolCall("summary is required: the person hears it before the caller")
    reason = parsed.get("reason")
    return TransferRequest(
        destination=transfer.to,
        mode=transfer.mode,
        say=transfer.say or None,
        summary=summary,
        reason=str(reason) if reason else None,
        ring_timeout_s=transfer.ring_timeout_ms / 1000,
    )
