"""Fault matrix of the split request: every phase x every cloud fault x both modes ends in a bounded
time with the right tokens and a named fault.

A scripted fake cloud (the real protocol layer, no model) sends the right tokens (the device-only
greedy answer) and then fails in one of the ways a phone meets: socket closed, request-level Error,
silent stall, process killed (TCP reset), OVERLOADED. The device is the real ONNX engine.
"""
from __future__ import annotations

import asyncio
import os
import sys
import threading
import time

import pytest

from relayinfer.device.profiles import DeviceProfile, PacedEngine
from relayinfer.device.policy import BACKGROUND_CHUNK
from relayinfer.device.settings import CloudEstimate
from relayinfer.device.split import SplitOptions, SplitSession
from relayinfer.protocol.transport import ws as proto_ws
from relayinfer.protocol.model.decoding import SamplingParams
from relayinfer.protocol.errors import ErrorCode
from relayinfer.protocol.messages import Done, Error, Generate, Stop, Token

from conftest import BackgroundSlow, inner_prefill

MAX_NEW = 12
SENT = 3  # tokens the fake cloud streams before its fault (phases after the first token)
FAULTS = ("close", "error", "stall", "kill", "done-early", "overloaded")
PHASES = ("before-first-token", "device-idle", "device-catching-up", "after-handoff")
EXPECTED_FAULT = {"close": "connection-lost", "kill": "connection-lost", "error": "cloud-error",
                  "stall": "cloud-stalled", "done-early": "cloud-error", "overloaded": "cloud-overloaded"}


class FakeCloud:
    """A websocket server speaking the real protocol whose answer to a Generate is a script:
    stream `tokens[:sent]` (every `gap_ms`; with `wait_for_stop` then wait for the device's Stop;
    with `fault_when`, a threading.Event, then wait for it, at most 20 s), then `fault`."""

    def __init__(self, fingerprint: str, tokens: list[int], fault: str, sent: int, gap_ms: float = 10.0,
                 wait_for_stop: bool = False, admit=None, fault_when: threading.Event | None = None):
        self.fingerprint, self.tokens, self.fault, self.sent = fingerprint, tokens, fault, sent
        self.gap_ms, self.wait_for_stop, self.admit, self.fault_when = gap_ms, wait_for_stop, admit, fault_when
        self.connections = 0
        self.got_stop = False
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    async def _handler(self, ch: proto_ws.ServerChannel) -> None:
        self.connections += 1
        msg = await ch.recv()
        assert isinstance(msg, Generate)
        rid = msg.request_id
        if self.wait_for_stop:  # stream `sent` tokens, wait (bounded) until the device takes over, then fail
            for i, t in enumerate(self.tokens[:self.sent]):
                await ch.send(Token(rid, t, i, 0.0, finish_reason=self._end(i)))
            try:
                self.got_stop = isinstance(await asyncio.wait_for(ch.recv(), 20), Stop)
            except (asyncio.TimeoutError, Exception):
                pass
        else:
            for i, t in enumerate(self.tokens[:self.sent]):
                await ch.send(Token(rid, t, i, 0.0, finish_reason=self._end(i)))
                await asyncio.sleep(self.gap_ms / 1e3)
        if self.fault_when is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.fault_when.wait, 20.0)
        f = self.fault
        if f == "close":
            await ch.close()
        elif f == "error":
            await ch.send(Error(ErrorCode.INTERNAL.value, "scripted failure", rid))
            await self._hold(ch)
        elif f == "overloaded":
            await ch.send(Error(ErrorCode.OVERLOADED.value, "busy", rid, 1500.0))
            await self._hold(ch)
        elif f == "done-early":
            await ch.send(Done(rid, "cancel", self.sent, 0.0))
            await self._hold(ch)
        elif f == "kill":
            ch.ws.transport.abort()  # like a killed process: RST, no close frame
        elif f == "stall":
            await self._hold(ch)  # silent; the socket stays open

    def _end(self, i: int) -> str | None:
        """Token i's finish_reason: the last token of the whole answer ends it, as the cloud marks it."""
        if i + 1 < len(self.tokens):
            return None
        return "length" if len(self.tokens) == MAX_NEW else "eos"

    @staticmethod
    async def _hold(ch) -> None:
        """Keep the connection open (reading and ignoring) until the device closes it; at most 30 s."""
        async def drain():
            async for _ in ch:
                pass
        try:
            await asyncio.wait_for(drain(), 30)
        except Exception:
            pass

    def __enter__(self) -> "FakeCloud":
        self._thread.start()

        async def start():
            return await proto_ws.serve(self._handler, "127.0.0.1", 0, expected_fingerprint=self.fingerprint,
                                        admit=self.admit)
        self.server = asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)
        self.url = f"ws://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    def __exit__(self, *exc) -> None:
        async def stop():
            self.server.close()
            await asyncio.wait_for(self.server.wait_closed(), 5)
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


