"""Sans-I/O per-request state: the life of every split request on one connection, for both ends.

``session.py`` covers the connection (handshake, framing, connection-level errors); this module
covers each request after it, in the style of h11's ``_state.py``: the rules are data
(``TRANSITIONS``), and one small class (``RequestTable``) applies them to the requests of one
connection, keyed by ``request_id``. No sockets, no clocks, no asyncio.

    table = RequestTable(Role.DEVICE)
    table.send(Generate("r1", prompt, 64))          # before writing it; raises RequestViolation if illegal
    ev = table.receive(Token("r1", 42, 0, 3.5))     # after decoding it
    if isinstance(ev, RequestViolation): ...        # the peer broke the protocol for request ev.request_id
    elif ev.ignored: ...                            # legal but without effect (it crossed the end on the wire)

Events are the messages of one request, sent or received: ``generate``, ``extend_budget``,
``stop``, ``cancel`` (device -> cloud) and ``token``, ``refined_prompt``, ``kv_transfer``,
``done``, ``error`` (cloud -> device). Each end holds its own view: the cloud's request goes
IDLE -> PREFILLING -> STREAMING -> STOPPING | CANCELLING -> DONE | ERRORED, the device's IDLE ->
SENT -> RECEIVING -> STOP_SENT | CANCEL_SENT -> DONE | ERRORED. ``TRANSITIONS[role][state][event]``
is the next state, ``IGNORED`` (legal, no effect, the state stays), or absent (a violation).

What the table allows because the wire is asynchronous (messages cross in flight):

* Tokens (and ``refined_prompt``, ``kv_transfer``, ``done``) after the device's ``stop`` or
  ``cancel``: the cloud sees it at its next step; everything up to ``done`` is legal.
* ``stop``, ``cancel``, ``extend_budget`` after the cloud's ``done`` or ``error`` (they crossed it),
  a repeated ``stop``/``cancel``, an ``extend_budget`` after them, or any of them for a request the
  cloud does not know (finished and forgotten): ignored. A device's table answers its own late
  ``stop``/``cancel``/``extend_budget`` with ``ignored`` too: it need not send them.
* A request id may be used again once its ``done`` or ``error`` was sent (cloud) / received (device).

Guards beyond the table (checked by ``RequestTable``, violations too): a ``token``'s ``index``
equals the tokens of that request so far (no gap, no duplicate); ``done.cloud_tokens`` equals the
tokens sent; ``refined_prompt`` only after token 0 of a Generate with ``refine`` set, at most once;
``kv_transfer`` only after token 0 of a Generate with ``kv_from`` set.

Finished requests (DONE, ERRORED) are kept in a bounded history (``history`` requests, oldest
forgotten first) so late crossings stay legal and violations say "after done"; a forgotten one is
IDLE again. Live requests are not bounded here: admission (``max_requests_per_session``) bounds them.

``python -m relayinfer.protocol.requests`` prints the markdown of both tables and diagrams, as in
``docs/PROTOCOL.md`` (checked by ``tests/test_protocol_docs.py``).
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass
from typing import Union

from .errors import ErrorCode, ProtocolError
from .messages import Cancel, Done, Error, ExtendBudget, Generate, KVTransfer, Message, RefinedPrompt, Stop, Token

__all__ = [
    "Role", "RequestState", "IGNORED", "SEND", "RECV", "EVENTS", "TRANSITIONS", "Transition", "RequestViolation",
    "RequestTable", "markdown",
]


class Role(enum.Enum):
    """Which end of the connection a table speaks for."""

    CLOUD = "cloud"
    DEVICE = "device"


class RequestState(enum.Enum):
    """One request's state at one end (IDLE: no such request, never seen or forgotten)."""

    IDLE = "idle"
    # cloud
    PREFILLING = "prefilling"  # Generate received (being validated, queued or prefilled); no Token sent yet
    STREAMING = "streaming"  # Token 0 sent
    STOPPING = "stopping"  # the device's Stop arrived: Tokens already produced may still go, then Done
    CANCELLING = "cancelling"  # the device's Cancel arrived: likewise
    # device
    SENT = "sent"  # Generate sent; nothing received yet
    RECEIVING = "receiving"  # Token 0 received
    STOP_SENT = "stop_sent"  # Stop sent: Tokens in flight still arrive, then Done
    CANCEL_SENT = "cancel_sent"  # Cancel sent: likewise
    # both
    DONE = "done"  # Done sent (cloud) / received (device)
    ERRORED = "errored"  # request-level Error sent (cloud) / received (device)


