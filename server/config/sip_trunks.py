"""SIP trunks: where Vocable's outbound calls go, and how they prove and show who is calling.

A :class:`Trunk` is named (``POST /calls`` picks one with ``"trunk"``) and says:

- ``proxy``: the outbound proxy every INVITE of the trunk is sent to (``sip:host[:port]`` or
  ``host[:port]``, with a ``Route`` header naming it); None: straight to the callee URI's host;
- ``domain``: the host a bare number is called at (``+15551230000`` becomes
  ``sip:+15551230000@domain``); default: the proxy's host;
- ``username`` and a password: the digest credentials that answer a 401/407 challenge;
- ``caller_id`` (the From user, the number a callee sees), ``display_name`` and
  ``asserted_identity`` (a ``P-Asserted-Identity`` URI, which carriers read for caller ID);
- ``transport``: ``udp``, or ``tls`` to the proxy (its certificate checked against
  ``ca_file``, else the system's authorities; the server needs ``--sip-tls``, where the
  proxy's in-dialog requests come back);
- ``srtp``: the calls' audio on SRTP (SDES keys in the SDP, RFC 4568; use it with ``tls``,
  since the keys are only as secret as the signalling): a callee that answers without SRTP is
  hung up.

Trunks come from a YAML file (``--sip-trunks``)::

    trunks:
      twilio:
        proxy: sip:acme.pstn.twilio.com
        username: vocable
        password_env: TWILIO_SIP_PASSWORD      # or password_file: /run/secrets/twilio
        caller_id: "+15551230000"

and from flags (``--sip-outbound-proxy``, ``--sip-username``, ``--sip-password`` or
``VOCABLE_SIP_PASSWORD``, ``--sip-password-file``, ``--sip-caller-id``), which make the trunk
named ``default``. A password is never printed: :class:`Secret` hides it from ``repr``, logs and
error text, and errors name the file or variable it was to come from, never its value.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

__all__ = [
    "DEFAULT_TRUNK",
    "InboundAuth",
    "RegisterSettings",
    "Secret",
    "Trunk",
    "TrunkError",
    "hostport",
    "load_trunks",
    "parse_hostport",
    "parse_target",
    "pick_trunk",
    "read_secret",
    "trunk_of",
]

DEFAULT_TRUNK = "default"
"""The trunk the flags make, and the one ``POST /calls`` uses when it names none (or the only
trunk there is)."""


FLAG_SOURCES = "--sip-password, VOCABLE_SIP_PASSWORD or --sip-password-file"


_PUNCTUATION = re.compile(r"[\s().-]")
_NUMBER = re.compile(r"\+?[0-9*#]+")
_USER = re.compile(r"[A-Za-z0-9_.!~*'+-]{1,64}")


class TrunkError(ValueError):
    """A trunk setting cannot be used; one line that names the file, trunk or variable."""


class Secret:
    """A password: ``str()`` and ``repr()`` say ``***``; :meth:`reveal` gives the value."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)


@dataclass(frozen=True)
class Trunk:
    """One named way out (see the module docstring)."""

    name: str
    proxy: tuple[str, int | None] | None = None
    """The outbound proxy's host and port (None: as its DNS SRV records say)."""
    domain: str | None = None
    username: str | None = None
    password: Secret | None = field(default=None, repr=False)
    caller_id: str | None = None
    display_name: str | None = None
    asserted_identity: str | None = None
    transport: Literal["udp", "tls"] = "udp"
    """How INVITEs reach the proxy: UDP, or TLS (the certificate checked against ``ca_file``,
    else the system's authorities, for the proxy's name)."""
    ca_file: Path | None = None
    srtp: bool = False
    """Offer SRTP only (``RTP/SAVP`` with SDES keys)."""

    def __post_init__(self) -> None:
        if (self.username is None) != (self.password is None):
            raise TrunkError(f"trunk {self.name!r}: a username needs a password, and the reverse")

    @property
    def host(self) -> str | None:
        """Where a bare number is called: the domain, else the proxy's host."""
        if self.domain is not None:
            return self.domain
        return None if self.proxy is None else hostport(*self.proxy)

    def target(self, to: str) -> str:
        """The URI to call for ``to``: a ``sip:`` URI as it is; a number (``+1 555-123 4567``:
        spaces, dashes, dots and brackets dropped) or an extension's user name (``alice``) at
        the trunk's host. Raises ValueError naming what is missing."""
        if to.lower().startswith("sip:"):
            return to
        number = _PUNCTUATION.sub("", to)
        if _NUMBER.fullmatch(number):
            to = number
        elif not _USER.fullmatch(to):
            raise ValueError("'to' must be a sip: URI, a phone number or a user name")
        number = to
        if self.host is None:
            raise ValueError(
                f"trunk {self.name!r} has no proxy or domain to call the number {number} at"
            )
        return f"sip:{number}@{self.host}"