@pytest.fixture(scope="module")
def prompt(chat_prompt_ids):
    return chat_prompt_ids[0]


@pytest.fixture(scope="module")
def device_answer(onnx_engine, prompt):
    """The device-only greedy answer: what every split answer must equal."""
    return onnx_engine.generate(prompt, SamplingParams(max_new_tokens=MAX_NEW)).token_ids


def session(engine, tokenizer, url, phase: str, mode: str, cloud: CloudEstimate | None = None, **opt):
    """A split session set up so that the device is in `phase` when the cloud fails."""
    timing = None
    if phase == "device-idle":  # prefill costs more per token than the display interval: cloud to the end
        timing, opt["cloud_budget"] = (0.0, 500.0, 20.0), "auto"
        engine = BackgroundSlow(engine, 60.0)  # and its background chunks measure so too (it stays held)
    elif phase in ("device-catching-up", "before-first-token"):  # still prefilling when the fault comes
        engine = PacedEngine(engine, DeviceProfile("slow-prefill", prefill_ms_base=300.0, decode_ms_per_token=1.0))
        opt["cloud_budget"] = None
    else:
        opt["cloud_budget"] = None
    opt.setdefault("progress_timeout_s", 0.3)
    return SplitSession(engine, tokenizer, url, engine.fingerprint, options=SplitOptions(mode=mode, target_tpot_ms=10.0, **opt),
                        device_timing=timing, cloud=cloud)


CELLS = [(p, f, m) for p in PHASES for f in FAULTS for m in ("split", "cloud-only")
         if not (p == "after-handoff" and m == "cloud-only")  # no hand-off without a device
         and not (p != "before-first-token" and f == "overloaded")  # OVERLOADED comes instead of a stream
         and not (p in ("device-idle", "device-catching-up") and m == "cloud-only")]  # phases of the split


@pytest.mark.parametrize("phase,fault,mode", CELLS)
def test_fault_matrix(onnx_engine, tokenizer, prompt, device_answer, phase, fault, mode):
    sent = 0 if phase == "before-first-token" else SENT
    handoff = phase == "after-handoff"  # a cloud that streams `sent` tokens, waits for Stop, then fails
    with FakeCloud(onnx_engine.fingerprint, device_answer, fault, sent, wait_for_stop=handoff) as fc:
        s = session(onnx_engine, tokenizer, fc.url, phase, mode)
        if phase == "device-idle":  # the settings really planned the cloud to the end
            assert s.opt.cloud_budget == "auto"
        shown = []  # no hang: the answer ends within the bounded wait
        res = asyncio.run(asyncio.wait_for(s.run(prompt, SamplingParams(max_new_tokens=MAX_NEW), shown.append), 60))
    # no lost or duplicated shown token: the events are the answer, in order
    assert [e.index for e in shown] == list(range(len(res.token_ids)))
    assert [e.token_id for e in shown] == res.token_ids
    if phase == "after-handoff":  # the device had taken over: the fault costs nothing
        assert fc.got_stop and res.mode == "split" and res.fault is None
        assert res.token_ids == device_answer
    elif mode == "split" and fault == "stall" and phase != "device-idle":
        # a working device hands off without waiting for the cloud: the stall costs nothing
        assert res.token_ids == device_answer and res.fault is None
        assert res.cloud_tokens == sent and res.device_tokens == MAX_NEW - sent
    elif mode == "split":  # the device completes the answer from the tokens it has
        assert res.token_ids == device_answer, (phase, fault)
        assert res.fault == EXPECTED_FAULT[fault] and res.error
        assert res.cloud_tokens == sent and res.device_tokens == MAX_NEW - sent
        assert res.mode == ("device-only" if sent == 0 else "split")
    else:  # cloud-only: the tokens received, and a clear fault
        assert res.token_ids == device_answer[:sent]
        assert res.fault == EXPECTED_FAULT[fault] and res.finish_reason == "error" and res.error


