"""KV hand-off: the cloud sends the prompt's KV (fp16, the ONNX past-KV layout)
instead of the device prefilling it; the choice is made from the link bandwidth and the device's
prefill speed; greedy tokens equal those of the re-prefill path."""
from __future__ import annotations

import math

import numpy as np
import pytest

from relayinfer.protocol.kvhandoff import (crossover_bandwidth, kv_bytes_per_token, kv_handoff_pays, kv_layers,
                                           kv_messages)
from relayinfer.protocol.messages import decode, encode


MAX_NEW = 16


def test_kv_messages_round_trip_in_parts():
    rng = np.random.default_rng(0)
    kv = rng.standard_normal((30, 2, 3, 50, 64)).astype(np.float16)
    per_token = kv[:, :, :, :1].nbytes
    msgs = kv_messages("r1", kv, 7, max_bytes=20 * per_token + 4096)  # 20 tokens a frame: 3 parts
    assert [m.num_tokens for m in msgs] == [20, 20, 10] and {m.num_blocks for m in msgs} == {3}
    wire = [decode(encode(m)) for m in reversed(msgs)]  # any order
    start, layers = kv_layers(wire)
    assert start == 7 and len(layers) == 30
    for i, (k, v) in enumerate(layers):
        assert k.shape == (1, 3, 50, 64) and np.array_equal(k[0], kv[i, 0]) and np.array_equal(v[0], kv[i, 1])
    with pytest.raises(ValueError, match="parts"):
        kv_layers(wire[:2])
    with pytest.raises(ValueError, match="frame limit"):
        kv_messages("r1", kv, 0, max_bytes=4096)


def test_handoff_choice_and_crossover():
    bpt = kv_bytes_per_token(30, 3, 64)
    assert bpt == 23040  # SmolLM2-135M: 22.5 KiB a token in fp16
    b, ttft = 16.67, 150.0  # the phone profile's prefill ms/token; an expected cloud TTFT (ms)
    for n in (128, 512, 2048):
        bw = crossover_bandwidth(n, bpt, ttft, b, overhead_ms=20.0)
        assert kv_handoff_pays(n, bpt, bw * 1.01, ttft, 0.0, b, 20.0)
        assert not kv_handoff_pays(n, bpt, bw * 0.99, ttft, 0.0, b, 20.0)
    assert crossover_bandwidth(10_000_000, bpt, ttft, b) == pytest.approx(bpt / b * 1e3, rel=1e-3)
    assert math.isinf(crossover_bandwidth(5, bpt, ttft, b))  # the device is done before the first cloud token
    assert not kv_handoff_pays(512, bpt, None, ttft, 0.0, b)  # unknown bandwidth: the device prefills


@pytest.fixture(scope="module")
def cloud(torch_engine):
    from relayinfer.cloud.serve.service import CloudService, ServiceThread

    with ServiceThread(CloudService(torch_engine, torch_engine.fingerprint), http_port=None) as svc:
        yield svc


@pytest.mark.parametrize("k", [0, 1, 2])
def test_kv_handoff_equals_reprefill(cloud, onnx_engine, chat_prompt_ids, k):
    """The suite's chat prompts: the device imports the KV of all prompt tokens but the last and
    its greedy tokens equal those of the device's own prefill (fp16 rounding flips no token on
    these prompts)."""
    from relayinfer.sdk.client import Client

    common = dict(cloud_url=cloud.url, engine=onnx_engine, cloud_budget=None)
    handoff, own = Client(kv_handoff=True, **common), Client(kv_handoff=False, **common)
    ids = chat_prompt_ids[k]
    a = handoff.complete(ids, max_new_tokens=MAX_NEW)
    b = own.complete(ids, max_new_tokens=MAX_NEW)
    assert a.fault is None and b.fault is None, (a.error, b.error)
    assert b.kv_imported_tokens == 0
    if a.device_prompt_tokens:  # the device ran (the cloud did not finish first)
        assert a.kv_imported_tokens == len(ids) - 1 and a.device_prompt_tokens == 1
    assert a.token_ids == b.token_ids


def test_auto_kv_handoff_is_not_asked_for_an_answer_shorter_than_the_transfer(cloud, onnx_engine, chat_prompt_ids,
                                                                                monkeypatch):
    """kv_handoff 'auto' on a fast measured link with a device slow at prefill: the KV is asked
    for a 24-token answer, but not for a 2-token one, which the cloud (40 ms per token expected)
    streams to its end before the KV could arrive (the transfer would be sent for nothing)."""
    from relayinfer.device import split as split_mod
    from relayinfer.device.profiles import DeviceProfile
    from relayinfer.sdk.client import Client

    asked, real = [], split_mod.generate_message
    monkeypatch.setattr(split_mod, "generate_message", lambda *a, **kw: asked.append(kw["kv_from"]) or real(*a, **kw))
    c = Client(cloud_url=cloud.url, engine=onnx_engine, profile=DeviceProfile("test-slow", prefill_ms_per_token=40.0),
               link_bytes_per_s=1e9)
    c.cloud.tpot_ms = 40.0  # the cloud's TPOT as this client expects it (measured ones vary with load)
    long = c.complete(chat_prompt_ids[0], max_new_tokens=24)
    c.cloud.tpot_ms = 40.0  # KV at ~61 ms after the first token (1 ms of bytes, overhead, one prefill) > 40
    short = c.complete(chat_prompt_ids[0], max_new_tokens=2)
    assert asked == [0, None], asked
    assert long.fault is None and short.fault is None and long.kv_imported_tokens in (0, len(chat_prompt_ids[0]) - 1)
