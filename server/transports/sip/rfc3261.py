"""RFC 3261 checks of a request before the user agent sees it: a source outside the allowlist gets
no answer at all, a malformed request (a bad CSeq or Content-Length, unparseable SDP) a 400 that
says why in a ``Warning`` header, and a request over UDP has its ``received``/``rport`` stamped."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable

from aiosipua import SipRequest, SipResponse, parse_sdp
from aiosipua.headers import parse_via, stringify_via
from aiosipua.transport import SipTransport

from .compat import MessageHandler

__all__ = ["MAX_CSEQ", "USER_AGENT", "guard", "warning"]

log = logging.getLogger(__name__)

USER_AGENT = "Vocable"
MAX_CSEQ = 2**31 - 1
"""RFC 3261 8.1.1.5: a CSeq sequence number is below 2**31."""


def guard(
    transport: SipTransport, allowed: Callable[[tuple[str, int]], bool], handler: MessageHandler
) -> MessageHandler:
    """``handler`` behind a filter: drop every message from a source ``allowed`` refuses, and
    answer 400 to a malformed request. Over TCP, also make replies go back on the connection
    each request came in on (RFC 3261 §18.2.2): aiosipua routes replies by the top Via, whose
    sent-by port has no connection."""
    reliable = transport.reliable

    def filtered(message: SipRequest | SipResponse, addr: tuple[str, int]) -> None:
        if not allowed(addr):
            return
        if not isinstance(message, SipRequest):
            handler(message, addr)
            return
        if reliable:
            _stamp_source(message, addr)
        problem = _malformed(message)
        if problem is None:
            try:
                handler(message, addr)
                return
            except ValueError as exc:  # a header aiosipua could not read, half-way through
                problem = str(exc)
        _bad_request(transport, message, addr, problem)

    return filtered


def _stamp_source(request: SipRequest, addr: tuple[str, int]) -> None:
    """Set the top Via's ``received``/``rport`` to the true source, which reply routing follows."""
    vias = request.headers.get("via")
    if not vias:
        return
    top = parse_via(vias[0])
    top.params["received"] = addr[0]
    top.params["rport"] = str(addr[1])
    request.headers.remove("Via")
    for value in (stringify_via(top), *vias[1:]):
        request.headers.append("Via", value)


def _malformed(request: SipRequest) -> str | None:
    """Why ``request`` gets 400 Bad Request (RFC 3261 8.1.1.5, 18.3), or None: what aiosipua
    does not check itself (it fails, or goes on, with these)."""
    cseq = request.headers.get_first("cseq")
    if cseq is not None:
        number, *method = cseq.split() or [""]
        value = _number(number)
        if value is None or value > MAX_CSEQ:
            return "bad CSeq number"
        if method != [request.method]:
            return "CSeq method does not match the request"
    length = request.headers.get_first("content-length")
    if length is not None:
        declared = _number(length)
        if declared is None:
            return "bad Content-Length"
        if declared > len(request.body):
            return "body shorter than its Content-Length"
    if request.body and request.content_type == "application/sdp":
        try:
            parse_sdp(request.text)
        except ValueError as exc:
            return f"malformed SDP: {exc}"
    return None


def _bad_request(
    transport: SipTransport, request: SipRequest, addr: tuple[str, int], problem: str
) -> None:
    """Log ``problem`` and answer 400 with it in a Warning header (RFC 3261 20.43), unless the
    request is an ACK (never answered) or has no Via to route the answer by."""
    method = request.method[:20]
    log.warning("SIP %r from %s:%d refused: %s", method, addr[0], addr[1], problem[:200])
    if request.method == "ACK" or not request.headers.get("via"):
        return
    response = SipResponse(status_code=400, reason_phrase="Bad Request")
    for name in ("Via", "From", "Call-ID", "CSeq"):
        for value in request.headers.get(name):
            response.headers.append(name, value)
    to = request.headers.get_first("to")
    if to is not None:
        response.headers.set_single(
            "To", to if ";tag=" in to else f"{to};tag={secrets.token_hex(4)}"
        )
    response.headers.set_single("Warning", warning(problem))
    response.headers.set_single("User-Agent", USER_AGENT)
    try:
        transport.send_reply(response)
    except (ValueError, RuntimeError) as exc:  # no route back (no usable Via, TCP gone)
        log.warning("SIP 400 to %s:%d not sent: %s", addr[0], addr[1], exc)


def warning(problem: str) -> str:
    """A ``Warning`` header value (RFC 3261 20.43) saying ``problem`` (printable ASCII, 120
    characters at most)."""
    text = "".join(
        c if c.isascii() and c.isprintable() and c not in '"\\' else "?" for c in problem
    )
    return f'399 {USER_AGENT.lower()} "{text[:120]}"'


def _number(text: str) -> int | None:
    """A header's decimal number (up to 10 digits; more is taken as 10**10), or None."""
    text = text.strip()
    if not (text.isascii() and text.isdigit()):
        return None
    digits = text.lstrip("0") or "0"
    return int(digits) if len(digits) <= 10 else 10**10
