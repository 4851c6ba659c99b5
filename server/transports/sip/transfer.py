"""Transfers of SIP calls: REFER where the caller's side takes it, else a bridge Vocable dials.

Blind transfer (RFC 3515): Vocable sends ``REFER`` on the call's dialog with ``Refer-To`` the
destination (a phone number becomes ``sip:NUMBER@`` the caller's host, for the gateway to dial).
The peer answers 202 and reports the new call in ``NOTIFY`` sipfrag bodies: a final 2xx is a
transfer done (Vocable then ends its leg with BYE), 486/600 ``busy``, 408/480/487 ``no_answer``,
other failures ``rejected``; no final NOTIFY within the ring time is ``no_answer``. The caller
stays with the agent after a failure.

A peer that does not take REFER (a 4xx-6xx answer such as 405, 501, 403, or none within
:data:`REFER_TIMEOUT_S`) gets a bridged transfer when the destination is a SIP URI: Vocable dials
it (:mod:`.dialer`), and once the person answers, relays audio both ways until either side
hangs up (which ends both), or the person's side sends no audio for the call's media timeout.
In a ``warm`` transfer the person first hears the agent's summary in the agent's voice, then the
caller is joined (a person who hangs up during the summary is a ``rejected`` transfer). A dial
that fails (busy, no answer, rejected) comes back to the agent like a failed REFER.

The caller's audio goes to the person as it arrives (the caller's phone paces it). The person's
goes through the call's speaker, which the caller's leg pulls on its own 20 ms clock: the two
clocks differ a little, and audio arriving in a burst after a network stall would otherwise
stay queued for the rest of the call, so the queue is kept short (:class:`_Playout`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from aiosipua import IncomingCall, SipRequest, SipResponse

from media import Playback, Speaker
from media.audio import pcm_rms_dbfs
from playbooks.transfer import FailureReason, TransferOutcome, TransferRequest
from server.call.clock import CallClock
from server.call.session import Session
from server.call.transferrer import synthesize
from server.config.server import SipSettings

from .compat import MessageHandler
from .dialer import DialFailed, DialStack, dial

__all__ = ["REFER_TIMEOUT_S", "SipTransfers", "TransferredCall", "refer_target"]

log = logging.getLogger(__name__)

REFER_TIMEOUT_S = 4.0
"""How long a REFER may go unanswered before the peer counts as not taking it."""
T1_S = 0.5
"""RFC 3261 Timer E's first interval: an unanswered REFER is sent again (UDP), doubling."""
FRAME_BYTES_8K = 320
MAX_BACKLOG_MS = 200.0
"""The person's audio queued for the caller beyond this is dropped, whatever it holds."""
QUIET_BACKLOG_MS = 60.0
"""Beyond this, quiet frames of the person's audio are dropped (pauses absorb the drift)."""
QUIET_DBFS = -50.0
_NON_DIGITS = re.compile(r"[^0-9+]")


class TransferredCall(Protocol):
    """What a transfer needs of a SIP call (``server.transports.sip.call.SipCall``)."""

    invite: IncomingCall
    clock: CallClock
    settings: SipSettings
    hung_up: bool
    relay: Callable[[bytes], None] | None
    """While bridged: where the caller's audio (8 kHz PCM16) goes instead of the session."""

    @property
    def session(self) -> Session: ...

    def spawn(self, work: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]: ...

    async def hangup(self, reason: str) -> None: ...


def refer_target(destination: str, invite: IncomingCall) -> str:
    """The Refer-To URI: a SIP URI as it is; a phone number at the host of the caller's side
    (the gateway that sent the call dials it)."""
    if destination.startswith(("sip:", "sips:")):
        return destination
    number = _NON_DIGITS.sub("", destination.removeprefix("tel:"))
    return f"sip:{number}@{invite.source_addr[0]}"


def _failure(status: int) -> FailureReason:
    if status in (486, 600):
        return "busy"
    if status in (408, 480, 487):
        return "no_answer"
    return "rejected"


class _Refer:
    """One REFER in flight: its response, then its final NOTIFY."""

    def __init__(self, cseq: int) -> None:
        loop = asyncio.get_running_loop()
        self.cseq = cseq
        self.answered: asyncio.Future[tuple[int, str]] = loop.create_future()
        self.done: asyncio.Future[tuple[int, str]] = loop.create_future()


