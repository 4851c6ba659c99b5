"""Which replica holds each live call: a call directory in Redis (``--redis-url``).

Every replica writes ``vocable:call:ID`` -> its internal URL (``--internal-url``) for each call
it holds, with an expiry of TTL_S that it renews every RENEW_S, and deletes the entry when the
call ends. A replica that dies takes its entries with it within TTL_S. A replica asked about a
call it does not hold looks the holder up here and passes the request on
(``server/http/relay.py``); the internal URLs never reach a client.

Redis lost while serving: calls go on, entries are written again once it is back (redis-py
reconnects on the next command), and a lookup raises :class:`DirectoryUnavailable` meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

import redis as sync_redis
import redis.asyncio as redis
from redis.exceptions import RedisError

__all__ = [
    "KEY_PREFIX",
    "RENEW_S",
    "TTL_S",
    "CallDirectory",
    "DirectoryUnavailable",
    "check_reachable",
]

log = logging.getLogger(__name__)

KEY_PREFIX = "vocable:call:"
TTL_S = 6.0
"""How long an entry outlives its replica's last renewal."""
RENEW_S = 2.0
"""How often a replica renews its entries (three renewals fit in an entry's life)."""
TIMEOUT_S = 2.0
"""The longest one Redis command may take before Redis counts as lost."""


class DirectoryUnavailable(RuntimeError):
    """Redis cannot be reached now; the message says why (never the URL: it may hold a
    password)."""


def check_reachable(url: str) -> None:
    """Ping Redis once, blocking (before a server loads its models); raises
    DirectoryUnavailable."""
    client = sync_redis.Redis.from_url(
        url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S
    )
    try:
        client.ping()
    except (RedisError, OSError) as exc:
        raise DirectoryUnavailable(f"cannot reach Redis at --redis-url: {_why(exc)}") from None
    finally:
        client.close()


class CallDirectory:
    """This replica's side of the directory: ``live()`` gives the ids of the calls it holds."""

    def __init__(self, url: str, me: str, live: Callable[[], Iterable[str]]) -> None:
        self.me = me
        """This replica's internal URL, as the others reach it."""
        self._live = live
        self._redis = redis.Redis.from_url(
            url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S
        )
        self.available = False
        """Whether the last command reached Redis."""
        self.problem: str | None = None
        """Why Redis is not available, while it is not."""
        self._pending: set[asyncio.Task[None]] = set()
        self._adding: dict[str, asyncio.Task[None]] = {}
        """Entries being written, by call id."""

    async def start(self) -> None:
        """Reach Redis and write the entries of the calls live so far; raises
        DirectoryUnavailable."""
        try:
            await self._redis.ping()
        except (RedisError, OSError) as exc:
            raise DirectoryUnavailable(f"cannot reach Redis at --redis-url: {_why(exc)}") from None
        await self.renew()

    async def run(self) -> None:
        """Renew this replica's entries every RENEW_S until cancelled."""
        while True:
            await asyncio.sleep(RENEW_S)
            await self.renew()

    async def renew(self) -> None:
        """Write every live call's entry with a fresh expiry (never raises)."""
        ids = list(self._live())
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for call_id in ids:
                    pipe.set(KEY_PREFIX + call_id, self.me, px=round(TTL_S * 1000))
                await pipe.execute()
        except (RedisError, OSError) as exc:
            self._lost(exc)
        else:
            self._reached()

    def added(self, call_id: str) -> None:
        """A call was admitted here: its entry is written now, not at the next renewal
        (:meth:`written` waits for it)."""
        task = self._spawn(self._set(call_id))
        self._adding[call_id] = task
        task.add_done_callback(lambda _: self._adding.pop(call_id, None))

    async def written(self, call_id: str) -> None:
        """Return once the entry of a call just admitted here is in Redis (or failed to be):
        a client told the call's id may ask any replica about it at once."""
        task = self._adding.get(call_id)
        if task is not None:
            await asyncio.shield(task)

    def removed(self, call_id: str) -> None:
        """A call ended here: its entry goes (if it still names this replica)."""
        self._spawn(self._delete(call_id))

    async def holder(self, call_id: str) -> str | None:
        """The internal URL of the replica holding ``call_id``; None when none does. Raises
        DirectoryUnavailable."""
        try:
            found = await self._redis.get(KEY_PREFIX + call_id)
        except (RedisError, OSError) as exc:
            self._lost(exc)
            raise DirectoryUnavailable(f"the call directory is unreachable: {_why(exc)}") from None
        self._reached()
        return found.decode() if isinstance(found, bytes) else None

    async def aclose(self) -> None:
        """Finish pending writes and close the connections (entries of calls still live
        expire by themselves)."""
        await asyncio.gather(*list(self._pending), return_exceptions=True)
        await self._redis.aclose()

    async def _set(self, call_id: str) -> None:
        with contextlib.suppress(RedisError, OSError):
            await self._redis.set(KEY_PREFIX + call_id, self.me, px=round(TTL_S * 1000))

    async def _delete(self, call_id: str) -> None:
        key = KEY_PREFIX + call_id
        with contextlib.suppress(RedisError, OSError):
            if await self._redis.get(key) == self.me.encode():
                await self._redis.delete(key)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(work)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return task

    def _lost(self, exc: BaseException) -> None:
        if self.available or self.problem is None:
            log.warning("the call directory (Redis) is unreachable: %s; calls go on", _why(exc))
        self.available, self.problem = False, _why(exc)

    def _reached(self) -> None:
        if not self.available and self.problem is not None:
            log.warning("the call directory (Redis) is reachable again")
        self.available, self.problem = True, None


def _why(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__