S = RequestState
IGNORED = "ignored"
"""Transition value: the event is legal but has no effect (a crossing); the state stays."""
SEND, RECV = "send", "recv"
FINISHED = (S.DONE, S.ERRORED)

_FROM_DEVICE = (Generate, ExtendBudget, Stop, Cancel)
_FROM_CLOUD = (Token, RefinedPrompt, KVTransfer, Done, Error)
EVENTS: dict[Role, list[tuple[str, type]]] = {
    Role.CLOUD: [(RECV, m) for m in _FROM_DEVICE] + [(SEND, m) for m in _FROM_CLOUD],
    Role.DEVICE: [(SEND, m) for m in _FROM_DEVICE] + [(RECV, m) for m in _FROM_CLOUD],
}
"""The events of one request at each end: (direction, message class)."""


def _ends(role: Role) -> dict:
    """Done / Error end the request at either end."""
    d = SEND if role is Role.CLOUD else RECV
    return {(d, Done): S.DONE, (d, Error): S.ERRORED}


def _cloud_live(stay: RequestState, stop: RequestState, cancel: RequestState, budget) -> dict:
    return {(SEND, Token): stay, (SEND, RefinedPrompt): stay, (SEND, KVTransfer): stay, **_ends(Role.CLOUD),
            (RECV, ExtendBudget): budget, (RECV, Stop): stop, (RECV, Cancel): cancel}


def _device_live(stay: RequestState, stop: RequestState, cancel: RequestState, budget) -> dict:
    return {(RECV, Token): stay, (RECV, RefinedPrompt): stay, (RECV, KVTransfer): stay, **_ends(Role.DEVICE),
            (SEND, ExtendBudget): budget, (SEND, Stop): stop, (SEND, Cancel): cancel}


_LATE = {(RECV, ExtendBudget): IGNORED, (RECV, Stop): IGNORED, (RECV, Cancel): IGNORED}  # crossed the Done
_LATE_OWN = {(SEND, ExtendBudget): IGNORED, (SEND, Stop): IGNORED, (SEND, Cancel): IGNORED}

TRANSITIONS: dict[Role, dict[RequestState, dict[tuple[str, type], Union[RequestState, str]]]] = {
    Role.CLOUD: {
        S.IDLE: {(RECV, Generate): S.PREFILLING, **_LATE},
        S.PREFILLING: {(SEND, Token): S.STREAMING, **_ends(Role.CLOUD),
                       (RECV, ExtendBudget): S.PREFILLING, (RECV, Stop): S.STOPPING, (RECV, Cancel): S.CANCELLING},
        S.STREAMING: _cloud_live(S.STREAMING, S.STOPPING, S.CANCELLING, S.STREAMING),
        S.STOPPING: _cloud_live(S.STOPPING, IGNORED, IGNORED, IGNORED),
        S.CANCELLING: _cloud_live(S.CANCELLING, IGNORED, IGNORED, IGNORED),
        S.DONE: {(RECV, Generate): S.PREFILLING, **_LATE},
        S.ERRORED: {(RECV, Generate): S.PREFILLING, **_LATE},
    },
    Role.DEVICE: {
        S.IDLE: {(SEND, Generate): S.SENT},
        S.SENT: {(RECV, Token): S.RECEIVING, **_ends(Role.DEVICE),
                 (SEND, ExtendBudget): S.SENT, (SEND, Stop): S.STOP_SENT, (SEND, Cancel): S.CANCEL_SENT},
        S.RECEIVING: _device_live(S.RECEIVING, S.STOP_SENT, S.CANCEL_SENT, S.RECEIVING),
        S.STOP_SENT: _device_live(S.STOP_SENT, IGNORED, IGNORED, IGNORED),
        S.CANCEL_SENT: _device_live(S.CANCEL_SENT, IGNORED, IGNORED, IGNORED),
        S.DONE: {(SEND, Generate): S.SENT, **_LATE_OWN},
        S.ERRORED: {(SEND, Generate): S.SENT, **_LATE_OWN},
    },
}
"""``TRANSITIONS[role][state][(direction, message class)]`` -> next state or ``IGNORED``; a pair
not listed is a violation."""