@dataclass(frozen=True)
class RegisterSettings:
    """Vocable as a PBX extension (``--sip-register``): the address of record it binds its
    contact to, where the REGISTERs go, and the account's credentials."""

    aor: str
    """``sip:user@registrar[:port]``."""
    registrar: tuple[str, int | None]
    """Where REGISTERs are sent: the outbound proxy if one is set, else the AOR's host (the
    port None: as DNS SRV says)."""
    username: str
    password: Secret = field(repr=False)
    expires_s: int = 300
    """The binding's lifetime asked for; it is refreshed at 90 % of what the registrar
    grants."""
    keepalive_s: float = 25.0
    """How often a keep-alive goes to the registrar (NAT bindings on UDP last ~30 s)."""
    transport: Literal["udp", "tls"] = "udp"
    """How REGISTERs reach the registrar: UDP, or TLS (``;transport=tls`` in the AOR; the
    registrar's certificate checked against ``ca_file``, else the system's authorities)."""
    ca_file: Path | None = None

    @property
    def user(self) -> str:
        return self.aor[4:].partition("@")[0]


@dataclass(frozen=True)
class InboundAuth:
    """``--sip-auth``: the account an INVITE from outside ``--sip-allow`` must prove (digest,
    RFC 3261 22), in ``realm``."""

    username: str
    password: Secret = field(repr=False)
    realm: str = "vocable"
    algorithm: str = "MD5"
    """MD5 (what every phone and PBX answers) or SHA-256 (RFC 8760)."""


def inbound_auth(
    username: str | None, *, password: str | None, password_file: Path | None, algorithm: str
) -> InboundAuth | None:
    """``--sip-auth``'s settings (None without it); raises TrunkError with one line."""
    if username is None:
        if password or password_file:
            raise TrunkError("--sip-auth-password needs --sip-auth USER")
        return None
    secret = read_secret(
        value=password,
        env=None,
        path=password_file,
        what="--sip-auth",
        sources="--sip-auth-password, VOCABLE_SIP_AUTH_PASSWORD or --sip-auth-password-file",
    )
    return InboundAuth(username, secret, algorithm=algorithm)


def register_settings(
    aor: str | None,
    *,
    expires_s: int,
    username: str | None,
    proxy: str | None,
    password: str | None,
    password_file: Path | None,
) -> RegisterSettings | None:
    """``--sip-register``'s settings (None without it): the user defaults to the AOR's, the
    password comes as the default trunk's does. Raises TrunkError with one line."""
    if aor is None:
        return None
    if not aor.lower().startswith("sip:") or "@" not in aor:
        raise TrunkError(f"--sip-register: {aor!r} is not a sip:user@registrar URI")
    try:
        registrar = parse_hostport(_as_uri(proxy) if proxy else aor)
    except ValueError as exc:
        raise TrunkError(f"--sip-register: {exc}") from None
    user = username or aor[4:].partition("@")[0].partition(";")[0]
    secret = read_secret(
        value=password, env=None, path=password_file, what="--sip-register", sources=FLAG_SOURCES
    )
    tls = "transport=tls" in aor.lower().partition(";")[2]
    return RegisterSettings(
        aor, registrar, user, secret, expires_s=expires_s, transport="tls" if tls else "udp"
    )


