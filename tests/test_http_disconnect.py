"""HTTP clients that leave are cancelled.

A real `CloudService` with the batching engine on loopback; a raw socket client sends an OpenAI
request with a ~3000-token chat prompt (context length 8192) and closes the connection: before the
first chunk (prefill under way), after the first streamed chunk, or while a non-streamed answer
is being generated. Each time the engine aborts the request within one engine step of the close
(steps are recorded by a probe around `LLMEngine.step`), its KV blocks go back, the abort counter
of `/metrics` goes up by one, the next short request is served, and nothing is logged above debug.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp
import pytest

from relayinfer.cloud.engine.llm_engine import AsyncLLMEngine, LLMEngine
from relayinfer.cloud.serve.service import CloudService, ServiceThread
from relayinfer.sdk.datasets import chitchat_prompts_by_length

MODEL = "smollm2-135m-instruct"
LONG = 3000          # prompt tokens of the long request
CHUNK = 256          # the engine's prefill chunk (max_num_batched_tokens)


class StepProbe:
    """Wraps `LLMEngine.step` to record (start, end, live request ids after the step) per step."""

    def __init__(self, engine: LLMEngine):
        self.engine, self._step, self.steps = engine, engine.step, []

    def __call__(self):
        t0 = time.perf_counter()
        out = self._step()
        self.steps.append((t0, time.perf_counter(), frozenset(self.engine.seqs)))
        return out

    def steps_after(self, t: float, rid: str) -> int:
        """Steps that started after `t` and still held `rid` when they ended (0: aborted at the
        first step boundary after `t`)."""
        return sum(1 for t0, _, live in list(self.steps) if t0 > t and rid in live)


@pytest.fixture(scope="module")
def cloud(torch_engine):
    llm = AsyncLLMEngine(LLMEngine(torch_engine, kv_cache_bytes=256 << 20))
    svc = CloudService(torch_engine, torch_engine.fingerprint, llm=llm, model_name=MODEL)
    with ServiceThread(svc) as running:
        probe = StepProbe(llm.engine)
        llm.engine.step = probe  # the engine thread calls eng.step() each loop
        running.probe = probe
        yield running


@pytest.fixture(scope="module")
def long_prompts(tokenizer):
    """Three different real chat prompts of exactly LONG tokens (chitchat conversations)."""
    out = []
    for seed in range(3):
        ids = chitchat_prompts_by_length(tokenizer, [LONG + 200], seed=seed)[0]
        assert len(ids) >= LONG
        out.append(ids[:LONG])
    return out


def _live(engine: LLMEngine) -> dict:
    while True:
        try:
            return {rid: (s.num_computed_tokens, s.num_output_tokens) for rid, s in list(engine.seqs.items())}
        except RuntimeError:  # changed size while copied by the engine thread
            continue


async def _wait(cond, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.005)


async def _post(port: int, body: dict):
    """Open a raw connection and send one POST /v1/completions (no response read)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 10)
    data = json.dumps(body).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    await writer.drain()
    return reader, writer


def _abort_count(svc) -> float:
    return svc.llm.metrics.registry.get_sample_value("relayinfer_engine_requests_total", {"reason": "abort"}) or 0.0


def _metrics_aborts(port: int) -> float:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    line = next((ln for ln in text.splitlines() if ln.startswith('relayinfer_engine_requests_total{reason="abort"}')),
                None)
    return 0.0 if line is None else float(line.split()[-1])  # no line before the first abort


