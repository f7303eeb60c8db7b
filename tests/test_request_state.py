"""The per-request state table (protocol/requests.py), without sockets: every (state, event) pair of
both ends, the guards, the bounded history, and a hypothesis model of a cloud table and a device
table joined by two in-flight queues (messages cross between directions, as on a real link)."""
from __future__ import annotations

from collections import deque

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import numpy as np

from relayinfer.protocol.errors import ErrorCode
from relayinfer.protocol.messages import (
    Cancel, Done, Error, ExtendBudget, Generate, KVTransfer, Ping, RefinedPrompt, Stop, Tensor, TileBatch, Token,
)
from relayinfer.protocol.requests import (
    EVENTS, IGNORED, RECV, SEND, TRANSITIONS, RequestState as S, RequestTable, RequestViolation, Role, Transition,
)

R = "r1"
KV = Tensor.from_numpy(np.zeros((1, 2, 1, 1, 1), np.float16))


def make(cls, rid: str, n: int):
    """A message of type `cls` for request `rid` that passes the guards when `n` tokens were streamed."""
    return {Generate: lambda: Generate(rid, [1, 2], 8, refine=0.5, kv_from=0),
            ExtendBudget: lambda: ExtendBudget(rid, 4), Stop: lambda: Stop(rid, n), Cancel: lambda: Cancel(rid),
            Token: lambda: Token(rid, 7, n, 1.0), RefinedPrompt: lambda: RefinedPrompt(rid, [0]),
            KVTransfer: lambda: KVTransfer(rid, 0, KV, 1), Done: lambda: Done(rid, "eos", n, 1.0),
            Error: lambda: Error("internal", "boom", rid)}[cls]()


# a path of legal events from IDLE into each state (with a Token where the state allows one)
PATHS = {
    Role.CLOUD: {S.IDLE: [], S.PREFILLING: [(RECV, Generate)], S.STREAMING: [(RECV, Generate), (SEND, Token)],
                 S.STOPPING: [(RECV, Generate), (SEND, Token), (RECV, Stop)],
                 S.CANCELLING: [(RECV, Generate), (SEND, Token), (RECV, Cancel)],
                 S.DONE: [(RECV, Generate), (SEND, Token), (SEND, Done)],
                 S.ERRORED: [(RECV, Generate), (SEND, Error)]},
    Role.DEVICE: {S.IDLE: [], S.SENT: [(SEND, Generate)], S.RECEIVING: [(SEND, Generate), (RECV, Token)],
                  S.STOP_SENT: [(SEND, Generate), (RECV, Token), (SEND, Stop)],
                  S.CANCEL_SENT: [(SEND, Generate), (RECV, Token), (SEND, Cancel)],
                  S.DONE: [(SEND, Generate), (RECV, Token), (RECV, Done)],
                  S.ERRORED: [(SEND, Generate), (RECV, Error)]},
}


def apply(table: RequestTable, direction: str, msg):
    """send or receive; a send's RequestViolation is returned instead of raised."""
    if direction == RECV:
        return table.receive(msg)
    try:
        return table.send(msg)
    except RequestViolation as v:
        return v


def at(role: Role, state: S) -> RequestTable:
    t = RequestTable(role)
    for d, cls in PATHS[role][state]:
        ev = apply(t, d, make(cls, R, t.tokens(R)))
        assert isinstance(ev, Transition) and not ev.ignored, ev
    assert t.state(R) is state
    return t


CASES = [(role, state, ev) for role in Role for state in TRANSITIONS[role] for ev in EVENTS[role]]


def test_every_state_is_reachable_and_covered():
    for role in Role:
        assert set(PATHS[role]) == set(TRANSITIONS[role])
        assert {s for row in TRANSITIONS[role].values() for s in row.values() if s != IGNORED} <= set(TRANSITIONS[role])


@pytest.mark.parametrize("role,state,event", CASES, ids=lambda x: getattr(x, "name", None) or f"{x[0]}-{x[1].__name__}")
def test_every_state_event_pair(role, state, event):
    t = at(role, state)
    direction, cls = event
    before_tokens = t.tokens(R)
    ev = apply(t, direction, make(cls, R, before_tokens))
    want = TRANSITIONS[role][state].get(event)
    if want is None:
        assert isinstance(ev, RequestViolation), ev
        assert ev.request_id == R and ev.state is state and isinstance(ev.msg, cls)
        assert ev.error == Error(ErrorCode.BAD_REQUEST.value, ev.message, R)
        assert R in ev.message and state.value in ev.message
        assert t.state(R) is state and t.tokens(R) == before_tokens  # a violation changes nothing
    elif want == IGNORED:
        assert isinstance(ev, Transition) and ev.ignored and ev.state is ev.before is state
        assert t.state(R) is state
    else:
        assert isinstance(ev, Transition) and not ev.ignored and (ev.before, ev.state) == (state, want)
        assert t.state(R) is want
        assert t.tokens(R) == (before_tokens + 1 if cls is Token else 0 if cls is Generate else before_tokens)


