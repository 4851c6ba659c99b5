"""Admission rate limits per client address, and finding that address behind trusted proxies."""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_address

__all__ = ["RateLimited", "RateLimiter", "client_address"]

Network = IPv4Network | IPv6Network


class RateLimited(Exception):
    """Too many new calls from one address; ``retry_after_s`` until the next is admitted."""

    def __init__(self, address: str, retry_after_s: float) -> None:
        super().__init__(f"too many new calls from {address}; retry in {retry_after_s:.0f} s")
        self.retry_after_s = retry_after_s


@dataclass
class _Bucket:
    tokens: float
    updated: float


class RateLimiter:
    """A token bucket per key: ``per_minute`` admissions refill steadily, up to ``burst`` at once.

    Memory is bounded: at most ``max_keys`` buckets are kept, the least recently seen dropped
    first (a dropped key starts again with a full bucket, which only errs towards admitting).
    ``per_minute`` 0 admits everything.
    """

    def __init__(
        self,
        per_minute: float,
        burst: int | None = None,
        max_keys: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if per_minute < 0:
            raise ValueError("per_minute must not be negative")
        self.per_second = per_minute / 60
        self.burst = float(burst if burst is not None else max(1, math.ceil(per_minute / 6)))
        if self.burst < 1:
            raise ValueError("burst must be at least 1")
        self.max_keys = max_keys
        self._clock = clock
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    def check(self, key: str) -> None:
        """Take one admission for ``key``; raises RateLimited when its bucket is empty."""
        if self.per_second == 0:
            return
        now = self._clock()
        bucket = self._buckets.pop(key, None) or _Bucket(self.burst, now)
        bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.updated) * self.per_second)
        bucket.updated = now
        self._buckets[key] = bucket
        while len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)
        if bucket.tokens < 1:
            raise RateLimited(key, max(1.0, (1 - bucket.tokens) / self.per_second))
        bucket.tokens -= 1


def client_address(peer: str | None, forwarded_for: str, trusted: Sequence[Network]) -> str:
    """The caller's address: ``peer``, unless it is a trusted proxy, in which case the
    right-most ``X-Forwarded-For`` entry that is not itself a trusted proxy (entries further left
    are the client's own claims and cannot be believed)."""
    address = peer or "unknown"
    if not trusted or not _within(address, trusted):
        return address
    for hop in reversed([h.strip() for h in forwarded_for.split(",") if h.strip()]):
        if not _within(hop, trusted):
            return hop if _parse(hop) is not None else address
        address = hop
    return address


def _within(text: str, networks: Sequence[Network]) -> bool:
    address = _parse(text)
    return address is not None and any(address in network for network in networks)


def _parse(text: str) -> IPv4Address | IPv6Address | None:
    try:
        return ip_address(text)
    except ValueError:
        return None
