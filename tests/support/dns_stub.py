"""A DNS server for a test, on 127.0.0.1 (UDP): it answers the records it is given (NAPTR,
SRV, A, AAAA) with dnspython's wire format, NXDOMAIN for other names, and counts the
questions asked."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import cast

import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset

__all__ = ["DnsStub", "dns_stub"]


@dataclass
class DnsStub:
    port: int = 0
    records: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    """(name, type) -> the records' text, e.g. ("_sip._udp.pbx.test", "SRV"): ["10 60 5060
    sip.pbx.test."]."""
    asked: list[tuple[str, str]] = field(default_factory=list)


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, stub: DnsStub) -> None:
        self.stub = stub
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Python 3.11's selector datagram transport is not registered as a DatagramTransport
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        query = dns.message.from_wire(data)
        response = dns.message.make_response(query)
        question = query.question[0]
        name = question.name.to_text().rstrip(".").lower()
        kind = dns.rdatatype.to_text(question.rdtype)
        self.stub.asked.append((name, kind))
        found = self.stub.records.get((name, kind))
        if found:
            response.answer.append(dns.rrset.from_text_list(question.name, 60, "IN", kind, found))
        elif not any(known == name for known, _ in self.stub.records):
            response.set_rcode(dns.rcode.NXDOMAIN)
        assert self.transport is not None
        self.transport.sendto(response.to_wire(), addr)


@asynccontextmanager
async def dns_stub(records: dict[tuple[str, str], list[str]]) -> AsyncIterator[DnsStub]:
    """A :class:`DnsStub` answering ``records`` on a free port, for the block."""
    stub = DnsStub(records=records)
    transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
        lambda: _Protocol(stub), local_addr=("127.0.0.1", 0)
    )
    stub.port = int(transport.get_extra_info("sockname")[1])
    try:
        yield stub
    finally:
        transport.close()