def test_idle_device_takes_over_on_a_long_prompt(onnx_engine, tokenizer, device_model_dir):
    """The issue's example: phone profile, a ~400-token prompt the settings give to the cloud to the
    end, a cloud that sends two tokens and closes: the call returns, the device finishes the answer."""
    from relayinfer.sdk.datasets import chitchat_prompts_by_length

    ids = chitchat_prompts_by_length(tokenizer, [400])[0]
    ref = onnx_engine.generate(ids, SamplingParams(max_new_tokens=MAX_NEW)).token_ids
    phone = DeviceProfile("phone-fast", prefill_ms_per_token=2.0, decode_ms_per_token=20.0)
    with FakeCloud(onnx_engine.fingerprint, ref, "close", 2) as fc:
        s = SplitSession(PacedEngine(onnx_engine, phone), tokenizer, fc.url, onnx_engine.fingerprint,
                         options=SplitOptions(target_tpot_ms=10.0), device_timing=(0.0, 50.0, 52.6))
        res = asyncio.run(asyncio.wait_for(s.run(ids, SamplingParams(max_new_tokens=MAX_NEW)), 60))
    assert res.mode == "split" and res.fault == "connection-lost"
    assert res.token_ids == ref and res.cloud_tokens == 2 and res.handoff_index == 2


class Watched:
    """The device engine, counting the tokens prefilled and the calls running, noting each prefill
    call's thread niceness; `reached` is set once `after` tokens are prefilled."""

    def __init__(self, engine, after: int):
        self.engine, self.after, self.prefilled, self.running, self.nice = engine, after, 0, 0, []
        self.reached = threading.Event()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def prefill(self, ids, kv=None, positions=None):
        self.running += 1
        self.nice.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) if hasattr(os, "getpriority") else 0)
        try:
            out = inner_prefill(self.engine, ids, kv, positions)
        finally:
            self.running -= 1
        self.prefilled += len(ids)
        if self.prefilled >= self.after:
            self.reached.set()
        return out

    def decode(self, token_id, kv):
        return self.engine.decode(token_id, kv)


PHONE = DeviceProfile("phone-fast", prefill_ms_per_token=2.0, decode_ms_per_token=20.0)
HOPELESS_TIMING = (0.0, 50.0, 52.6)  # what the settings believe: 50 ms a prefill token: cloud to the end


@pytest.fixture(scope="module")
def long_prompt(tokenizer, onnx_engine):
    """A ~400-token chitchat prompt and its device-only greedy answer."""
    from relayinfer.sdk.datasets import chitchat_prompts_by_length

    ids = chitchat_prompts_by_length(tokenizer, [400])[0]
    return ids, onnx_engine.generate(ids, SamplingParams(max_new_tokens=MAX_NEW)).token_ids


