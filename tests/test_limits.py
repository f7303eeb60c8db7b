"""Limits of the cloud service: admission by min(context, KV capacity),
capped budgets, a dead engine reported by /healthz, sessions and requests per session bounded with
OVERLOADED + retry-after, bounded history, frame limits before and after the handshake, and every
resource back to zero when a device vanishes."""
from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import pytest

from relayinfer.cloud.serve.service import CloudService, ServiceThread, split_frame_limit
from relayinfer.protocol.transport import ws as proto_ws
from relayinfer.protocol.model.decoding import SamplingParams
from relayinfer.protocol.errors import ErrorCode, RemoteError
from relayinfer.protocol.model.errors import PromptTooLongError
from relayinfer.protocol.messages import HANDSHAKE_MAX_BYTES, Done, Error, Generate, Hello, Token, encode

BLOCKS = 32  # KV cache of the test engine: 32 blocks x 16 tokens = 512 tokens


def small_llm(torch_engine):
    from relayinfer.cloud.engine.llm_engine import AsyncLLMEngine, LLMEngine

    eng = LLMEngine(torch_engine, kv_cache_bytes=BLOCKS * 16 * 46080)
    assert eng.num_blocks == BLOCKS and eng.max_model_len == 512
    return AsyncLLMEngine(eng)


@pytest.fixture(scope="module")
def svc(torch_engine):
    # the queue-wait rule (its own test below) set out of the way: on a loaded machine the measured
    # prefill rate would refuse a request before the per-session limit these tests check is reached
    s = CloudService(torch_engine, torch_engine.fingerprint, llm=small_llm(torch_engine), max_sessions=3,
                     max_requests_per_session=2, retry_after_ms=1234.0, history=2, max_queue_wait_ms=1e9)
    with ServiceThread(s) as running:
        yield running


