"""Requests that race their own control messages, and the values at the edge of a field's range,
against a real batching cloud service: a Stop or Cancel sent right behind its Generate, a request
id reused right after its Done, `kv_from` at the last prompt token, a chat role that is no string.
Each ends in a named result (Done or BAD_REQUEST / 400), never INTERNAL, and the service serves on."""
from __future__ import annotations

import asyncio

import pytest
import requests

from relayinfer.cloud.engine.llm_engine import AsyncLLMEngine, LLMEngine
from relayinfer.cloud.serve.service import CloudService, ServiceThread
from relayinfer.protocol import ws as proto_ws
from relayinfer.protocol.errors import ErrorCode
from relayinfer.protocol.messages import Cancel, Done, Error, Generate, Stop, Token

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def service(torch_engine):
    llm = AsyncLLMEngine(LLMEngine(torch_engine, kv_cache_bytes=16 << 20))
    svc = CloudService(torch_engine, torch_engine.fingerprint, llm=llm, model_name=MODEL)
    with ServiceThread(svc) as running:
        yield running


def _ws(service, script):
    async def main():
        ch = await proto_ws.open_channel(service.url, service.fingerprint, client="test")
        try:
            return await script(ch)
        finally:
            await ch.close()
    return asyncio.run(asyncio.wait_for(main(), 180))


async def _until_end(ch, request_id: str) -> tuple[list[Token], Done | Error]:
    toks = []
    while True:
        m = await asyncio.wait_for(ch.recv(), 60)
        if getattr(m, "request_id", None) != request_id:
            continue
        if isinstance(m, (Done, Error)):
            return toks, m
        toks.append(m)


def test_stop_or_cancel_right_behind_generate_ends_the_request(service):
    """A Stop or Cancel in the same breath as its Generate: a Done with that reason (the request
    may stream nothing), the id free again at once, KV blocks back to 0."""
    async def script(ch):
        ends = []
        for i in range(12):
            control = Stop(f"r{i}", 0) if i % 2 == 0 else Cancel(f"r{i}")
            await ch.send(Generate(f"r{i}", [1, 2, 3], 6))
            await ch.send(control)
            ends.append((await _until_end(ch, f"r{i}"))[1])
        for _ in range(3):  # the same id again and again, right after each Done
            await ch.send(Generate("again", [1, 2, 3], 3))
            ends.append((await _until_end(ch, "again"))[1])
        return ends

    ends = _ws(service, script)
    assert all(isinstance(e, Done) for e in ends), [e for e in ends if not isinstance(e, Done)]
    assert {e.reason for e in ends[:12:2]} <= {"stop", "length"} and {e.reason for e in ends[1:12:2]} <= {"cancel", "length"}
    assert [e.cloud_tokens for e in ends[12:]] == [3, 3, 3]
    eng = service.llm.engine
    assert eng.block_manager.num_used_blocks == 0 and eng.seqs == {} and service.health() is None


@pytest.mark.parametrize("prompt,kv_from", [([1, 2, 3], 2), ([1, 2, 3], 3), ([7], 0)])
def test_kv_from_must_leave_tokens_to_hand_off(service, prompt, kv_from):
    """`kv_from` names the first prompt token whose KV the cloud sends, of the tokens [kv_from, n - 1):
    at n - 1 or beyond there is nothing to send, so it is refused naming the field."""
    async def script(ch):
        await ch.send(Generate("kv", prompt, 3, kv_from=kv_from))
        return await _until_end(ch, "kv")

    toks, end = _ws(service, script)
    assert toks == [] and isinstance(end, Error) and end.code == ErrorCode.BAD_REQUEST.value, end
    assert end.message.startswith("kv_from must be "), end.message
    assert service.health() is None


@pytest.mark.parametrize("role", [{"a": 1}, ["user"], 5, None])
def test_a_role_that_is_no_string_gets_400_naming_it(service, role):
    r = requests.post(f"http://127.0.0.1:{service.http_port}/v1/chat/completions",
                      json={"model": MODEL, "messages": [{"role": role, "content": "Hi"}], "max_tokens": 2}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages[0].role"


@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty", "frequency_penalty",
                                   "repetition_penalty", "seed", "max_tokens"])
def test_an_integer_beyond_any_float_gets_400_naming_the_field(service, field):
    """10**400 is valid JSON and a Python int, but no float: 400 naming the field, not a 500."""
    r = requests.post(f"http://127.0.0.1:{service.http_port}/v1/chat/completions",
                      json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                            field: 10 ** 400}, timeout=60)
    assert r.status_code == 400, r.text
    e = r.json()["error"]
    assert e["param"] == field and e["message"].startswith(f"{field} must be ") and "bits" in e["message"], e
