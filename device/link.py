"""The device's websocket to the cloud, with the per-request rules of `protocol.requests`.

Every request of the device goes through a `CloudLink`: one websocket, one reader task that
applies the connection's `RequestTable(Role.DEVICE)` to every frame and hands the result to the
request it names, and one `RequestChannel` per request (send, recv of its own events, close). A
split request on its own opens a private link and closes it at its end; a conversation keeps one
link across its turns (no reconnect per turn: opening costs a TCP handshake, the websocket upgrade
and the Hello/Welcome, three round trips before a Generate can leave). Requests of one link run on
one event loop.

What the table decides, once for every request: a frame that breaks the per-request rules (a
token index out of order, a Token after Done, a Done whose count is wrong, a RefinedPrompt not
asked for) reaches the request as a `RequestViolation` (the split session makes it a cloud fault);
the device's own Stop/Cancel/ExtendBudget that crossed the cloud's Done on the wire is ignored
(`RequestChannel.send` returns False and writes nothing). Frames of released requests are dropped.

A connection-level failure (connection lost, connection-level Error) reaches every open request
as the exception its `recv` raises, and the next request opens a new connection. A request that
ends with a connection fault (connection lost, stalled cloud, a per-request rule broken) releases
the link as broken, which closes the connection (the other requests on it then end as lost
connections: each device finishes its answer alone); one the cloud refused or failed with a
request-level Error leaves the connection to the others.

Reconnecting: once a link has been open, opening it again (the connection was lost or dropped)
is tried `reconnect_attempts` more times after a transport failure (refused, reset, timed out),
waiting `reconnect_backoff_s`, then twice as long, ... in between; a cloud that answers with a
refusal (UNAUTHORIZED, OVERLOADED, FINGERPRINT_MISMATCH) is not asked again. A request whose
first message (its Generate, `request(..., first=msg)`) finds a kept connection already closed
(the cloud went away while the link was idle) is sent again on a new connection: the old
connection's session ended with it, so the cloud never runs it twice.

`sdk.Client` keeps one link for all its `generate` calls (one websocket and one handshake per
client, not per request); each `Conversation` keeps its own.
"""
from __future__ import annotations

import asyncio
import logging

from relayinfer.protocol.transport import ws as proto_ws
from relayinfer.protocol.errors import ChannelClosed, RelayInferError, RemoteError
from relayinfer.protocol.requests import RequestTable, RequestViolation, Role, Transition

CLOSE_TIMEOUT_S = 1.0  # bound on closing the websocket (a black-holed peer never answers)
log = logging.getLogger("relayinfer.device")


class RequestChannel:
    """One request's view of a `CloudLink`.

    `send(msg)`: record `msg` in the link's `RequestTable` and write it; False (nothing written)
    when the table ignores it (it crossed the cloud's Done). Raises `RequestViolation` for a
    message illegal in the request's state (the device's bug), `ChannelClosed` when the link is
    closed, and what the websocket raises. `recv()`: the next event of this request, a
    `requests.Transition` (its `.message` is the frame) or a `RequestViolation` (the cloud broke
    the rules); raises the link's connection error once it failed (and on every later call).
    `close()`: the request is over (the link stays open for the next one)."""

    def __init__(self, link: "CloudLink", request_id: str):
        self.link, self.request_id = link, request_id
        self.queue: asyncio.Queue = asyncio.Queue()

    async def send(self, msg) -> bool:
        ch, table = self.link.channel, self.link.table
        if ch is None or table is None:
            raise ChannelClosed("the link to the cloud is closed")
        if table.send(msg).ignored:
            return False
        await ch.send(msg)
        return True

    async def recv(self) -> Transition | RequestViolation:
        item = await self.queue.get()
        if isinstance(item, BaseException) and not isinstance(item, RequestViolation):
            self.queue.put_nowait(item)  # every later recv raises it too
            raise item
        return item

    async def close(self) -> None:
        self.link.release(self.request_id)