def run(coro, timeout=60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def one_request(url, fp, gen: Generate, until=(Done, Error)):
    """Open a channel, send `gen`, collect messages up to the first of type `until`."""
    async with await proto_ws.open_channel(url, fp) as ch:
        await ch.send(gen)
        got = []
        async for m in ch:
            got.append(m)
            if isinstance(m, until):
                return got
    return got


async def two_requests(url, fp) -> dict:
    """Send Generates "first" and "second" (80 prompt tokens, 4 new each) back to back on one
    session; their Done or Error by request id."""
    async with await proto_ws.open_channel(url, fp) as ch:
        await ch.send(Generate("first", list(range(10, 90)), 4))
        await ch.send(Generate("second", list(range(10, 90)), 4))
        got = {}
        async for m in ch:
            if isinstance(m, (Done, Error)):
                got[m.request_id] = m
            if len(got) == 2:
                return got
    return got


def test_engine_refuses_above_kv_capacity_naming_the_limit(torch_engine):
    llm = small_llm(torch_engine)
    with pytest.raises(PromptTooLongError, match=r"limit of 512 tokens .*KV cache capacity, 512"):
        llm.engine.add_request("big", list(range(10, 500)), SamplingParams(max_new_tokens=64), cloud_budget=2)
    # a budget can never grow a request past what admission checked
    llm.engine.add_request("r", list(range(10, 42)), SamplingParams(max_new_tokens=8), cloud_budget=2)
    llm.engine.set_budget("r", 10**9)
    out = []
    while llm.engine.has_unfinished():
        out += llm.engine.step()
    assert [o.index for o in out] == list(range(8)) and out[-1].finish_reason == "length"
    assert llm.engine.scheduler.num_preemptions == 0 and llm.engine.block_manager.num_used_blocks == 0


def test_service_prompt_too_long_names_effective_limit(svc, torch_engine):
    fp = torch_engine.fingerprint
    got = run(one_request(svc.url, fp, Generate("big", list(range(10, 480)), 64)))
    err = got[-1]
    assert isinstance(err, Error) and err.code == ErrorCode.PROMPT_TOO_LONG.value and err.request_id == "big"
    assert "470 prompt tokens + 64 new tokens" in err.message and "limit of 512 tokens" in err.message
    assert svc.max_request_tokens(True) == 512
    # a negative ExtendBudget/cloud_budget is refused by name
    got = run(one_request(svc.url, fp, Generate("neg", list(range(10, 40)), 4, cloud_budget=-1)))
    assert got[-1].code == ErrorCode.BAD_REQUEST.value and "cloud_budget" in got[-1].message


def test_sessions_bounded_with_overloaded_and_retry_after(svc, torch_engine):
    fp = torch_engine.fingerprint

    async def scenario():
        held = [await proto_ws.open_channel(svc.url, fp) for _ in range(3)]
        for _ in range(200):  # the server counts the three sessions (bounded wait on state)
            if svc.num_sessions == 3:
                break
            await asyncio.sleep(0.05)
        with pytest.raises(RemoteError) as e:
            await proto_ws.open_channel(svc.url, fp)
        assert e.value.code is ErrorCode.OVERLOADED and e.value.retry_after_ms == 1234.0
        assert "limit of 3 device sessions" in e.value.message
        await held.pop().close()
        for _ in range(50):  # the server notices the close
            if svc.num_sessions < 3:
                break
            await asyncio.sleep(0.05)
        held.append(await proto_ws.open_channel(svc.url, fp))  # room again
        for ch in held:
            await ch.close()

    run(scenario())


def test_requests_per_session_bounded(svc, torch_engine):
    async def scenario():
        async with await proto_ws.open_channel(svc.url, torch_engine.fingerprint) as ch:
            for i in range(3):
                await ch.send(Generate(f"g{i}", list(range(10, 40)), 64))
            async for m in ch:
                if isinstance(m, Error):
                    return m

    err = run(scenario())
    assert err.request_id == "g2" and err.code == ErrorCode.OVERLOADED.value and err.retry_after_ms == 1234.0
    assert "the limit per session" in err.message


def test_history_is_bounded(svc, torch_engine):
    for i in range(3):
        got = run(one_request(svc.url, torch_engine.fingerprint, Generate(f"h{i}", list(range(10, 30)), 2)))
        assert isinstance(got[-1], Done)
    assert len(svc.completed) == 2 and [d.request_id for d in svc.completed][-1] == "h2"


def test_frame_limits_before_and_after_handshake(svc, torch_engine):
    """4 KiB before the handshake (an unauthenticated peer cannot make the server buffer more); after
    it the limit fits the largest real message: a Generate of a whole context."""
    from websockets.asyncio.client import connect

    limit = svc.max_frame_bytes
    assert limit == split_frame_limit(torch_engine.context_length, torch_engine.cfg.vocab_size) < 64 << 10

    async def before():
        async with connect(svc.url, max_size=None) as ws:
            fat = Hello(1, torch_engine.fingerprint, client="x" * (2 * HANDSHAKE_MAX_BYTES))
            await ws.send(encode(fat))
            reply = await asyncio.wait_for(ws.recv(), 10)
            return reply

    from relayinfer.protocol.messages import decode
    err = decode(run(before()))
    assert isinstance(err, Error) and err.code == ErrorCode.FRAME_TOO_LARGE.value

    async def after():
        async with await proto_ws.open_channel(svc.url, torch_engine.fingerprint) as ch:
            whole = Generate("whole", [torch_engine.cfg.vocab_size - 1] * torch_engine.context_length, 1)
            assert len(encode(whole)) <= limit
            await ch.send(whole)
            return await ch.recv()

    err = run(after())  # accepted as a frame, refused as a request (it does not fit the KV cache)
    assert err.code == ErrorCode.PROMPT_TOO_LONG.value


def test_vanished_device_frees_everything(svc, torch_engine):
    """A device whose process dies mid-stream (TCP reset, no close frame): the session, the request
    and its KV blocks are all released."""
    llm = svc.llm

    async def scenario():
        ch = await proto_ws.open_channel(svc.url, torch_engine.fingerprint)
        await ch.send(Generate("gone", list(range(10, 200)), 200))
        while not isinstance(await ch.recv(), Token):
            pass
        ch.ws.transport.abort()

    run(scenario())
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (svc.num_sessions or llm.engine.seqs
                                           or llm.engine.block_manager.num_used_blocks):
        time.sleep(0.05)
    assert svc.num_sessions == 0 and not llm.engine.seqs and llm.engine.block_manager.num_used_blocks == 0
    assert svc.metrics.active_requests._value.get() == 0


def test_dead_engine_healthz_503_and_named_refusals(torch_engine):
    s = CloudService(torch_engine, torch_engine.fingerprint, llm=small_llm(torch_engine))
    with ServiceThread(s) as svc:
        fp = torch_engine.fingerprint

        def boom():
            raise RuntimeError("scripted accelerator fault")

        svc.llm.engine.step = boom
        got = run(one_request(svc.url, fp, Generate("a", list(range(10, 40)), 8)))
        assert isinstance(got[-1], Error) and got[-1].code == ErrorCode.INTERNAL.value
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"{svc.http_url}/healthz", timeout=10)
        assert e.value.code == 503
        body = json.loads(e.value.read())
        assert body["status"] == "error" and "scripted accelerator fault" in body.get("reason", "")
        got = run(one_request(svc.url, fp, Generate("b", list(range(10, 40)), 8)))
        assert got[-1].code == ErrorCode.INTERNAL.value and "engine failed" in got[-1].message
        assert "scripted accelerator fault" in got[-1].message


