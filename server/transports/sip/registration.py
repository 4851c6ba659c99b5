"""Vocable as a PBX extension (``--sip-register``): it keeps its contact bound at a registrar,
so calls to the extension reach the agent.

aiosipua's :class:`~aiosipua.Registration` sends the REGISTERs, answers the digest challenge
and refreshes at 90 % of the interval granted. :class:`Registrar` keeps it going through what a
deployment meets:

- a REGISTER nobody answers (over UDP, aiosipua sends it once) is sent again at 0.5, 1, 2 and
  4 s (RFC 3261 Timer E), then counted as a failure;
- after a failure (no answer, a 403, a password refused) it registers again after 1, 2, 4 ...
  up to 60 s, and at once when a binding expires unrefreshed;
- a keep-alive goes to the registrar every ``keepalive_s`` so a NAT's UDP binding stays open
  between refreshes: a STUN Binding request from the SIP socket (RFC 5626 4.4.2), whose answer
  also names the address the registrar sees this socket at; if that address moves (the NAT
  rebound the flow) or a registrar that answered STUN stops answering, the flow is lost and
  Vocable registers again at once. A registrar that never answers STUN gets a double CRLF
  instead;
- on drain it unregisters (``Expires: 0``), waiting briefly for the answer.

Over TLS (``;transport=tls``) the REGISTERs go on a TLS connection to the registrar (its
certificate checked for its name), opened again before each registration if it dropped; the
Contact names the endpoint's ``--sip-tls`` port with ``transport=tls``, so calls come back over
TLS. TLS is reliable: nothing is sent twice, and no keep-alive pings the connection (the
refreshes keep it in use).

:meth:`Registrar.describe` is what ``/healthz`` shows; :attr:`Registrar.registered` what
``/metrics`` counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Callable
from typing import Any, Literal

from aiosipua import Registration, RegistrationState, SipDigestAuth, SipRequest, SipResponse

from server.config.sip_trunks import RegisterSettings, hostport

from .compat import TlsTransport, UdpTransport
from .dialer import DialStack

__all__ = ["Registrar"]

log = logging.getLogger(__name__)

RETRANSMIT_S = (0.5, 1.0, 2.0, 4.0)
"""When an unanswered REGISTER is sent again (RFC 3261 Timer E, from T1 doubling)."""
BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0)
"""Waits before registering again after successive failures."""
UNREGISTER_WAIT_S = 2.0
"""How long closing waits for the registrar to remove the binding (its challenge answered)."""
STUN_WAIT_S = 3.5
"""How long a STUN keep-alive waits for its answer (sent at 0, 0.5 and 1.5 s), at most the
keep-alive interval."""
KeepAlive = Literal["stun", "crlf"]


class _Registration(Registration):
    """aiosipua's registration, remembering the REGISTER it sent last (the one to send again
    while it is unanswered: after a challenge, the one with credentials), and calling
    ``on_unregistered`` once the binding is removed (aiosipua has no hook for it)."""

    sent: SipRequest | None = None
    on_unregistered: Callable[[], None] | None = None

    def _on_success(self, response: SipResponse) -> None:
        super()._on_success(response)
        if self.state is RegistrationState.UNREGISTERED and self.on_unregistered is not None:
            self.on_unregistered()

    def _send_register(
        self, expires: int, *, auth_header: tuple[str, str] | None = None
    ) -> SipRequest:
        self.sent = super()._send_register(expires, auth_header=auth_header)
        return self.sent


class Registrar:
    """Keeps one registration alive on ``stack``'s UDP socket. :meth:`start`, then
    :meth:`close` on drain."""

    def __init__(
        self, stack: DialStack, transport: UdpTransport, settings: RegisterSettings, port: int
    ) -> None:
        self.settings = settings
        self.stack = stack
        self._transport = transport
        self._port = port
        self.contact = ""
        """The URI calls to the extension reach (``sip:user@host:port``, the host the one
        facing the registrar), once resolved."""
        registrar_host, registrar_port = settings.registrar
        self.tls = settings.transport == "tls"
        default_port = 5061 if self.tls else 5060
        self.address: tuple[str, int] = (registrar_host, registrar_port or default_port)
        """The registrar's address, resolved (DNS SRV) before each registration."""
        uac = stack.uac
        if self.tls:
            if stack.tls is None:
                raise ValueError("--sip-register over TLS needs --sip-tls")
            uac = stack.tls
        self._tls_context: ssl.SSLContext | None = None
        self.registration = _Registration(
            uac,
            settings.aor,
            self.address,
            expires=settings.expires_s,
            auth=SipDigestAuth(settings.username, settings.password.reveal()),
            user_agent=stack.user_agent,
        )
        self._changed = asyncio.Event()
        self.registration.on_registered = lambda _r: self._changed.set()
        self.registration.on_failed = self._failed
        self.registration.on_expired = lambda _r: self._changed.set()
        self.registration.on_unregistered = self._changed.set
        self.last_error: str | None = None
        self.registered_at: float | None = None
        self.failures = 0
        self.keepalive: KeepAlive | None = None
        """How this registration's flow is kept alive: STUN, or a CRLF where the registrar
        does not answer STUN (None: not known yet)."""
        self.reflexive: tuple[str, int] | None = None
        """The address the registrar sees the SIP socket at (its STUN answer)."""
        self._lost: str | None = None
        """Why the flow was found lost (a registration follows at once)."""
        self._task: asyncio.Task[None] | None = None

    @property
    def state(self) -> str:
        return self.registration.state.value

    @property
    def registered(self) -> bool:
        return self.registration.state is RegistrationState.REGISTERED

    def describe(self) -> dict[str, Any]:
        """The registration as ``/healthz`` shows it (no credentials)."""
        return {
            "aor": self.settings.aor,
            "contact": self.contact,
            "state": self.state,
            "expires_s": self.registration.granted_expires or None,
            "registered_at": self.registered_at,
            "last_error": self.last_error,
            "keepalive": self.keepalive,
            "reflexive": None if self.reflexive is None else hostport(*self.reflexive),
        }

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"sip-register:{self.settings.aor}")

    async def close(self) -> None:
        """Unregister (waiting up to ``UNREGISTER_WAIT_S`` for the answer) and stop."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.registered:
            self._changed.clear()
            self.registration.unregister()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(UNREGISTER_WAIT_S):
                    while self.registration.state is not RegistrationState.UNREGISTERED:
                        await self._changed.wait()  # removed, or refused (on_failed)
                        self._changed.clear()
                        if self.registration.state is RegistrationState.FAILED:
                            break
        self.registration._cancel_timers()
        self.stack.uac._registrations.pop(self.registration.call_id, None)

    async def _run(self) -> None:
        keepalive = asyncio.create_task(self._keep_alive(), name="sip-register-keepalive")
        try:
            while True:
                if await self._register_once():
                    self.failures = 0
                    await self._until_lost()
                    continue
                delay = BACKOFF_S[min(self.failures, len(BACKOFF_S) - 1)]
                self.failures += 1
                log.warning(
                    "SIP registration of %s failed (%s); again in %g s",
                    self.settings.aor,
                    self.last_error,
                    delay,
                )
                await asyncio.sleep(delay)
        finally:
            keepalive.cancel()

    async def _register_once(self) -> bool:
        """Send a REGISTER (again while unanswered); True once registered."""
        host, port = self.settings.registrar
        try:
            self.address = await self.stack.resolver.resolve(
                host, port, self.stack.family, self.settings.transport
            )
            if self.tls:
                await self._connect_tls(host)
        except OSError as exc:  # ssl.SSLError too: a certificate refused
            self.last_error = str(exc)
            return False
        self.registration.registrar = self.address
        self.keepalive = self.reflexive = None  # a new flow: what keeps it alive is found again
        here = hostport(self.stack.media_ip(self.address[0]), self._port)
        self.contact = self.registration.contact_uri = f"sip:{self.settings.user}@{here}"
        self._changed.clear()
        self.registration.register()
        for wait in (*RETRANSMIT_S, None):
            try:
                async with asyncio.timeout(wait if wait is not None else 8.0):
                    await self._changed.wait()
            except TimeoutError:
                if wait is None:
                    self.last_error = "no answer from the registrar"
                    return False
                if self.registration.sent is not None and not self.tls:
                    self._transport.send(self.registration.sent, self.address)
                continue
            if self.registered:
                self.registered_at = time.time()
                self.last_error = None
                log.info(
                    "SIP registered %s as %s for %d s",
                    self.settings.aor,
                    self.contact,
                    self.registration.granted_expires,
                )
                return True
            if self.registration.state is RegistrationState.FAILED:
                return False
            self._changed.clear()  # an answer that did not settle it (a challenge answered)
        return False

    async def _until_lost(self) -> None:
        """While registered: aiosipua refreshes; a refresh that fails, or a binding that
        expires, ends this (a refresh that is lost on the way expires)."""
        while True:
            self._changed.clear()
            await self._changed.wait()
            if self._lost is not None:
                self.last_error, self._lost = self._lost, None
                log.warning("SIP registration of %s: %s", self.settings.aor, self.last_error)
                return
            if self.registered:
                self.registered_at = time.time()
                continue
            if self.registration.state is RegistrationState.EXPIRED:
                self.last_error = "the binding expired unrefreshed"
            return

    def _failed(self, _registration: Registration, status: int, reason: str) -> None:
        self.last_error = f"{status} {reason}".strip()
        self._changed.set()

    async def _connect_tls(self, name: str) -> None:
        """The TLS connection to the registrar (opened unless it is), its certificate checked
        for ``name``."""
        assert self.stack.tls is not None
        transport = self.stack.tls.transport
        assert isinstance(transport, TlsTransport)
        if self._tls_context is None:
            self._tls_context = ssl.create_default_context(cafile=self.settings.ca_file)
            self._tls_context.minimum_version = ssl.TLSVersion.TLSv1_2
        await transport.connect_tls(self.address, self._tls_context, name)

    async def _keep_alive(self) -> None:
        """Every ``keepalive_s`` while registered: STUN, or a CRLF (the module docstring);
        nothing over TLS."""
        if self.tls:
            return
        interval = self.settings.keepalive_s
        while True:
            await asyncio.sleep(interval)
            if not self.registered or self._lost is not None:
                continue
            if self.keepalive == "crlf":
                self._transport.send_keepalive(self.address)
                continue
            mapped = await self._transport.stun.reflexive(
                self.address, within_s=min(STUN_WAIT_S, interval)
            )
            if not self.registered:
                continue
            if mapped is None and self.keepalive is None:  # no STUN at this registrar
                self.keepalive = "crlf"
                self._transport.send_keepalive(self.address)
            elif mapped is None:
                self._flow_lost("the registrar stopped answering STUN keep-alives")
            elif self.reflexive is not None and mapped != self.reflexive:
                seen = f"{hostport(*self.reflexive)} -> {hostport(*mapped)}"
                self._flow_lost(f"the registrar sees this endpoint at a new address ({seen})")
            else:
                self.keepalive, self.reflexive = "stun", mapped

    def _flow_lost(self, why: str) -> None:
        self._lost = why
        self._changed.set()