def _tag(cls: type) -> str:
    return cls.__struct_config__.tag


@dataclass(frozen=True)
class Transition:
    """A legal event: ``message`` moved request ``request_id`` from ``before`` to ``state``.
    ``ignored``: legal but without effect (the state stays; a receiver does nothing, a sender need
    not send it)."""

    request_id: str
    message: Message
    before: RequestState
    state: RequestState
    ignored: bool = False


class RequestViolation(ProtocolError):
    """``message`` is not legal for request ``request_id`` in ``state`` (at the end that checked it);
    ``reason`` says why. ``error``: the request-level Error (``bad_request``) that answers it; the
    request itself is unchanged (e.g. a duplicate Generate does not end the running request)."""

    def __init__(self, role: Role, request_id: str, state: RequestState, message: Message, reason: str) -> None:
        self.role, self.request_id, self.state, self.msg, self.reason = role, request_id, state, message, reason
        super().__init__(ErrorCode.BAD_REQUEST,
                         f"request {request_id!r} ({role.value} side, {state.value}): {_tag(type(message))!r} {reason}")

    @property
    def error(self) -> Error:
        """The request-level Error answering the violation."""
        return Error(self.code.value, self.message, self.request_id)


@dataclass
class _Request:
    state: RequestState
    tokens: int = 0  # Tokens sent (cloud) / received (device) so far = the next index
    refine: bool = False  # the Generate asked for a refined_prompt
    refined: bool = False  # ... and it came
    kv: bool = False  # the Generate asked for the KV hand-off (kv_from)