def test_idle_device_prefills_in_the_background_so_a_fault_costs_only_the_rest(onnx_engine, tokenizer, long_prompt):
    """Cloud to the end by plan: the device still prefills the prompt in the background, in small
    low-priority chunks. The cloud fails only after the device has prefilled 64 tokens (state, not
    time): at the fault the device has less than the prompt left, and it finishes the answer."""
    ids, ref = long_prompt
    w = Watched(PacedEngine(onnx_engine, PHONE), after=64)
    with FakeCloud(onnx_engine.fingerprint, ref, "close", 2, fault_when=w.reached) as fc:
        # the cloud is silent while it waits: a progress timeout longer than that wait (20 s at most)
        s = SplitSession(w, tokenizer, fc.url, onnx_engine.fingerprint,
                         options=SplitOptions(target_tpot_ms=10.0, progress_timeout_s=30.0), device_timing=HOPELESS_TIMING)
        res = asyncio.run(asyncio.wait_for(s.run(ids, SamplingParams(max_new_tokens=MAX_NEW)), 90))
    assert w.reached.is_set(), "the device did no work while the plan kept it idle"
    assert res.plan == "cloud-to-the-end" and res.fault == "connection-lost"
    assert res.token_ids == ref and res.cloud_tokens == 2 and res.handoff_index == 2
    assert res.prefill_left_at_fault is not None and res.prefill_left_at_fault <= len(ids) + 2 - 64
    assert BACKGROUND_CHUNK < len(ids) and max(w.nice) >= min(w.nice)
    if sys.platform.startswith("linux"):  # per-thread niceness: background chunks ran below the foreground
        base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        if base < 19:
            assert w.nice[0] > base and w.nice[-1] == base, (base, w.nice)


def test_idle_device_background_work_ends_with_the_answer(onnx_engine, tokenizer, long_prompt):
    """The cloud streams the whole answer as planned: the background prefill stops when the answer
    ends (no engine call still running when `run` returns), and what it prefilled is the
    conversation's next cache (a prefix of prompt + answer)."""
    ids, ref = long_prompt
    w = Watched(PacedEngine(onnx_engine, PHONE), after=1)
    with FakeCloud(onnx_engine.fingerprint, ref, "close", MAX_NEW, gap_ms=20.0) as fc:
        s = SplitSession(w, tokenizer, fc.url, onnx_engine.fingerprint,
                         options=SplitOptions(target_tpot_ms=10.0), device_timing=HOPELESS_TIMING)
        res = asyncio.run(asyncio.wait_for(s.run(ids, SamplingParams(max_new_tokens=MAX_NEW)), 60))
    assert res.plan == "cloud-to-the-end" and res.mode == "cloud-only" and res.fault is None
    assert res.token_ids == ref and res.prefill_left_at_fault is None
    assert w.running == 0  # the chunk in flight at the answer's end had finished before run returned
    assert w.prefilled > 0 and s.cache is not None and 0 < len(s.cache.ids) == s.cache.kv.length
    assert s.cache.ids == (ids + ref)[:len(s.cache.ids)]


def test_progress_timeout_is_derived_from_the_cloud_estimates():
    opt, cloud = SplitOptions(), CloudEstimate(ttft_base_ms=200.0, prefill_ms_per_token=2.0, tpot_ms=50.0)
    assert opt.progress_timeout(cloud, 400, first=True) == pytest.approx(3.0 + 5 * (200 + 800) / 1e3)
    assert opt.progress_timeout(cloud, 400, first=False) == pytest.approx(3.0 + 5 * 50 / 1e3)
    assert SplitOptions(progress_timeout_s=2.0).progress_timeout(cloud, 400, True) == 2.0
    with pytest.raises(ValueError, match="progress_timeout_s"):
        SplitOptions(progress_timeout_s=0)