def test_queue_bound_answers_overloaded(torch_engine):
    """Prompt tokens waiting for their first token are bounded: beyond `max_queued_tokens` a new
    request gets OVERLOADED with the retry hint instead of queueing (a device runs on its own)."""
    s = CloudService(torch_engine, torch_engine.fingerprint, llm=small_llm(torch_engine), max_queued_tokens=100,
                     retry_after_ms=777.0, step_delay_ms=0.0)
    with ServiceThread(s, http_port=None) as svc:
        # 80 prompt tokens admitted; 80 + 80 > 100 while the first waits
        got = run(two_requests(svc.url, torch_engine.fingerprint))
        assert isinstance(got["first"], Done) and got["first"].cloud_tokens == 4
        err = got["second"]
        assert err.code == ErrorCode.OVERLOADED.value and err.retry_after_ms == 777.0
        assert "80 prompt tokens are waiting" in err.message and "limit 100" in err.message
        assert svc.pending_tokens == 0
        # once the queue drained, the same request is admitted
        got = run(one_request(svc.url, torch_engine.fingerprint, Generate("again", list(range(10, 90)), 4)))
        assert isinstance(got[-1], Done)


def test_zero_budget_streams_nothing_and_unexpected_messages(svc, torch_engine):
    from relayinfer.protocol.messages import PreInfer

    got = run(one_request(svc.url, torch_engine.fingerprint, Generate("zero", list(range(10, 40)), 8, cloud_budget=0)))
    assert len(got) == 1 and isinstance(got[0], Done) and got[0].reason == "budget" and got[0].cloud_tokens == 0

    async def scenario():
        async with await proto_ws.open_channel(svc.url, torch_engine.fingerprint) as ch:
            await ch.send(PreInfer("p", 1, [1], [1]))  # names a request: a request-level error, session lives
            err = await ch.recv()
            await ch.send(Generate("after", list(range(10, 30)), 2))
            while not isinstance(m := await ch.recv(), Done):
                pass
            return err, m

    err, done = run(scenario())
    assert err.request_id == "p" and err.code == ErrorCode.BAD_REQUEST.value and "unexpected PreInfer" in err.message
    assert done.request_id == "after" and done.cloud_tokens == 2


def test_expected_wait_bound_answers_overloaded(torch_engine):
    """The expected wait for a first token (waiting prompt tokens over the engine's measured prefill
    rate) is bounded too: a request that would wait longer gets OVERLOADED naming the wait."""
    s = CloudService(torch_engine, torch_engine.fingerprint, llm=small_llm(torch_engine), max_queue_wait_ms=1.0)
    with ServiceThread(s, http_port=None) as svc:
        assert svc.llm.engine.prefill_tok_s > 0  # measured by the warm-up at start

        got = run(two_requests(svc.url, torch_engine.fingerprint))
        assert isinstance(got["first"], Done)
        assert got["second"].code == ErrorCode.OVERLOADED.value and "expected wait" in got["second"].message
