"""RTP ports for SIP calls: an even port for RTP and the next one for RTCP, leased from a range
and given back exactly once."""

from __future__ import annotations

import random
import socket

__all__ = ["NoFreePort", "RtpPortLease", "RtpPorts"]


class NoFreePort(RuntimeError):
    """Every port pair of the range is leased or in use by another program."""


class RtpPorts:
    """The pairs of ``port_range`` (low inclusive, high exclusive; RTP on even ports). A pair is
    offered only when both of its UDP ports can be bound right now."""

    def __init__(self, port_range: tuple[int, int]) -> None:
        low, self.high = port_range
        self.low = low + low % 2
        self.leased: set[int] = set()
        """RTP ports of the pairs leased out."""

    def lease(self) -> RtpPortLease:
        """A free pair, the search starting at a random one; raises NoFreePort. A pair is
        bound only later (an outbound call's, once the callee answers), and processes that share
        the range (two servers, or parallel tests) would otherwise all pick the lowest free pair
        and race for it: the loser's bind fails with "Address already in use"."""
        pairs = range(self.low, self.high - 1, 2)
        first = random.randrange(len(pairs)) if pairs else 0
        for index in range(len(pairs)):
            port = pairs[(first + index) % len(pairs)]
            if port not in self.leased and _bindable(port) and _bindable(port + 1):
                self.leased.add(port)
                return RtpPortLease(self, port)
        raise NoFreePort(f"no free RTP port pair in {self.low}-{self.high - 1}")


class RtpPortLease:
    """One leased pair: ``port`` for RTP, ``port + 1`` for RTCP."""

    def __init__(self, ports: RtpPorts, port: int) -> None:
        self.port = port
        self._ports = ports
        self.released = False

    def release(self) -> None:
        """Give the pair back (idempotent): after the sockets on it are closed."""
        if not self.released:
            self.released = True
            self._ports.leased.discard(self.port)


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind(("", port))
        except OSError:
            return False
    return True