def test_wrong_direction_and_foreign_messages():
    cloud, device = at(Role.CLOUD, S.STREAMING), at(Role.DEVICE, S.RECEIVING)
    v = cloud.receive(Token(R, 1, 1, 1.0))
    assert isinstance(v, RequestViolation) and "device sends" in v.reason
    with pytest.raises(RequestViolation, match="device sends"):
        device.send(Token(R, 1, 1, 1.0))
    with pytest.raises(RequestViolation, match="cloud sends"):
        cloud.send(Stop(R, 1))
    tiles = TileBatch(R, "s", [], Tensor.from_numpy(np.zeros((0, 1, 1, 1), np.uint8)))
    assert isinstance(cloud.receive(tiles), RequestViolation)
    assert cloud.receive(Ping(1, 0.0)) is None and device.receive(Error("overloaded", "busy")) is None
    with pytest.raises(TypeError):
        device.send(Ping(1, 0.0))
    assert cloud.state(R) is S.STREAMING and device.state(R) is S.RECEIVING


@pytest.mark.parametrize("role", list(Role))
def test_guards(role):
    t = at(role, S.STREAMING if role is Role.CLOUD else S.RECEIVING)  # one token streamed
    d = SEND if role is Role.CLOUD else RECV
    for msg, why in [(Token(R, 1, 0, 1.0), "repeats"), (Token(R, 1, 3, 1.0), "skips 2"),
                     (Done(R, "eos", 5, 1.0), "cloud_tokens=5 but 1")]:
        v = apply(t, d, msg)
        assert isinstance(v, RequestViolation) and why in v.reason, v
    assert not apply(t, d, RefinedPrompt(R, [0])).ignored
    assert "twice" in apply(t, d, RefinedPrompt(R, [0])).reason
    assert t.tokens(R) == 1
    # a Generate without refine / kv_from: neither may come; both only after token 0
    plain = RequestTable(role)
    apply(plain, RECV if role is Role.CLOUD else SEND, Generate("p", [1], 4))
    assert not apply(plain, d, Token("p", 1, 0, 1.0)).ignored
    assert "without refine" in apply(plain, d, RefinedPrompt("p", [0])).reason
    stopper = RequestTable(role)  # Stop{0} before token 0: the state allows the message, the guard does not
    apply(stopper, RECV if role is Role.CLOUD else SEND, Generate("q", [1], 4, refine=0.5, kv_from=0))
    apply(stopper, RECV if role is Role.CLOUD else SEND, Stop("q", 0))
    assert "before token 0" in apply(stopper, d, KVTransfer("q", 0, KV, 1)).reason
    assert "without kv_from" in apply(plain, d, KVTransfer("p", 0, KV, 1)).reason


def test_history_is_bounded_and_ids_can_be_reused():
    t = RequestTable(Role.CLOUD, history=2)
    for rid in "abc":
        t.receive(Generate(rid, [1], 4))
        t.send(Done(rid, "eos", 0, 0.0))
    assert [t.state(r) for r in "abc"] == [S.IDLE, S.DONE, S.DONE]  # 'a' forgotten
    assert t.receive(Stop("a", 0)).ignored and t.receive(Stop("b", 0)).ignored  # late either way: ignored
    assert t.receive(Generate("b", [1], 4)).state is S.PREFILLING and t.live == ["b"]
    v = t.receive(Generate("b", [1], 4))
    assert isinstance(v, RequestViolation) and "running" in v.reason and t.state("b") is S.PREFILLING
    with pytest.raises(ValueError):
        RequestTable(Role.DEVICE, history=-1)


# -- the two ends against each other ---------------------------------------------------------------

IDS = st.sampled_from(["a", "b", "c"])