def _run_case(cloud, prompt: list[int], stream: bool, close_when) -> dict:
    """Send the long request, close the socket once `close_when(computed, generated, got_chunk)`
    holds, then wait for the engine to drop it; then a short request. Returns what was measured."""
    svc, eng = cloud, cloud.llm.engine
    aborts0, metric0 = _abort_count(svc), _metrics_aborts(svc.http_port)

    async def main():
        assert _live(eng) == {}, "a request of an earlier case is still live"
        reader, writer = await _post(svc.http_port, {"model": MODEL, "prompt": prompt, "max_tokens": 1500,
                                                     "temperature": 0, "stream": stream})
        try:
            rid = (await _wait(lambda: list(_live(eng)), 60, "the request to reach the engine"))[0]
        except AssertionError:
            raise AssertionError(f"no engine request; the server answered {await reader.read(2000)!r}") from None
        got = bytearray()

        async def read_some():
            try:
                got.extend(await asyncio.wait_for(reader.read(4096), 0.01))
            except asyncio.TimeoutError:
                pass

        deadline = time.monotonic() + 120
        while True:
            st = _live(eng).get(rid)
            assert st is not None, "the request ended before the client left"
            await read_some()
            if close_when(st[0], st[1], b"data: " in got):
                break
            assert time.monotonic() < deadline, "never reached the point to close at"
        at_close = _live(eng).get(rid)
        writer.close()
        t_close = time.perf_counter()
        await _wait(lambda: rid not in _live(eng), 30, "the engine to drop the request")
        t_gone = time.perf_counter()
        try:
            await asyncio.wait_for(writer.wait_closed(), 5)
        except (ConnectionError, asyncio.TimeoutError):
            pass
        # the next request is served at once
        t0 = time.perf_counter()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            async with s.post(f"{svc.http_url}/v1/completions",
                              json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4,
                                    "temperature": 0}) as r:
                short = (r.status, await r.json())
        short_ms = (time.perf_counter() - t0) * 1e3
        return dict(rid=rid, at_close=at_close, headers_seen=b"HTTP/1.1 200" in got, chunk_seen=b"data: " in got,
                    gone_ms=(t_gone - t_close) * 1e3, steps_after=svc.probe.steps_after(t_close, rid),
                    short=short, short_ms=short_ms)

    res = asyncio.run(main())
    stats = eng.stats[res["rid"]]
    res.update(stats=stats, aborts=_abort_count(svc) - aborts0, metric_aborts=_metrics_aborts(svc.http_port) - metric0,
               used_blocks=eng.block_manager.num_used_blocks, live=_live(eng))
    print(f"\n{res['rid']}: closed at (computed, generated)={res['at_close']}, dropped {res['gone_ms']:.0f} ms "
          f"later, {res['steps_after']} engine steps started after the close still held it; short request "
          f"{res['short_ms']:.0f} ms")
    return res


def _check(res: dict) -> None:
    assert res["stats"].finish_reason == "abort"
    assert res["aborts"] == 1 and res["metric_aborts"] == 1
    assert res["steps_after"] <= 1  # within one engine step of the close (usually 0)
    assert res["used_blocks"] == 0 and res["live"] == {}
    status, body = res["short"]
    assert status == 200 and body["usage"]["completion_tokens"] == 4 and body["choices"][0]["text"]


def _quiet(caplog) -> list:
    return [f"{r.name} {r.levelname}: {r.getMessage()}" for r in caplog.records if r.levelno > logging.DEBUG]


def test_stream_closed_before_first_chunk_aborts_prefill(cloud, long_prompts, caplog):
    caplog.set_level(logging.DEBUG)
    res = _run_case(cloud, long_prompts[0], True, lambda computed, generated, chunk: computed >= CHUNK)
    _check(res)
    assert not res["headers_seen"]
    # the prefill stopped within one chunk of the close: the answer never started
    assert res["stats"].num_output_tokens == 0
    assert _quiet(caplog) == []


def test_stream_closed_after_first_chunk(cloud, long_prompts, caplog):
    caplog.set_level(logging.DEBUG)
    res = _run_case(cloud, long_prompts[1], True, lambda computed, generated, chunk: chunk)
    _check(res)
    assert res["headers_seen"] and res["chunk_seen"]
    # generation stopped right after the close, far from the 1500 tokens asked
    assert 1 <= res["stats"].num_output_tokens <= res["at_close"][1] + 2
    assert _quiet(caplog) == []


def test_non_streaming_closed_while_generating(cloud, long_prompts, caplog):
    caplog.set_level(logging.DEBUG)
    res = _run_case(cloud, long_prompts[2], False, lambda computed, generated, chunk: generated >= 3)
    _check(res)
    assert not res["headers_seen"]
    assert res["stats"].num_output_tokens <= res["at_close"][1] + 2
    assert _quiet(caplog) == []