def test_stalled_cloud_with_derived_timeout(onnx_engine, tokenizer, prompt, device_answer):
    """No progress_timeout_s given: the derived one (3 s + 5 x TPOT estimate) ends the stall."""
    with FakeCloud(onnx_engine.fingerprint, device_answer, "stall", SENT) as fc:
        # held by the plan, and its background prefill (120 ms a token) still short of the prompt when the
        # derived timeout (~3.2 s) ends the stall (a held device that caught up would take over by itself)
        s = SplitSession(BackgroundSlow(onnx_engine, 120.0), tokenizer, fc.url, onnx_engine.fingerprint,
                         options=SplitOptions(target_tpot_ms=10.0, cloud_budget="auto"), device_timing=(0.0, 500.0, 20.0))
        t0 = time.perf_counter()
        res = asyncio.run(asyncio.wait_for(s.run(prompt, SamplingParams(max_new_tokens=MAX_NEW)), 60))
        took = time.perf_counter() - t0
    assert res.fault == "cloud-stalled" and res.token_ids == device_answer and res.cloud_tokens == SENT
    assert took >= 3.0  # the derived timeout's floor passed first; the bounded wait (60 s) caps the rest


def test_overloaded_handshake_backs_off_device_only(onnx_engine, tokenizer, prompt, device_answer):
    """OVERLOADED at the handshake with a retry-after hint: device-only now, and no new connection
    attempt until the hint has passed; then the cloud is used again."""
    busy = {"on": True}

    def admit():
        return Error(ErrorCode.OVERLOADED.value, "full", None, 800.0) if busy["on"] else None

    cloud = CloudEstimate()
    with FakeCloud(onnx_engine.fingerprint, device_answer, "close", MAX_NEW, admit=admit) as fc:
        def run():
            s = session(onnx_engine, tokenizer, fc.url, "before-first-token", "split", cloud=cloud)
            return asyncio.run(asyncio.wait_for(s.run(prompt, SamplingParams(max_new_tokens=MAX_NEW)), 60))

        first = run()
        assert first.mode == "device-only" and first.fault == "cloud-overloaded" and first.token_ids == device_answer
        assert "overloaded" in first.error.lower() or "full" in first.error
        second = run()  # within the back-off: no connection attempt
        assert second.fault == "cloud-overloaded" and second.token_ids == device_answer
        busy["on"] = False
        time.sleep(max(0.0, cloud.retry_at - time.monotonic()) + 0.05)
        third = run()
        assert third.fault is None or third.fault != "cloud-overloaded"
    # admit() ran for the first and third requests only (the second honoured the hint)
    assert fc.connections == 1


def test_request_overloaded_sets_back_off(onnx_engine, tokenizer, prompt, device_answer):
    cloud = CloudEstimate()
    with FakeCloud(onnx_engine.fingerprint, device_answer, "overloaded", 0) as fc:
        s = session(onnx_engine, tokenizer, fc.url, "before-first-token", "split", cloud=cloud)
        t0 = time.monotonic()
        res = asyncio.run(asyncio.wait_for(s.run(prompt, SamplingParams(max_new_tokens=MAX_NEW)), 60))
        t1 = time.monotonic()
    assert res.fault == "cloud-overloaded" and res.token_ids == device_answer
    assert t0 + 1.5 <= cloud.retry_at <= t1 + 1.5  # the hint (1500 ms) from when the Error arrived


def test_device_runtime_error_hands_back_to_cloud(onnx_engine, tokenizer, prompt, device_answer):
    """A device runtime failure mid-request: the cloud streams to the end (ExtendBudget)."""

    class Broken:
        def __init__(self, e):
            self.e = e

        def __getattr__(self, k):
            return getattr(self.e, k)

        def prefill(self, *a, **k):
            raise RuntimeError("onnxruntime: scripted failure")

    with FakeCloud(onnx_engine.fingerprint, device_answer, "close", MAX_NEW, gap_ms=30.0) as fc:
        s = SplitSession(Broken(onnx_engine), tokenizer, fc.url, onnx_engine.fingerprint,
                         options=SplitOptions(target_tpot_ms=10.0, cloud_budget=None, progress_timeout_s=2.0))
        res = asyncio.run(asyncio.wait_for(s.run(prompt, SamplingParams(max_new_tokens=MAX_NEW)), 60))
    assert res.fault == "device-error" and "scripted failure" in res.error
    assert res.token_ids == device_answer and res.cloud_tokens == MAX_NEW