class Link(RuleBasedStateMachine):
    """A device table and a cloud table; each sends what its table allows, into a FIFO per direction;
    delivery rules interleave the two directions at will. No legal interleaving may be rejected, and
    in the end both tables have seen the same requests end the same way with the same token counts."""

    @initialize(h_cloud=st.integers(0, 3), h_device=st.integers(0, 3))
    def setup(self, h_cloud, h_device):
        self.t = {"cloud": RequestTable(Role.CLOUD, h_cloud), "device": RequestTable(Role.DEVICE, h_device)}
        self.wire = {"cloud": deque(), "device": deque()}  # in flight TO that side
        self.ended = {"cloud": [], "device": []}  # (id, final state, tokens) in the order each end saw them
        self.gen = {}  # the cloud's view of the Generate of each live id

    def _note(self, side, ev, n):
        """n: the request's tokens before the event (a finished request may be forgotten at once)."""
        assert isinstance(ev, Transition), f"{side}: {ev}"
        if ev.state in (S.DONE, S.ERRORED) and not ev.ignored:
            self.ended[side].append((ev.request_id, ev.state, n))
        return ev

    def _send(self, side, msg):
        n = self.t[side].tokens(msg.request_id)
        ev = self._note(side, self.t[side].send(msg), n)
        if not ev.ignored:
            self.wire["device" if side == "cloud" else "cloud"].append(msg)

    @rule(rid=IDS, refine=st.booleans(), kv=st.booleans())
    def device_generates(self, rid, refine, kv):
        g = Generate(rid, [1], 8, refine=0.5 if refine else None, kv_from=0 if kv else None)
        if self.t["device"].state(rid) in (S.SENT, S.RECEIVING, S.STOP_SENT, S.CANCEL_SENT):
            with pytest.raises(RequestViolation, match="running"):
                self.t["device"].send(g)
        else:
            self._send("device", g)

    @rule(rid=IDS, kind=st.sampled_from([Stop, Cancel, ExtendBudget]))
    def device_steers(self, rid, kind):
        if self.t["device"].state(rid) is S.IDLE:
            return
        n = self.t["device"].tokens(rid)
        self._send("device", Stop(rid, n) if kind is Stop else Cancel(rid) if kind is Cancel else ExtendBudget(rid, n + 2))

    @rule(rid=IDS, what=st.sampled_from(["token", "token", "token", "done", "error"]))
    def cloud_acts(self, rid, what):
        t = self.t["cloud"]
        if rid not in t.live:
            return
        n = t.tokens(rid)
        if what == "token":
            self._send("cloud", Token(rid, 5, n, 1.0))
            g = self.gen[rid]
            if n == 0 and g.refine is not None:  # right after token 0, as the service does
                self._send("cloud", RefinedPrompt(rid, [0]))
            if n == 0 and g.kv_from is not None:
                self._send("cloud", KVTransfer(rid, 0, KV, 1, 0, 2))
                self._send("cloud", KVTransfer(rid, 0, KV, 1, 1, 2))
        else:
            self._send("cloud", Done(rid, "eos", n, 1.0) if what == "done" else Error("internal", "x", rid))

    def _deliver(self, side, k):
        for _ in range(min(k, len(self.wire[side]))):
            msg = self.wire[side].popleft()
            n = self.t[side].tokens(msg.request_id)
            ev = self._note(side, self.t[side].receive(msg), n)
            if side == "cloud" and isinstance(msg, Generate) and not ev.ignored:
                self.gen[msg.request_id] = msg

    @rule(side=st.sampled_from(["cloud", "device"]), k=st.integers(1, 4))
    def deliver(self, side, k):
        self._deliver(side, k)

    @invariant()
    def device_never_ahead_of_the_cloud(self):
        for rid in self.t["device"].live:
            assert self.t["device"].tokens(rid) <= self.t["cloud"].tokens(rid) or rid not in self.t["cloud"].live

    def teardown(self):
        for _ in range(50):  # drain: the cloud ends every live request, everything is delivered
            self._deliver("cloud", 10**6)
            for rid in self.t["cloud"].live:
                self._send("cloud", Done(rid, "stop", self.t["cloud"].tokens(rid), 1.0))
            self._deliver("device", 10**6)
            if not (self.wire["cloud"] or self.wire["device"] or self.t["cloud"].live):
                break
        assert self.t["cloud"].live == [] and self.t["device"].live == []
        assert self.ended["cloud"] == self.ended["device"]


Link.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None,
                                  suppress_health_check=[HealthCheck.too_slow])
TestLink = Link.TestCase
