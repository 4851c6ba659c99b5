"""SIP digest authentication (RFC 3261 22, RFC 7616 as RFC 8760 brings it to SIP), both ways.

- :class:`DigestClient` answers a trunk's or a registrar's 401/407 challenges with one set of
  credentials: MD5 or SHA-256, ``qop=auth`` (or none), ``opaque`` echoed. It keeps the last
  challenge, so the next request through the same trunk carries credentials at once, on the
  same nonce with the next nonce count (``nc``), and meets no challenge until the nonce expires.
- :class:`DigestRealm` challenges requests (``--sip-auth``) and checks their answers: a nonce
  it made (an HMAC of its time, so nothing is stored per challenge) no older than
  ``nonce_ttl_s``, a nonce count above the last one seen for that nonce (a replayed request is
  refused), and the response computed from the password. An old nonce is answered ``stale``,
  which tells a client to retry with the new nonce without asking its user again.
- :class:`FailureThrottle` refuses a source for a while after repeated failed answers.

Passwords stay in :class:`~server.config.sip_trunks.Secret`; nothing here logs one or puts one
in an error.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from aiosipua import SipDigestAuth
from aiosipua.auth import build_credentials
from aiosipua.headers import AuthChallenge, parse_auth, stringify_auth

from server.config.sip_trunks import Secret

__all__ = [
    "ALGORITHMS",
    "Check",
    "DigestClient",
    "DigestRealm",
    "FailureThrottle",
    "challenge_header",
]

ALGORITHMS = {"MD5": hashlib.md5, "SHA-256": hashlib.sha256}
Check = Literal["ok", "missing", "stale", "bad"]
"""How a request's credentials fared: right, absent, right but on an expired nonce, wrong."""


def challenge_header(status: int) -> tuple[str, str]:
    """The header a ``status`` (401 or 407) challenge comes in, and the one answering it."""
    if status == 407:
        return "Proxy-Authenticate", "Proxy-Authorization"
    return "WWW-Authenticate", "Authorization"


@dataclass
class _Answered:
    challenge: AuthChallenge
    header: str
    """Authorization or Proxy-Authorization."""
    uses: int = 1
    """Requests sent on this nonce so far (its next nc is one more)."""


class DigestClient:
    """Credentials for one trunk or registrar. Not thread-safe (one event loop)."""

    def __init__(self, username: str, password: Secret) -> None:
        self._auth = SipDigestAuth(username, password.reveal())
        self._last: _Answered | None = None

    @property
    def username(self) -> str:
        return self._auth.username

    def answer(
        self, status: int, challenge_text: str | None, method: str, uri: str
    ) -> tuple[str, str] | None:
        """The header (name, value) answering a ``status`` challenge whose
        ``WWW-Authenticate``/``Proxy-Authenticate`` value is ``challenge_text``; None when it
        cannot be answered (no digest, an unknown algorithm, only ``auth-int``)."""
        if not challenge_text:
            return None
        try:
            challenge = parse_auth(challenge_text)
        except ValueError:
            return None
        header = challenge_header(status)[1]
        credentials = build_credentials(self._auth, challenge, method, uri)
        if credentials is None:
            return None
        self._last = _Answered(challenge, header)
        return header, stringify_auth(credentials)

    def ahead(self, method: str, uri: str) -> tuple[str, str] | None:
        """Credentials for a new request on the last challenge's nonce (the next ``nc``), so
        it needs no challenge; None before any challenge."""
        last = self._last
        if last is None:
            return None
        last.uses += 1
        credentials = build_credentials(
            self._auth, last.challenge, method, uri, nonce_count=last.uses
        )
        return None if credentials is None else (last.header, stringify_auth(credentials))

    def forget(self) -> None:
        """Drop the kept nonce (it was refused)."""
        self._last = None


