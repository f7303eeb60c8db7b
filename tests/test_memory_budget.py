"""One memory budget for every request path (protocol.transport.limits.MemoryBudget): the batching engine's
KV pool is reserved, requests on the per-request path (refinement, KV hand-off, no batching engine)
are charged while they run and refused with OVERLOADED + retry_after_ms beyond the budget, OpenAI
echo logprobs get 503 + Retry-After, pathology batches are charged while held; every charge is back
when the request ends (gauges to the pool, RSS roughly back)."""
from __future__ import annotations

import asyncio
import json
import os
import urllib.error
import urllib.request

import numpy as np
import pytest

from relayinfer.cloud.serve.service import CloudService, ServiceThread, per_request_bytes
from relayinfer.protocol.transport import ws as proto_ws
from relayinfer.protocol.errors import ErrorCode
from relayinfer.protocol.transport.limits import MemoryBudget
from relayinfer.protocol.messages import Done, Error, Generate, RefinedPrompt, Tensor, TileBatch

BLOCKS = 32  # the test engine's KV pool: 32 blocks x 16 tokens x 46,080 bytes = 22.5 MiB
POOL = BLOCKS * 16 * 46080


def small_llm(torch_engine):
    from relayinfer.cloud.engine.llm_engine import AsyncLLMEngine, LLMEngine

    return AsyncLLMEngine(LLMEngine(torch_engine, kv_cache_bytes=POOL))


def run(coro, timeout=600):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def outcomes(url, fp, gens: list[Generate]) -> dict:
    """Send `gens` on one session; the Done or Error of each by request id."""
    async with await proto_ws.open_channel(url, fp) as ch:
        for g in gens:
            await ch.send(g)
        got = {}
        async for m in ch:
            if isinstance(m, (Done, Error)):
                got[m.request_id] = m
            if len(got) == len(gens):
                return got
    return got


