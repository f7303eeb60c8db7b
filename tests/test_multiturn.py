"""Multi-turn reuse: a conversation keeps the device KV cache and one websocket
across turns, the cloud keeps the session's last KV; greedy answers equal the answers without reuse."""
from __future__ import annotations

import pytest

from relayinfer.sdk.datasets import chitchat_prompt

TURNS = 3
MAX_NEW = 8


@pytest.fixture(scope="module")
def cloud(torch_engine):
    from relayinfer.cloud.serve.service import CloudService, ServiceThread

    with ServiceThread(CloudService(torch_engine, torch_engine.fingerprint), http_port=None) as svc:
        yield svc


def user_turns(n: int) -> list[str]:
    """The first `n` user turns of a real chitchat conversation with at least that many."""
    for i in range(50):
        users = [m["content"] for m in chitchat_prompt(i, max_turns=2 * n) if m["role"] == "user"]
        if len(users) >= n:
            return users[:n]
    raise AssertionError("no chitchat conversation with enough user turns")


def test_conversation_reuse_equals_no_reuse(cloud, onnx_engine):
    from relayinfer.sdk.client import Client

    client = Client(cloud_url=cloud.url, engine=onnx_engine, cloud_budget=None, kv_handoff=False)
    texts = user_turns(TURNS)
    try:
        with client.conversation(reuse=True, max_new_tokens=MAX_NEW) as reuse, \
                client.conversation(reuse=False, max_new_tokens=MAX_NEW) as fresh:
            for text in texts:
                a, b = reuse.send(text), fresh.send(text)
                assert a.fault is None and b.fault is None, (a.error, b.error)
                assert a.prompt_ids == b.prompt_ids
                assert a.token_ids == b.token_ids  # greedy: reuse changes nothing in the answer
            assert reuse.link.connections == 1  # one websocket for the whole conversation
            for k, (a, b) in enumerate(zip(reuse.results, fresh.results)):
                assert b.device_cached_tokens == 0 and b.cloud_cached_tokens == 0
                if k == 0:
                    assert a.device_cached_tokens == 0
                    continue
                prev = reuse.results[k - 1]
                # at least the previous prompt is reused on both sides, and only the rest is prefilled
                if a.device_prompt_tokens:  # the device ran on this turn
                    assert a.device_cached_tokens >= len(prev.prompt_ids)
                    assert a.device_prompt_tokens == len(a.prompt_ids) - a.device_cached_tokens
                assert cloud_done(cloud, a.request_id).cached_tokens >= len(prev.prompt_ids)
            assert all(cloud_done(cloud, b.request_id).cached_tokens == 0 for b in fresh.results)
            assert 0 < cloud.kept_tokens <= cloud.max_kept_tokens  # the open conversation's last KV
    finally:
        client.close()
    wait_for(lambda: cloud.num_sessions == 0)
    assert cloud.kept_tokens == 0  # the sessions ended: their kept KV caches are freed


def wait_for(cond, timeout_s: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def cloud_done(cloud, request_id: str, timeout_s: float = 30.0):
    """The cloud's Done of a request (it may still be finishing after the device took over)."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = next((d for d in list(cloud.completed) if d.request_id == request_id), None)
        if done is not None:
            return done
        time.sleep(0.05)
    raise AssertionError(f"no Done for request {request_id} within {timeout_s} s")


def test_device_reuse_truncates_to_common_prefix(onnx_engine):
    """A cache whose ids leave the new prompt part-way is cut to the common prefix (device-only)."""
    import asyncio

    from relayinfer.device.split import DeviceCache, SplitOptions, SplitSession
    from relayinfer.protocol.model.decoding import SamplingParams

    tok = onnx_engine.tokenizer()
    ids = tok.encode_chat(user_turns(1)[0])
    s = SplitSession(onnx_engine, tok, None, onnx_engine.fingerprint, options=SplitOptions(mode="device-only"))
    params = SamplingParams(max_new_tokens=6)
    plain = asyncio.run(s.run(ids, params))
    _, kv = onnx_engine.prefill(ids[:-3] + [ids[-3] + 1, 5, 6])  # diverges 3 tokens before the end
    past = DeviceCache(ids[:-3] + [ids[-3] + 1, 5, 6], kv)
    res = asyncio.run(s.run(ids, params, past=past))
    assert res.device_cached_tokens == len(ids) - 3 and res.device_prompt_tokens == 3
    assert res.token_ids == plain.token_ids
    assert s.cache.ids == (ids + res.token_ids)[:s.cache.kv.length]