class CloudLink:
    """A lazily opened websocket to the cloud, shared by the requests that use it.

    Args:
        url, fingerprint, token, ssl: as for `protocol.transport.ws.open_channel`.
        connect_timeout_s: bound on opening and on the handshake (s), each.
        reconnect_attempts: more tries to open a link that was open before, after a transport
            failure (see the module docstring); 0 = none.
        reconnect_backoff_s: wait before the first of them (s); each next waits twice as long.

    Attributes:
        channel: the open `protocol.transport.ws` channel, None when closed.
        table: the `RequestTable(Role.DEVICE)` of the open connection (one per connection).
        connections: websockets opened so far (one per client or conversation when nothing fails).
        retries: failed opening attempts that were tried again.

    Raises (from `request`): what `open_channel` raises (OSError, TimeoutError, RemoteError, ...).
    """

    def __init__(self, url: str, fingerprint: str, token: str | None = None, ssl=None,
                 connect_timeout_s: float = 5.0, reconnect_attempts: int = 2, reconnect_backoff_s: float = 0.1):
        if reconnect_attempts < 0 or not reconnect_backoff_s >= 0:
            raise ValueError(f"reconnect_attempts must be >= 0 and reconnect_backoff_s >= 0 (s), got "
                             f"{reconnect_attempts}, {reconnect_backoff_s}")
        self.url, self.fingerprint, self.token, self.ssl = url, fingerprint, token, ssl
        self.connect_timeout_s = connect_timeout_s
        self.reconnect_attempts, self.reconnect_backoff_s = reconnect_attempts, reconnect_backoff_s
        self.channel = None
        self.table: RequestTable | None = None
        self.connections = 0
        self.retries = 0
        self._reader: asyncio.Task | None = None
        self._requests: dict[str, RequestChannel] = {}
        self._lock: asyncio.Lock | None = None

    async def request(self, request_id: str, first=None) -> RequestChannel:
        """A channel for one request, opening the connection first if there is none; `first` (the
        request's Generate), when given, is sent on it, again on a new connection if the kept one
        turns out closed. Raises what opening raises, and what `RequestChannel.send` raises."""
        self._lock = self._lock or asyncio.Lock()
        rc = self._requests[request_id] = RequestChannel(self, request_id)
        try:
            for again in (False, True):
                fresh = await self._ensure()
                if first is None:
                    return rc
                try:
                    await rc.send(first)
                    return rc
                except ChannelClosed:
                    if fresh or again:
                        raise
                    log.info("link to %s was closed while idle; reconnecting", self.url)
                    self._forget(self.channel)
            return rc
        except BaseException:
            self._requests.pop(request_id, None)
            raise

    async def _ensure(self) -> bool:
        """Open the connection if there is none; True when this call opened it. Before a kept
        connection is used again the loop runs a few rounds, so that a close that has already
        arrived (the peer went away while the link was idle) is noticed first."""
        async with self._lock:
            if self.channel is not None:
                for _ in range(3):
                    await asyncio.sleep(0)
            if self.channel is not None:
                return False
            self.channel = await self._open()
            self.table = RequestTable(Role.DEVICE)
            self.connections += 1
            self._reader = asyncio.create_task(self._read(self.channel, self.table))
            return True

    async def _open(self):
        """`open_channel`, tried again after a transport failure when the link was open before."""
        attempts = self.reconnect_attempts if self.connections else 0
        wait = self.reconnect_backoff_s
        for i in range(attempts + 1):
            try:
                return await proto_ws.open_channel(
                    self.url, self.fingerprint, self.token, client="relayinfer-device",
                    open_timeout=self.connect_timeout_s, **({"ssl": self.ssl} if self.ssl is not None else {}))
            except RemoteError:
                raise  # the cloud answered and refused: asking again changes nothing
            except (OSError, TimeoutError, ChannelClosed) as e:
                if i == attempts:
                    raise
                self.retries += 1
                log.info("link to %s: opening failed (%s: %s); again in %.2f s", self.url, type(e).__name__, e, wait)
                await asyncio.sleep(wait)
                wait *= 2
        raise AssertionError("unreachable")

    def _forget(self, channel) -> None:
        """A connection found closed: the next request opens a new one (its reader ends itself)."""
        if channel is not None and self.channel is channel:
            self.channel = None
            transport = getattr(channel.ws, "transport", None)
            if transport is not None:
                transport.abort()

    def release(self, request_id: str, broken: bool = False) -> None:
        """The request is over; `broken` (it ended with a cloud fault) also drops the connection."""
        self._requests.pop(request_id, None)
        if broken and self.channel is not None:
            self._drop(self.channel)

    async def _read(self, channel, table: RequestTable) -> None:
        """Apply the table to each frame and hand the event to the request it names."""
        try:
            while True:
                ev = table.receive(await channel.recv())
                if ev is None:
                    continue  # Ping, Pong: the connection's business
                rc = self._requests.get(ev.request_id)
                if rc is not None:
                    rc.queue.put_nowait(ev)
                elif isinstance(ev, RequestViolation):
                    log.warning("link to %s: %s (no live request; dropped)", self.url, ev)
        except asyncio.CancelledError:
            raise
        except (RelayInferError, OSError, ValueError) as e:  # connection lost or a connection-level Error
            log.info("link to %s ended: %s", self.url, e)
            if self.channel is channel:
                self.channel = None
            for rc in list(self._requests.values()):
                rc.queue.put_nowait(e)

    def _drop(self, channel) -> None:
        if self.channel is channel:
            self.channel = None
        if self._reader is not None:
            self._reader.cancel()
        transport = getattr(channel.ws, "transport", None)
        if transport is not None:
            transport.abort()
        err = ChannelClosed("the link to the cloud was dropped")
        for rc in list(self._requests.values()):
            rc.queue.put_nowait(err)

    async def aclose(self) -> None:
        """Close the connection (bounded by CLOSE_TIMEOUT_S; aborted past it)."""
        ch, self.channel = self.channel, None
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        if ch is not None:
            try:
                await asyncio.wait_for(ch.close(), CLOSE_TIMEOUT_S)
            except (RelayInferError, asyncio.TimeoutError, OSError):
                self._drop(ch)