def read_secret(
    *,
    value: str | None,
    env: str | None,
    path: Path | None,
    what: str,
    sources: str = "password, password_env or password_file",
) -> Secret:
    """The one password given as a ``value``, an environment variable ``env`` or a file
    ``path`` (its first line); raises TrunkError naming ``what`` and the source (``sources``
    says how a password is given), never the value."""
    given = [name for name, source in (("value", value), ("env", env), ("file", path)) if source]
    if len(given) != 1:
        raise TrunkError(f"{what}: give the password once, as one of {sources}")
    if value:
        return Secret(value)
    if env:
        found = os.environ.get(env)
        if not found:
            raise TrunkError(f"{what}: the environment variable {env} is not set")
        return Secret(found)
    assert path is not None
    try:
        line = path.read_text(encoding="utf-8").splitlines()[:1]
    except (OSError, UnicodeDecodeError) as exc:
        raise TrunkError(f"{what}: cannot read {path}: {exc.__class__.__name__}") from None
    if not line or not line[0].strip():
        raise TrunkError(f"{what}: {path} is empty")
    return Secret(line[0].strip())


class _TrunkEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    transport: Literal["udp", "tls"] = "udp"
    ca_file: Path | None = None
    srtp: bool = False
    proxy: str | None = None
    domain: str | None = None
    username: str | None = None
    password: str | None = None
    password_env: str | None = None
    password_file: Path | None = None
    caller_id: str | None = None
    display_name: str | None = None
    asserted_identity: str | None = None

    @model_validator(mode="after")
    def _credentials_whole(self) -> _TrunkEntry:
        secret = self.password or self.password_env or self.password_file
        if bool(self.username) != bool(secret):
            raise ValueError("a username needs a password (password, password_env or _file)")
        return self


class _TrunkFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    trunks: dict[str, _TrunkEntry]


def trunk_of(
    name: str,
    *,
    proxy: str | None = None,
    domain: str | None = None,
    username: str | None = None,
    password: str | None = None,
    password_env: str | None = None,
    password_file: Path | None = None,
    caller_id: str | None = None,
    display_name: str | None = None,
    asserted_identity: str | None = None,
    transport: Literal["udp", "tls"] = "udp",
    ca_file: Path | None = None,
    srtp: bool = False,
) -> Trunk:
    """A trunk from plain settings (a file's entry, or flags); raises TrunkError."""
    what = f"trunk {name!r}"
    secret = None
    if username:
        secret = read_secret(
            value=password,
            env=password_env,
            path=password_file,
            what=what,
            **({"sources": FLAG_SOURCES} if name == DEFAULT_TRUNK else {}),
        )
    elif password or password_env or password_file:
        raise TrunkError(f"{what}: a password needs a username")
    try:
        address = None if proxy is None else parse_hostport(_as_uri(proxy))
    except ValueError as exc:
        raise TrunkError(f"{what}: proxy: {exc}") from None
    for label, uri in (("asserted_identity", asserted_identity),):
        if uri is not None and not uri.lower().startswith(("sip:", "tel:")):
            raise TrunkError(f"{what}: {label} must be a sip: or tel: URI")
    if transport == "tls" and address is None:
        raise TrunkError(f"{what}: transport tls needs a proxy")
    if ca_file is not None and not ca_file.is_file():
        raise TrunkError(f"{what}: ca_file {ca_file}: no such file")
    return Trunk(
        name,
        transport=transport,
        ca_file=ca_file,
        srtp=srtp,
        proxy=address,
        domain=domain,
        username=username or None,
        password=secret,
        caller_id=caller_id,
        display_name=display_name,
        asserted_identity=asserted_identity,
    )


