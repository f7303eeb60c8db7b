"""One websocket to the cloud shared by the requests of a conversation (no reconnect per turn).

Opening a channel costs a TCP handshake, the websocket upgrade and the Hello/Welcome: three round
trips before a Generate can leave. A `CloudLink` opens it once and keeps it: each request gets a
`RequestChannel` (send, recv of its own messages, close) while one reader task hands every frame to
the request it names. Requests of one link run on one event loop (the conversation's).

A connection-level failure (connection lost, connection-level Error) reaches every open request
as the exception its `recv` raises, and the next request opens a new connection. A request that
ends with a fault (stalled cloud, ...) releases the link as broken, which closes the connection.
"""
from __future__ import annotations

import asyncio
import logging

from relayinfer.protocol.transport import ws as proto_ws
from relayinfer.protocol.errors import ChannelClosed, RelayInferError

CLOSE_TIMEOUT_S = 1.0  # bound on closing the websocket (a black-holed peer never answers)
log = logging.getLogger("relayinfer.device")


class RequestChannel:
    """One request's view of a `CloudLink`: `send(msg)`, `recv()` (the messages naming this
    request, in order; raises the link's connection error once it failed) and `close()`."""

    def __init__(self, link: "CloudLink", request_id: str):
        self.link, self.request_id = link, request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.ws = None  # not the socket's owner: closing a request never aborts the shared transport

    async def send(self, msg) -> None:
        ch = self.link.channel
        if ch is None:
            raise ChannelClosed("the link to the cloud is closed")
        await ch.send(msg)

    async def recv(self):
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.queue.put_nowait(item)  # every later recv raises it too
            raise item
        return item

    async def close(self) -> None:
        self.link.release(self.request_id)


class CloudLink:
    """A lazily opened, shared websocket to the cloud.

    Args:
        url, fingerprint, token, ssl: as for `protocol.transport.ws.open_channel`.
        connect_timeout_s: bound on opening and on the handshake (s), each.

    Raises (from `request`): what `open_channel` raises (OSError, TimeoutError, RemoteError, ...).
    """

    def __init__(self, url: str, fingerprint: str, token: str | None = None, ssl=None,
                 connect_timeout_s: float = 5.0):
        self.url, self.fingerprint, self.token, self.ssl = url, fingerprint, token, ssl
        self.connect_timeout_s = connect_timeout_s
        self.channel = None
        self.connections = 0  # websockets opened so far (one per conversation when nothing fails)
        self._reader: asyncio.Task | None = None
        self._requests: dict[str, RequestChannel] = {}
        self._lock: asyncio.Lock | None = None

    async def request(self, request_id: str) -> RequestChannel:
        """A channel for one request, opening the connection first if there is none."""
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            if self.channel is None:
                self.channel = await proto_ws.open_channel(
                    self.url, self.fingerprint, self.token, client="relayinfer-device",
                    open_timeout=self.connect_timeout_s, **({"ssl": self.ssl} if self.ssl is not None else {}))
                self.connections += 1
                self._reader = asyncio.create_task(self._read(self.channel))
        rc = self._requests[request_id] = RequestChannel(self, request_id)
        return rc

    def release(self, request_id: str, broken: bool = False) -> None:
        """The request is over; `broken` (it ended with a cloud fault) also drops the connection."""
        self._requests.pop(request_id, None)
        if broken and self.channel is not None:
            self._drop(self.channel)

    async def _read(self, channel) -> None:
        """Hand each frame to the request it names (frames of finished requests are dropped)."""
        try:
            while True:
                msg = await channel.recv()
                rc = self._requests.get(getattr(msg, "request_id", None) or "")
                if rc is not None:
                    rc.queue.put_nowait(msg)
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
