"""Where a SIP URI's requests go (RFC 3263 4.1-4.2, over UDP or TLS): the address a trunk's
domain publishes in DNS.

- A numeric host, or a host with an explicit port: its address (A/AAAA), that port (5060, or
  5061 over TLS).
- Otherwise NAPTR first: a record whose service is the transport's (``SIP+D2U`` for UDP,
  ``SIPS+D2T`` for TLS) names the SRV domain; without one, ``_sip._udp.HOST`` or
  ``_sips._tcp.HOST``. SRV records are taken in priority order (weighted at random within a
  priority, RFC 2782), and the first whose target resolves is used.
- No NAPTR and no SRV: the host's address, port 5060 (5061).

The resolver is a setting (``--sip-dns-server``: a nameserver to ask instead of the system's,
for a split-horizon DNS or a test's stub). dnspython does the asking, asynchronously, so a slow
DNS holds no other call. :meth:`SipResolver.candidates` gives every SRV target in order, for a
dialer to fail over to the next when one does not answer (``dialer.py``). SIP over plain TCP is
not a transport Vocable dials, so its records are not read.
"""

from __future__ import annotations

import asyncio
import ipaddress
import random
import socket
from dataclasses import dataclass
from typing import Any, Literal

import dns.asyncresolver
import dns.exception
import dns.resolver

__all__ = ["SipResolver", "Unresolvable"]

DEFAULT_PORT = 5060
Transport = Literal["udp", "tls"]
_SERVICES: dict[str, tuple[str, str, int]] = {
    "udp": ("SIP+D2U", "_sip._udp", DEFAULT_PORT),
    "tls": ("SIPS+D2T", "_sips._tcp", 5061),
}
"""Per transport: its NAPTR service, its SRV prefix and its default port."""


class Unresolvable(OSError):
    """No address for the host; the message names it and what was asked."""


@dataclass(frozen=True)
class SipResolver:
    """Resolves SIP hosts through ``nameserver`` (``(ip, port)``; None: the system's)."""

    nameserver: tuple[str, int] | None = None
    timeout_s: float = 3.0

    async def resolve(
        self, host: str, port: int | None, family: int, transport: Transport = "udp"
    ) -> tuple[str, int]:
        """The address and port to send to for ``host`` (and ``port`` when the URI gave one):
        the first of :meth:`candidates`; raises Unresolvable."""
        return (await self.candidates(host, port, family, transport))[0]

    async def candidates(
        self, host: str, port: int | None, family: int, transport: Transport = "udp"
    ) -> list[tuple[str, int]]:
        """Every address to try for ``host`` over ``transport``, in order (SRV targets that
        resolve; else the one address); never empty; raises Unresolvable."""
        service, prefix, default_port = _SERVICES[transport]
        try:
            ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            pass
        else:
            return [(host.strip("[]"), port or default_port)]
        if port is not None:
            return [(await self._address(host, family), port)]
        resolver = self._resolver()
        srv_name = await self._naptr(resolver, host, service) or f"{prefix}.{host}"
        found = []
        for target, target_port in await self._srv(resolver, srv_name):
            try:
                found.append((await self._address(target, family), target_port))
            except Unresolvable:
                continue
        return found or [(await self._address(host, family), default_port)]

    def _resolver(self) -> dns.asyncresolver.Resolver:
        if self.nameserver is None:
            resolver = dns.asyncresolver.Resolver()
        else:
            resolver = dns.asyncresolver.Resolver(configure=False)
            resolver.nameservers = [self.nameserver[0]]
            resolver.port = self.nameserver[1]
        resolver.lifetime = self.timeout_s
        return resolver

    async def _naptr(
        self, resolver: dns.asyncresolver.Resolver, host: str, wanted: str
    ) -> str | None:
        """The SRV domain a NAPTR record of ``host`` for the service ``wanted`` names, if
        any."""
        answers = await _query(resolver, host, "NAPTR")
        records = sorted(answers, key=lambda r: (r.order, r.preference))
        for record in records:
            service, flags = record.service.decode().upper(), record.flags.decode().lower()
            if service == wanted and flags == "s":
                return str(record.replacement).rstrip(".")
        return None

    async def _srv(self, resolver: dns.asyncresolver.Resolver, name: str) -> list[tuple[str, int]]:
        """``name``'s SRV targets in the order to try them."""
        records = await _query(resolver, name, "SRV")
        ordered: list[tuple[str, int]] = []
        for priority in sorted({r.priority for r in records}):
            group = [r for r in records if r.priority == priority]
            while group:  # RFC 2782: weighted at random within a priority
                total = sum(r.weight for r in group)
                pick = random.uniform(0, total) if total else 0
                chosen = group[0]
                for record in group:
                    pick -= record.weight
                    if pick <= 0:
                        chosen = record
                        break
                group.remove(chosen)
                ordered.append((str(chosen.target).rstrip("."), int(chosen.port)))
        return [(target, port) for target, port in ordered if target]

    async def _address(self, host: str, family: int) -> str:
        if self.nameserver is None:
            loop = asyncio.get_running_loop()
            try:
                infos = await loop.getaddrinfo(host, None, type=socket.SOCK_DGRAM, family=family)
            except OSError as exc:
                raise Unresolvable(f"cannot resolve {host}: {exc}") from None
            return str(infos[0][4][0])
        kind = "AAAA" if family == socket.AF_INET6 else "A"
        answers = await _query(self._resolver(), host, kind)
        if not answers:
            raise Unresolvable(f"cannot resolve {host}: no {kind} record")
        return str(answers[0].address)


async def _query(resolver: dns.asyncresolver.Resolver, name: str, kind: str) -> list[Any]:
    """The records of ``kind`` for ``name`` (none when there are none, or the name is not);
    raises Unresolvable when the DNS does not answer."""
    try:
        answer = await resolver.resolve(name, kind, raise_on_no_answer=False)
    except (dns.resolver.NXDOMAIN, dns.resolver.NoNameservers):
        return []
    except dns.exception.Timeout:
        raise Unresolvable(f"the DNS did not answer for {name} ({kind})") from None
    except dns.exception.DNSException as exc:
        raise Unresolvable(f"cannot resolve {name} ({kind}): {exc}") from None
    return list(answer) if answer.rrset is not None else []