def load_trunks(path: Path | None, flags: Mapping[str, Any]) -> dict[str, Trunk]:
    """The trunks of the file at ``path`` (None: none) and the ``default`` one the flags make
    (``flags``: :func:`trunk_of`'s keywords; none set: no such trunk). Raises TrunkError with
    one line."""
    trunks: dict[str, Trunk] = {}
    if path is not None:
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8"))
            entries = _TrunkFile.model_validate(raw).trunks
        except (OSError, UnicodeDecodeError) as exc:
            raise TrunkError(
                f"--sip-trunks: cannot read {path}: {exc.__class__.__name__}"
            ) from None
        except yaml.YAMLError as exc:
            raise TrunkError(f"--sip-trunks: {path} is not YAML: {_first_line(exc)}") from None
        except ValidationError as exc:
            error = exc.errors()[0]
            where = ".".join(str(part) for part in error["loc"])
            raise TrunkError(f"--sip-trunks: {path}: {where}: {error['msg']}") from None
        for name, entry in entries.items():
            trunks[name] = trunk_of(name, **entry.model_dump())
    if any(value for value in flags.values()):
        if DEFAULT_TRUNK in trunks:
            raise TrunkError(
                f"the --sip-* trunk flags and {path} both define the trunk {DEFAULT_TRUNK!r}"
            )
        trunks[DEFAULT_TRUNK] = trunk_of(DEFAULT_TRUNK, **flags)
    return trunks


def pick_trunk(trunks: Mapping[str, Trunk], name: str | None) -> Trunk | None:
    """The trunk ``name`` (None: ``default``, or the only one; no trunks at all: None). Raises
    ValueError naming the trunks there are."""
    if name is None:
        if DEFAULT_TRUNK in trunks:
            return trunks[DEFAULT_TRUNK]
        if len(trunks) == 1:
            return next(iter(trunks.values()))
        if not trunks:
            return None
        raise ValueError(f"name a trunk: one of {', '.join(sorted(trunks))}")
    if name not in trunks:
        known = ", ".join(sorted(trunks)) or "none are configured (--sip-trunks)"
        raise ValueError(f"unknown trunk {name!r} (trunks: {known})")
    return trunks[name]


def parse_target(uri: str) -> tuple[str, int]:
    """The host and port (default 5060) of a ``sip:[user@]host[:port][;params]`` URI; raises
    ValueError naming what is wrong."""
    host, port = parse_hostport(uri)
    return host, port or 5060


def parse_hostport(uri: str) -> tuple[str, int | None]:
    """The host and port (None when the URI gives none: DNS SRV may say) of a
    ``sip:[user@]host[:port][;params]`` URI; raises ValueError naming what is wrong."""
    if not isinstance(uri, str) or not uri.lower().startswith("sip:"):
        raise ValueError("the callee must be a sip: URI, e.g. sip:alice@192.0.2.7:5060")
    rest = uri[4:].partition(";")[0].partition("?")[0]
    hostport = rest.rpartition("@")[2]
    if hostport.startswith("["):
        host, _, tail = hostport[1:].partition("]")
        port_text = tail.removeprefix(":") if tail.startswith(":") else ""
        if tail and not tail.startswith(":"):
            raise ValueError(f"bad host in {uri[:100]!r}")
    else:
        host, _, port_text = hostport.partition(":")
    if not host or any(c.isspace() or c in "<>\"'" for c in uri):
        raise ValueError(f"no host in {uri[:100]!r}")
    if port_text and not (port_text.isascii() and port_text.isdigit()):
        raise ValueError(f"bad port in {uri[:100]!r}")
    port = int(port_text) if port_text else None
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"port {port} is out of range")
    return host, port


def _as_uri(text: str) -> str:
    return text if text.lower().startswith("sip:") else f"sip:{text}"


def hostport(host: str, port: int | None) -> str:
    """``host:port`` as SIP writes it (an IPv6 address in brackets; no port when None)."""
    shown = f"[{host}]" if ":" in host else host
    return shown if port is None else f"{shown}:{port}"


def _first_line(exc: Exception) -> str:
    return (str(exc).splitlines() or [exc.__class__.__name__])[0]