class RequestTable:
    """The requests of one connection at one end (``role``), by ``request_id``.

    ``send(msg)`` before writing a request message: returns a ``Transition`` or raises
    ``RequestViolation`` (our own bug). ``receive(msg)`` after decoding one: returns a
    ``Transition``, a ``RequestViolation`` (the peer's fault; answer it with ``.error`` or count
    it), or None for a message that is no request's (Ping, Pong, a connection-level Error).
    ``history``: finished requests remembered (count), oldest forgotten first.
    """

    def __init__(self, role: Role, history: int = 1024) -> None:
        if history < 0:
            raise ValueError(f"history must be >= 0 (requests), got {history}")
        self.role, self.history = role, history
        self._live: dict[str, _Request] = {}
        self._ended: OrderedDict[str, _Request] = OrderedDict()

    def state(self, request_id: str) -> RequestState:
        """The request's state (IDLE if unknown or forgotten)."""
        req = self._live.get(request_id) or self._ended.get(request_id)
        return req.state if req is not None else S.IDLE

    def tokens(self, request_id: str) -> int:
        """Tokens sent (cloud) / received (device) for the request so far (0 if unknown)."""
        req = self._live.get(request_id) or self._ended.get(request_id)
        return req.tokens if req is not None else 0

    @property
    def live(self) -> list[str]:
        """Ids of the requests that have not ended, oldest first."""
        return list(self._live)

    def send(self, msg: Message) -> Transition:
        """Record a message this end is about to send. Raises ``RequestViolation`` if illegal,
        ``TypeError`` for a message that belongs to no request."""
        ev = self._event(SEND, msg)
        if ev is None:
            raise TypeError(f"{type(msg).__name__} is not a message of a split request")
        if isinstance(ev, RequestViolation):
            raise ev
        return ev

    def receive(self, msg: Message) -> Transition | RequestViolation | None:
        """Record a received message; never raises on bad input (see the class docstring)."""
        return self._event(RECV, msg)

    def _event(self, direction: str, msg: Message) -> Transition | RequestViolation | None:
        rid = getattr(msg, "request_id", None)
        if rid is None:
            return None  # Ping, Pong, a connection-level Error: the session's business
        req = self._live.get(rid) or self._ended.get(rid)
        state = req.state if req is not None else S.IDLE
        key = (direction, type(msg))

        def violation(reason: str) -> RequestViolation:
            return RequestViolation(self.role, rid, state, msg, reason)

        if key not in EVENTS[self.role]:
            sender = "cloud" if self.role is Role.CLOUD and direction == SEND or \
                self.role is Role.DEVICE and direction == RECV else "device"
            return violation(f"is not a message a {sender} sends in a split request")
        nxt = TRANSITIONS[self.role][state].get(key)
        if nxt is None:
            why = {S.IDLE: "for an unknown request", S.DONE: "after done", S.ERRORED: "after error"}.get(
                state, "while the request is running" if type(msg) is Generate else "before token 0")
            return violation(why)
        if nxt == IGNORED:
            return Transition(rid, msg, state, state, ignored=True)
        err = self._guard(req, msg) if req is not None and state not in FINISHED else None
        if err:
            return violation(err)
        if type(msg) is Generate:  # a new request (a finished id is used again)
            self._ended.pop(rid, None)
            req = self._live[rid] = _Request(nxt, refine=msg.refine is not None, kv=msg.kv_from is not None)
        else:
            req.state = nxt
            if type(msg) is Token:
                req.tokens += 1
            elif type(msg) is RefinedPrompt:
                req.refined = True
        if nxt in FINISHED:
            del self._live[rid]
            self._ended[rid] = req
            while len(self._ended) > self.history:
                self._ended.popitem(last=False)
        return Transition(rid, msg, state, nxt)

    @staticmethod
    def _guard(req: _Request, msg: Message) -> str | None:
        """The checks the table cannot hold: token order, Done's count, what the Generate asked for."""
        n = req.tokens
        if isinstance(msg, Token) and msg.index != n:
            return (f"index {msg.index} repeats an earlier token (expected {n})" if msg.index < n else
                    f"index {msg.index} skips {msg.index - n} token(s) (expected {n})")
        if isinstance(msg, Done) and msg.cloud_tokens != n:
            return f"says cloud_tokens={msg.cloud_tokens} but {n} token(s) were streamed"
        if isinstance(msg, RefinedPrompt):
            if not req.refine:
                return "for a Generate without refine"
            if req.refined:
                return "sent twice"
            if n == 0:
                return "before token 0"
        if isinstance(msg, KVTransfer):
            if not req.kv:
                return "for a Generate without kv_from"
            if n == 0:
                return "before token 0"
        return None


# -- documentation ------------------------------------------------------------------------------------

def _cell(v) -> str:
    return "ignored" if v == IGNORED else "✗" if v is None else v.name


def markdown(role: Role) -> str:
    """The role's transition table as markdown (rows: states; columns: events; ✗ = violation)
    and its state diagram (mermaid, the moves only), as ``docs/PROTOCOL.md`` shows them."""
    table = TRANSITIONS[role]
    events = EVENTS[role]
    head = "| state | " + " | ".join(f"{d} `{_tag(m)}`" for d, m in events) + " |"
    lines = [head, "|" + "---|" * (len(events) + 1)]
    for state, row in table.items():
        lines.append(f"| {state.name} | " + " | ".join(_cell(row.get(e)) for e in events) + " |")
    edges: dict[tuple, list[str]] = {}
    for state, row in table.items():
        for (d, m), nxt in row.items():
            if nxt != IGNORED and nxt is not state:
                edges.setdefault((state, nxt), []).append(f"{d} {_tag(m)}")
    diagram = ["```mermaid", "stateDiagram-v2", "    [*] --> IDLE"]
    diagram += [f"    {a.name} --> {b.name}: {', '.join(labels)}" for (a, b), labels in edges.items()]
    diagram += ["```"]
    return "\n".join(diagram + [""] + lines) + "\n"


def main() -> None:
    """Print both roles' tables and diagrams (the blocks of docs/PROTOCOL.md)."""
    for role in Role:
        print(f"<!-- requests:{role.value} (generated by python -m relayinfer.protocol.requests) -->")
        print(markdown(role), end="")
        print("<!-- /requests -->\n")


if __name__ == "__main__":
    main()