class SipTransfers:
    """The transfers of one SIP endpoint's calls. The endpoint hands it the responses to our
    REFERs (:meth:`intercept`, in front of its user agents) and the NOTIFYs' progress
    (:meth:`progress`, its user agents' ``on_transfer_progress``); ``dialer()`` is the
    endpoint's :class:`DialStack` (None: no bridged transfers)."""

    def __init__(self, dialer: Callable[[], DialStack | None]) -> None:
        self.dialer = dialer
        self._refers: dict[str, _Refer] = {}
        """REFERs in flight by SIP Call-ID (one per call at a time)."""

    def intercept(self, handler: MessageHandler) -> MessageHandler:
        """``handler`` behind a filter that takes the responses to our REFERs."""

        def routed(message: SipRequest | SipResponse, addr: tuple[str, int]) -> None:
            if isinstance(message, SipResponse) and self._answered(message):
                return
            handler(message, addr)

        return routed

    def _answered(self, response: SipResponse) -> bool:
        refer = self._refers.get(response.call_id or "")
        cseq = response.cseq
        if refer is None or cseq is None or cseq.method != "REFER" or cseq.seq != refer.cseq:
            return False
        if response.status_code >= 200 and not refer.answered.done():
            refer.answered.set_result((response.status_code, response.reason_phrase))
        return True

    def progress(self, sip_call_id: str, status: int, reason: str) -> None:
        """A NOTIFY's sipfrag status for the REFER on ``sip_call_id``."""
        refer = self._refers.get(sip_call_id)
        if refer is not None and status >= 200 and not refer.done.done():
            refer.done.set_result((status, reason))

    async def transfer(self, call: TransferredCall, request: TransferRequest) -> TransferOutcome:
        """REFER, then (refused) a bridge; on success the agent's leg is ended (REFER) or
        relayed (bridge). See the module docstring."""
        outcome = await self._refer(call, request)
        if outcome.ok:
            call.spawn(call.hangup(f"transferred to {request.destination}"), "transferred")
            return outcome
        if outcome.reason != "refused":
            return outcome
        dialer = self.dialer()
        if dialer is None or not request.destination.startswith("sip:"):
            return outcome
        return await _bridge(call, dialer, request)

    async def _refer(self, call: TransferredCall, request: TransferRequest) -> TransferOutcome:
        invite = call.invite
        if invite.transport is None:
            return TransferOutcome.failed("not_supported", "the call has no signalling transport")
        addr = invite.advertised_addr or invite.transport.local_addr
        refer = invite.dialog.create_request("REFER", via_host=addr[0], via_port=addr[1])
        target = refer_target(request.destination, invite)
        refer.headers.set_single("Refer-To", f"<{target}>")
        refer.headers.set_single("Referred-By", f"<{invite.dialog.local_uri}>")
        refer.headers.set_single("Contact", f"<sip:{addr[0]}:{addr[1]}>")
        refer.headers.set_single("Content-Length", "0")
        sip_call_id = invite.call_id
        pending = self._refers[sip_call_id] = _Refer(invite.dialog.local_cseq)
        try:
            status, reason = await self._send(invite, refer, pending)
            if status is None:
                return TransferOutcome.failed("refused", "REFER was not answered")
            if status >= 300:
                return TransferOutcome.failed("refused", f"REFER answered {status} {reason}")
            try:
                async with asyncio.timeout(request.ring_timeout_s + REFER_TIMEOUT_S):
                    final, words = await pending.done
            except TimeoutError:
                return TransferOutcome.failed("no_answer", "no final NOTIFY in the ring time")
            if final < 300:
                return TransferOutcome("answered", how="refer")
            return TransferOutcome.failed(_failure(final), f"SIP/2.0 {final} {words}".strip())
        finally:
            if self._refers.get(sip_call_id) is pending:
                del self._refers[sip_call_id]

    async def _send(
        self, invite: IncomingCall, refer: SipRequest, pending: _Refer
    ) -> tuple[int | None, str]:
        """Send ``refer`` (again at Timer E's intervals over UDP) until a final answer or
        :data:`REFER_TIMEOUT_S`; the answer's status (None: none came) and reason."""
        assert invite.transport is not None
        interval = T1_S
        try:
            async with asyncio.timeout(REFER_TIMEOUT_S):
                while True:
                    invite.transport.send(refer, invite.source_addr)
                    if invite.transport.reliable:
                        return await pending.answered
                    with contextlib.suppress(TimeoutError):
                        return await asyncio.wait_for(asyncio.shield(pending.answered), interval)
                    interval = min(interval * 2, 4.0)
        except TimeoutError:
            return None, ""


