"""One Redis connection shared by the ``redis-syncer`` instances of a process that connect alike.

An EPP serving several pools has a syncer per pool (state keys under each pool's name); they share
one connection per set of connection settings (address, database, credentials, TLS, timeout)
instead of opening one each. Commands are written as they come, several at once when several
syncers send together, and their replies read back in order by one reader task; an error reply
goes to its own caller, a connection failure to every command in flight (then the next command
connects again).
"""

from __future__ import annotations

import asyncio
import weakref
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any

from redis import asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

Connect = Callable[[], aioredis.Connection]

# event loop -> connection settings -> its link (a loop that is gone takes its links with it)
_LINKS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Hashable, RedisLink]] = (
    weakref.WeakKeyDictionary()
)


class RedisLink:
    """A connection shared by ``users`` syncers; ``command`` sends one command and returns its reply."""

    __slots__ = ("_conn", "_connect", "_key", "_queue", "_reader", "users")

    def __init__(self, key: Hashable, connect: Connect) -> None:
        self._key = key
        self._connect = connect
        self._conn: aioredis.Connection | None = None
        self._queue: deque[tuple[tuple[Any, ...], asyncio.Future[Any]]] = deque()
        self._reader: asyncio.Task[None] | None = None
        self.users = 0

    async def command(self, *args: Any) -> Any:
        """Send ``args`` and wait for the reply (an error reply raises; so does a failed connection).
        A caller that stops waiting does not disturb the others: its reply is read and dropped."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.append((args, future))
        if self._reader is None or self._reader.done():
            self._reader = asyncio.ensure_future(self._run())
        return await future

    async def _ready(self) -> aioredis.Connection:
        conn = self._conn
        if conn is None:
            conn = self._conn = self._connect()
        elif conn.is_connected:
            try:
                if await conn.can_read():  # bytes nobody asked for: start on a clean connection
                    await conn.disconnect()
            except (RedisConnectionError, OSError):  # closed by the server (e.g. it restarted)
                await conn.disconnect()
        return conn

    async def _run(self) -> None:
        queue = self._queue
        while queue:
            batch = [(args, f) for args, f in queue if not f.done()]  # done: its caller gave up
            queue.clear()
            if not batch:
                continue
            done = 0
            try:
                conn = await self._ready()
                await conn.send_packed_command(conn.pack_commands(a for a, _ in batch), check_health=False)
                for _, future in batch:
                    try:
                        reply = await conn.read_response()
                    except ResponseError as e:  # an error reply: the connection is still in step
                        if not future.done():
                            future.set_exception(e)
                    else:
                        if not future.done():
                            future.set_result(reply)
                    done += 1
            except BaseException as e:
                if self._conn is not None:
                    try:
                        await self._conn.disconnect()
                    except OSError:
                        pass
                failure = e if isinstance(e, Exception) else RedisConnectionError("connection closed")
                for _, future in batch[done:]:
                    if not future.done():
                        future.set_exception(failure)
                if not isinstance(e, Exception):
                    raise

    async def _close(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None and not reader.done():
            reader.cancel()
            try:
                await reader
            except BaseException:  # its failure went to its callers
                pass
        for _, future in self._queue:
            if not future.done():
                future.set_exception(RedisConnectionError("connection closed"))
        self._queue.clear()
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                await conn.disconnect()
            except OSError:
                pass


def acquire(key: Hashable, connect: Connect) -> RedisLink:
    """The link of these connection settings on the running loop (made on first use); ``release``
    it when done."""
    links = _LINKS.setdefault(asyncio.get_running_loop(), {})
    link = links.get(key)
    if link is None:
        link = links[key] = RedisLink(key, connect)
    link.users += 1
    return link


async def release(link: RedisLink) -> None:
    """One user fewer; the last one closes the connection."""
    link.users -= 1
    if link.users > 0:
        return
    links = _LINKS.get(asyncio.get_running_loop(), {})
    if links.get(link._key) is link:
        del links[link._key]
    await link._close()


def connections() -> int:
    """Links open on the running loop (tests, the status page)."""
    return len(_LINKS.get(asyncio.get_running_loop(), {}))