@dataclass
class DigestRealm:
    """Challenges requests for one user in ``realm`` and checks their credentials."""

    realm: str
    username: str
    password: Secret = field(repr=False)
    algorithm: str = "MD5"
    nonce_ttl_s: float = 300.0
    clock: Callable[[], float] = time.time
    _key: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)
    _counts: OrderedDict[str, int] = field(default_factory=OrderedDict, repr=False)
    """The last nonce count seen per nonce (bounded: the oldest go first)."""

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"digest algorithm must be one of {', '.join(ALGORITHMS)}")

    def challenge(self, *, stale: bool = False) -> str:
        """A ``WWW-Authenticate``/``Proxy-Authenticate`` value with a fresh nonce."""
        issued = f"{int(self.clock()):x}"
        nonce = f"{issued}.{self._sign(issued)}"
        value = (
            f'Digest realm="{self.realm}", nonce="{nonce}", algorithm={self.algorithm}, qop="auth"'
        )
        return value + (", stale=true" if stale else "")

    def check(self, header: str | None, method: str) -> Check:
        """How the ``Authorization``/``Proxy-Authorization`` value ``header`` of a ``method``
        request answers a challenge of this realm."""
        if not header:
            return "missing"
        try:
            credentials = parse_auth(header, credentials=True)
        except ValueError:
            return "bad"
        p = credentials.params
        if credentials.scheme.lower() != "digest" or p.get("realm") != self.realm:
            return "bad"
        if p.get("username") != self.username:
            return "bad"
        nonce = p.get("nonce", "")
        issued, _, signature = nonce.partition(".")
        if not _same(signature, self._sign(issued)) or not _is_hex(issued):
            return "bad"
        if p.get("algorithm", "MD5").upper() != self.algorithm.upper():
            return "bad"
        if not _same(p.get("response", ""), self._expected(p, method)):
            return "bad"
        if self.clock() - int(issued, 16) > self.nonce_ttl_s:
            return "stale"
        if p.get("qop"):
            count = int(p.get("nc", "0"), 16) if _is_hex(p.get("nc", "")) else 0
            if count <= self._counts.get(nonce, 0):
                return "bad"  # a replay, or a count gone back
            self._counts[nonce] = count
            self._counts.move_to_end(nonce)
            while len(self._counts) > 4096:
                self._counts.popitem(last=False)
        return "ok"

    def _expected(self, p: dict[str, str], method: str) -> str:
        def h(text: str) -> str:
            return ALGORITHMS[self.algorithm](text.encode()).hexdigest()

        ha1 = h(f"{self.username}:{self.realm}:{self.password.reveal()}")
        ha2 = h(f"{method}:{p.get('uri', '')}")
        if p.get("qop"):
            return h(f"{ha1}:{p['nonce']}:{p.get('nc', '')}:{p.get('cnonce', '')}:auth:{ha2}")
        return h(f"{ha1}:{p['nonce']}:{ha2}")

    def _sign(self, issued: str) -> str:
        return hmac.new(self._key, issued.encode(), hashlib.sha256).hexdigest()[:24]


class FailureThrottle:
    """Counts failed answers per source: ``limit`` of them within ``window_s`` refuse that
    source until ``window_s`` has passed since its latest failure."""

    def __init__(
        self, limit: int = 5, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limit = limit
        self.window_s = window_s
        self.clock = clock
        self._failures: OrderedDict[str, list[float]] = OrderedDict()

    def refused(self, source: str) -> bool:
        recent = self._recent(source)
        return len(recent) >= self.limit

    def failed(self, source: str) -> None:
        recent = self._recent(source)
        recent.append(self.clock())
        self._failures[source] = recent
        self._failures.move_to_end(source)
        while len(self._failures) > 10_000:
            self._failures.popitem(last=False)

    def succeeded(self, source: str) -> None:
        self._failures.pop(source, None)

    def _recent(self, source: str) -> list[float]:
        times = self._failures.get(source, [])
        if times and self.clock() - times[-1] > self.window_s:
            self._failures.pop(source, None)
            return []
        return times[-self.limit :]


def _same(given: str, expected: str) -> bool:
    """A constant-time comparison that takes any text (``hmac.compare_digest`` refuses
    non-ASCII strings)."""
    return hmac.compare_digest(given.encode("utf-8", "replace"), expected.encode())


def _is_hex(text: str) -> bool:
    return bool(text) and all(c in "0123456789abcdefABCDEF" for c in text)