async def _bridge(
    call: TransferredCall, dialer: DialStack, request: TransferRequest
) -> TransferOutcome:
    """Dial the person; once answered (and, warm, told the summary), relay audio both ways."""
    try:
        leg = await dial(dialer, request.destination, ring_timeout_s=request.ring_timeout_s)
    except DialFailed as exc:
        result = exc.result
        reason: FailureReason = "failed" if result.outcome == "answered" else result.outcome
        detail = f"SIP/2.0 {result.status} {result.reason}" if result.status else result.reason
        return TransferOutcome.failed(reason, detail)
    except ValueError as exc:
        return TransferOutcome.failed("failed", str(exc))
    try:
        if request.mode == "warm" and request.summary:
            summary = await synthesize(call.session.voice, request.summary, 8000)
            await _play(leg.send_pcm, summary)
    except Exception:
        log.exception("the summary for the person could not be spoken")
        await leg.hangup()
        return TransferOutcome.failed("failed", "the summary could not be spoken to the person")
    except BaseException:
        await leg.hangup()
        raise
    if leg.by_peer or call.hung_up:  # during the summary
        await leg.hangup()
        if call.hung_up:
            return TransferOutcome.failed("cancelled", "the caller hung up")
        return TransferOutcome.failed("rejected", "the person hung up before the caller was joined")
    playout = _Playout(call.session.voice.speaker)
    loop = asyncio.get_running_loop()
    heard_at = loop.time()

    def to_caller(pcm: bytes) -> None:
        nonlocal heard_at
        heard_at = loop.time()
        playout.push(pcm)

    def to_person(pcm: bytes) -> None:
        call.clock.touch()  # a bridged call is not idle
        leg.send_pcm(pcm)

    def person_hung_up(_reason: str) -> None:
        call.spawn(call.hangup("the person hung up"), "bridge-ended")

    leg.on_audio = to_caller
    leg.on_hangup = person_hung_up
    call.relay = to_person

    async def held() -> None:
        """Until the call ends (its tasks are cancelled), or the person's side goes silent."""
        timeout = call.settings.media_timeout_s
        try:
            while loop.time() - heard_at < timeout:  # noqa: ASYNC110 - set by RTP callbacks
                await asyncio.sleep(min(1.0, timeout / 4))
            await call.hangup("no audio from the person")
        finally:
            call.relay = None
            await leg.hangup()

    call.spawn(held(), "bridge")
    log.info("call bridged to %s", request.destination)
    return TransferOutcome("answered", how="bridge")


class _Playout:
    """The person's audio into the caller's speaker, with the delay kept short: quiet frames
    are dropped while more than :data:`QUIET_BACKLOG_MS` is queued, any frame while more than
    :data:`MAX_BACKLOG_MS` is (the caller's leg pulls at its own clock, the person's RTP arrives
    at theirs, and in bursts after a stall)."""

    def __init__(self, speaker: Speaker) -> None:
        self.speaker = speaker
        self.queued: deque[Playback] = deque()
        self.dropped_ms = 0.0

    @property
    def backlog_ms(self) -> float:
        """How much of the person's audio waits in the speaker."""
        while self.queued and self.queued[0].done:
            self.queued.popleft()
        return sum(p.total_ms - p.played_ms for p in self.queued)

    def push(self, pcm: bytes) -> None:
        """Queue 8 kHz PCM16 from the person, unless it would make the delay too long."""
        after = self.backlog_ms + len(pcm) / 2 / 8000 * 1000
        if after > MAX_BACKLOG_MS or (after > QUIET_BACKLOG_MS and pcm_rms_dbfs(pcm) < QUIET_DBFS):
            self.dropped_ms += len(pcm) / 2 / 8000 * 1000
            return
        self.queued.append(self.speaker.push(pcm, 8000))


async def _play(send: Callable[[bytes], None], pcm: bytes) -> None:
    """Send ``pcm`` (8 kHz PCM16) in 20 ms frames at real-time pace."""
    loop = asyncio.get_running_loop()
    deadline = loop.time()
    for start in range(0, len(pcm), FRAME_BYTES_8K):
        send(pcm[start : start + FRAME_BYTES_8K].ljust(FRAME_BYTES_8K, b"\0"))
        deadline += 0.02
        await asyncio.sleep(max(0.0, deadline - loop.time()))