def prompt(chats, n):
    """`n` real prompt tokens: the test chat prompts one after another, repeated."""
    ids = [t for chat in chats for t in chat]
    return (ids * (n // len(ids) + 1))[:n]


def settled(svc, used: int) -> int:
    """svc.budget.used once it is `used` or after 10 s (sessions end asynchronously after a close)."""
    import time

    t_end = time.monotonic() + 10
    while svc.budget.used != used and time.monotonic() < t_end:
        time.sleep(0.02)
    return svc.budget.used


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def metric(svc, name) -> float:
    req = urllib.request.Request(f"{svc.http_url}/metrics")
    text = urllib.request.urlopen(req, timeout=30).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_budget_refuses_every_per_request_path_with_overloaded(torch_engine, chat_prompt_ids):
    ids = prompt(chat_prompt_ids, 600)
    cfg = torch_engine.cfg
    need_refine = per_request_bytes(cfg, 600, 4, refine=True)
    svc = CloudService(torch_engine, torch_engine.fingerprint, llm=small_llm(torch_engine), retry_after_ms=4321.0,
                       memory_bytes=POOL + need_refine // 2)  # less than one refined 600-token prompt
    with ServiceThread(svc) as s:
        assert s.budget.used == POOL and s.budget.by_path["kv_pool"] == POOL
        got = run(outcomes(s.url, torch_engine.fingerprint, [
            Generate("refine", ids, 4, refine=0.5), Generate("handoff", ids, 4, kv_from=0),
            Generate("batched", ids[:100], 4)]))
        for rid in ("refine", "handoff"):
            e = got[rid]
            assert isinstance(e, Error) and e.code == ErrorCode.OVERLOADED.value and e.retry_after_ms == 4321.0, e
            assert "600-token prompt" in e.message and "budget" in e.message
        assert isinstance(got["batched"], Done)  # the batch's KV pool is reserved already: served
        assert settled(s, POOL) == POOL
        assert metric(s, "relayinfer_memory_budget_bytes") == POOL + need_refine // 2
        assert metric(s, "relayinfer_memory_used_bytes") == POOL
        assert metric(s, "relayinfer_memory_refusals_total") == 2
    # without a batching engine every request is on the per-request path
    need = per_request_bytes(cfg, 600, 4)
    svc = CloudService(torch_engine, torch_engine.fingerprint, memory_bytes=need - 1)
    with ServiceThread(svc) as s:
        got = run(outcomes(s.url, torch_engine.fingerprint, [Generate("plain", ids, 4), Generate("short", ids[:50], 4)]))
        assert got["plain"].code == ErrorCode.OVERLOADED.value and isinstance(got["short"], Done)
        assert settled(s, 0) == 0  # the kept multi-turn cache of "short" went with its session


def test_one_fits_the_second_waits_and_everything_is_given_back(torch_engine, chat_prompt_ids):
    ids = prompt(chat_prompt_ids, 600)
    need = per_request_bytes(torch_engine.cfg, 600, 8, refine=True)
    svc = CloudService(torch_engine, torch_engine.fingerprint, llm=small_llm(torch_engine),
                       memory_bytes=POOL + need + need // 2)
    with ServiceThread(svc) as s:
        got = run(outcomes(s.url, torch_engine.fingerprint, [Generate("a", ids, 8, refine=0.5),
                                                             Generate("b", ids, 8, refine=0.5)]))
        assert isinstance(got["a"], Done) and got["b"].code == ErrorCode.OVERLOADED.value
        assert settled(s, POOL) == POOL and s.budget.by_path["refine"] == 0
        got = run(outcomes(s.url, torch_engine.fingerprint, [Generate("c", ids, 8, refine=0.5)]))
        assert isinstance(got["c"], Done)  # room again once "a" ended
        # a kept multi-turn cache is charged while kept and given back with its session
        got = run(outcomes(s.url, torch_engine.fingerprint, [Generate("d", ids, 4, kv_from=590)]))
        assert isinstance(got["d"], Done)
        assert settled(s, POOL) == POOL and s.budget.by_path.get("kept_kv", 0) == 0


def test_three_5000_token_refined_prompts_stay_in_the_default_budget(torch_engine, chat_prompt_ids):
    """The attack: three 5,000-token prompts with refinement at once. With the default budget (the
    KV pool + 512 MiB) one runs, the others get OVERLOADED, and the memory comes back after."""
    ids = prompt(chat_prompt_ids, 5000)
    svc = CloudService(torch_engine, torch_engine.fingerprint, llm=small_llm(torch_engine))
    assert svc.budget.limit_bytes == POOL + (512 << 20)
    with ServiceThread(svc) as s:

        async def three():
            return await asyncio.gather(*(outcomes(s.url, torch_engine.fingerprint, [Generate(f"r{k}", ids, 4,
                                                                                             refine=0.5)])
                                          for k in range(3)))

        before = rss()
        peak_used = []

        async def watch(task):
            while not task.done():
                peak_used.append(s.budget.used)
                await asyncio.sleep(0.05)

        async def scenario():
            t = asyncio.ensure_future(three())
            await watch(t)
            return await t

        got = [next(iter(d.values())) for d in run(scenario())]
        done = [g for g in got if isinstance(g, Done)]
        refused = [g for g in got if isinstance(g, Error) and g.code == ErrorCode.OVERLOADED.value]
        assert len(done) == 1 and len(refused) == 2, got
        assert max(peak_used) <= s.budget.limit_bytes
        assert settled(s, POOL) == POOL
        grown = rss() - before
        print(f"RSS after/before the three 5,000-token refined prompts: +{grown / 2**20:.0f} MiB; "
              f"budget peak {max(peak_used) / 2**20:.0f} of {s.budget.limit_bytes / 2**20:.0f} MiB")
        assert grown < 200 << 20, f"RSS stayed {grown / 2**20:.0f} MiB above its start"


def test_echo_logprobs_beyond_the_budget_get_503_with_retry_after(torch_engine):
    svc = CloudService(torch_engine, torch_engine.fingerprint, llm=small_llm(torch_engine), memory_bytes=POOL + 1,
                       retry_after_ms=3000.0)
    with ServiceThread(svc) as s:
        body = json.dumps({"prompt": "hello " * 50, "max_tokens": 1, "echo": True, "logprobs": 1}).encode()
        req = urllib.request.Request(f"{s.http_url}/v1/completions", body, {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=60)
        assert e.value.code == 503 and e.value.headers["Retry-After"] == "3"
        assert "echo logprobs" in json.loads(e.value.read())["error"]["message"]
        assert settled(s, POOL) == POOL


def test_budget_accounting():
    b = MemoryBudget(100)
    c = b.try_charge("x", 60)
    assert b.try_charge("y", 41) is None and b.refused == {"y": 1}
    d = b.try_charge("y", 40)
    assert b.used == 100 and b.free == 0
    c.release()
    c.release()  # once
    d.release()
    assert b.used == 0 and b.by_path == {"x": 0, "y": 0}
    with pytest.raises(ValueError, match="needs 0 MiB but the memory budget"):
        b.reserve("pool", 101)


def test_patho_sessions_capped_and_frames_charged():
    from relayinfer.cloud.patho.encoder import ViTEncoder
    from relayinfer.cloud.patho.service import PathoService, PathoServiceThread, SlideScreener
    from relayinfer.cloud.patho.vit import VIT_TINY_TEST
    from relayinfer.protocol.patho import patho_fingerprint

    enc = ViTEncoder(None, VIT_TINY_TEST, "imagenet", 8, False, "cpu")
    px = 224
    one = px * px * 3
    svc = PathoService(SlideScreener(enc), max_sessions=2, memory_bytes=40 * one, retry_after_ms=1500.0)
    with PathoServiceThread(svc) as s:
        fp = patho_fingerprint(s.tile_px, s.mpp)

        def batch(rid, n, last=False):
            tiles = np.random.default_rng(0).integers(0, 255, (n, px, px, 3), dtype=np.uint8)
            return TileBatch(request_id=rid, slide_id=rid, coords=[[i, 0] for i in range(n)],
                             tiles=Tensor.from_numpy(tiles), last=last)

        async def scenario():
            a = await proto_ws.open_channel(s.url, fp)
            b = await proto_ws.open_channel(s.url, fp)
            with pytest.raises(Exception) as e:  # a third connection: OVERLOADED at the upgrade
                await proto_ws.open_channel(s.url, fp)
            assert getattr(e.value, "code", None) is ErrorCode.OVERLOADED and e.value.retry_after_ms == 1500.0
            await a.send(batch("big", 20))  # 20 tiles need frame + float input: more than 40 tiles of pixels
            err = await a.recv()
            assert isinstance(err, Error) and err.code == ErrorCode.OVERLOADED.value and err.retry_after_ms == 1500.0
            await a.send(batch("ok", 4, last=True))  # a small one fits
            res = await a.recv()
            assert res.slide_score is not None and len(res.attention.to_numpy()) == 4
            await b.send(batch("open", 2))  # an open slide keeps its embeddings charged...
            await b.recv()
            assert s.budget.by_path["patho_embeddings"] > 0
            await b.close()  # ...until its connection ends
            await a.close()
            for _ in range(100):
                if s.budget.used == 0 and s.num_sessions == 0:
                    break
                await asyncio.sleep(0.05)
            assert s.budget.used == 0 and s.num_sessions == 0

        run(scenario(), 300)
