"""STUN keep-alives on the SIP UDP socket (RFC 5626 4.4.2): a Binding request to the registrar
from the very socket SIP uses keeps a NAT's binding open, proves the flow is alive, and names
the address the registrar sees (the reflexive address). A changed reflexive address means the
NAT rebound the flow: the binding at the registrar points at a dead port until Vocable
registers again.

:class:`StunPinger` sends the requests (retransmitted at 0.5, 1, 2 s ... within the wait given,
RFC 5389 7.2.1) and settles them when the socket hands it a STUN datagram
(:func:`is_stun`). The socket's other datagrams stay SIP's.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import Callable

from aioice import stun

__all__ = ["StunPinger", "is_stun"]

_RTO_S = 0.5
"""RFC 5389's initial retransmission timeout (doubling)."""
_COOKIE = stun.COOKIE.to_bytes(4, "big")


def is_stun(data: bytes) -> bool:
    """Whether a datagram is STUN, not SIP (RFC 5389 6: its first two bits are zero, the magic
    cookie follows the length; SIP starts with a letter or a CRLF keep-alive)."""
    return len(data) >= stun.HEADER_LENGTH and data[0] < 0x40 and data[4:8] == _COOKIE


class StunPinger:
    """Binding requests sent with ``send(datagram, address)``; answers fed to :meth:`received`."""

    def __init__(self, send: Callable[[bytes, tuple[str, int]], None]) -> None:
        self._send = send
        self._waiting: dict[bytes, asyncio.Future[tuple[str, int]]] = {}

    async def reflexive(self, address: tuple[str, int], within_s: float) -> tuple[str, int] | None:
        """The address ``address`` sees this socket at (its Binding response's XOR-MAPPED-
        ADDRESS), or None when no answer came within ``within_s``."""
        request = stun.Message(stun.Method.BINDING, stun.Class.REQUEST)
        datagram = bytes(request)
        answered = asyncio.get_running_loop().create_future()
        self._waiting[request.transaction_id] = answered
        try:
            async with asyncio.timeout(within_s):
                wait = _RTO_S
                while True:
                    self._send(datagram, address)
                    with contextlib.suppress(TimeoutError):
                        return await asyncio.wait_for(asyncio.shield(answered), wait)
                    wait *= 2
        except TimeoutError:
            return None
        finally:
            self._waiting.pop(request.transaction_id, None)

    def received(self, data: bytes) -> None:
        """A STUN datagram arrived: settle the request it answers (others are dropped)."""
        try:
            message = stun.parse_message(data)
        except (ValueError, struct.error):  # malformed: dropped, as SIP drops garbage
            return
        answered = self._waiting.get(message.transaction_id)
        if answered is None or answered.done():
            return
        mapped = message.attributes.get("XOR-MAPPED-ADDRESS") or message.attributes.get(
            "MAPPED-ADDRESS"
        )
        if message.message_class is stun.Class.RESPONSE and mapped is not None:
            answered.set_result((str(mapped[0]), int(mapped[1])))
