"""KV hand-off: the cloud sends the prompt's KV (fp16 or int8 with per-token scales, the ONNX
past-KV layout) instead of the device prefilling it; the choice is made from the link bandwidth and
the device's prefill speed; greedy tokens equal those of the re-prefill path (fp16) or stay within a
measured log-probability gap of them (int8)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from relayinfer.protocol.kvhandoff import (crossover_bandwidth, kv_bytes_per_token, kv_handoff_pays, kv_layers,
                                           kv_messages, wire_bytes_per_token)
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


def test_int8_kv_wire_halves_the_bytes_and_is_off_by_at_most_half_a_scale():
    import msgspec

    rng = np.random.default_rng(1)
    # rows (one head's 64 values of one token) of very different magnitudes, and an all-zero row
    kv = (rng.standard_normal((30, 2, 3, 50, 64)) * rng.uniform(0.05, 20.0, (30, 2, 3, 50, 1))).astype(np.float16)
    kv[0, 0, 0, 3] = 0
    limit = 20 * kv_bytes_per_token(30, 3, 64) + 4096
    f16, i8 = kv_messages("r1", kv, 7, max_bytes=limit), kv_messages("r1", kv, 7, max_bytes=limit, wire="int8")
    assert [m.num_tokens for m in f16] == [20, 20, 10] and [m.num_tokens for m in i8] == [38, 12]
    assert wire_bytes_per_token(30, 3, 64, "int8") == 11880
    size = lambda ms: sum(len(encode(m)) for m in ms)  # noqa: E731
    assert size(i8) / size(f16) == pytest.approx(11880 / 23040, abs=0.01)
    start, layers = kv_layers([decode(encode(m)) for m in reversed(i8)])
    assert start == 7 and layers[0][0].dtype == np.float32
    scale = np.abs(kv.astype(np.float32)).max(axis=-1, keepdims=True) / 127
    err = np.stack([np.stack([k[0], v[0]]) for k, v in layers]) - kv.astype(np.float32)
    assert (np.abs(err) <= 0.51 * scale + 1e-9).all() and np.abs(err).max() > 0.3 * scale.max()
    assert not layers[0][0][0, 0, 3].any()
    with pytest.raises(ValueError, match="scale"):  # an int8 kv without its scale
        kv_layers([msgspec.structs.replace(m, scale=None) for m in i8])
    with pytest.raises(ValueError, match="scale"):  # a scale of another shape
        kv_layers([msgspec.structs.replace(m, scale=f16[0].kv) for m in i8])
    with pytest.raises(ValueError, match="kv_wire"):
        kv_messages("r1", kv, 7, wire="int4")


def test_int8_kv_keeps_the_device_answer_within_a_measured_gap(onnx_engine, tokenizer):
    """Real chitchat prompts of ~200 and ~400 tokens: the device's own KV of all prompt tokens but
    the last, sent through the wire formats and imported, then greedy decoding. float16: the same
    16 tokens as the device's own KV; int8: the log-probability of those tokens under the imported
    KV (teacher forced) within 0.05 nats/token of the device's own on average."""
    from relayinfer.sdk.datasets import chitchat_prompts_by_length

    def greedy_and_logprobs(last: int, kv, forced=None):
        toks, lps = [], []
        logits, kv = onnx_engine.prefill([last], kv)
        for i in range(MAX_NEW):
            lp = logits - np.logaddexp.reduce(logits.astype(np.float64))
            t = int(np.argmax(logits)) if forced is None else forced[i]
            toks.append(t), lps.append(float(lp[t]))
            logits, kv = onnx_engine.decode(t, kv)
        return toks, np.array(lps)

    gaps = []
    for ids in chitchat_prompts_by_length(tokenizer, [200, 400], per_length=2, seed=3):
        _, own = onnx_engine.prefill(ids[:-1])
        ref, ref_lp = greedy_and_logprobs(ids[-1], own)
        layers = onnx_engine.kv_export(own)
        arr = np.stack([np.stack([k[0], v[0]]) for k, v in layers])
        got = {}
        for wire in ("float16", "int8"):
            _, imported = kv_layers([decode(encode(m)) for m in kv_messages("r", arr, 0, wire=wire)])
            got[wire] = onnx_engine.kv_import(imported, len(ids) - 1)
        assert greedy_and_logprobs(ids[-1], got["float16"])[0] == ref
        _, lp = greedy_and_logprobs(ids[-1], got["int8"], forced=ref)
        gaps.append(float(np.mean(ref_lp - lp)))
    assert max(abs(g) for g in gaps) < 0.05, gaps


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


def test_int8_kv_hand_off_end_to_end_and_an_unknown_wire_is_refused(cloud, onnx_engine, torch_engine, chat_prompt_ids):
    """Through the cloud: a Client asking for the int8 wire imports the prompt's KV in it (the
    result says so) and finishes without a fault; a Generate naming another format gets a
    bad_request naming kv_wire, and the connection stays usable."""
    import asyncio

    from relayinfer.protocol.messages import Done, Error, Generate
    from relayinfer.protocol.transport import ws as proto_ws
    from relayinfer.sdk.client import Client

    ids = chat_prompt_ids[0]
    res = Client(cloud_url=cloud.url, engine=onnx_engine, cloud_budget=None, kv_handoff=True,
                 kv_wire="int8").complete(ids, max_new_tokens=MAX_NEW)
    assert res.fault is None and res.kv_wire == "int8" and len(res.token_ids) == MAX_NEW, res.error
    if res.device_prompt_tokens:  # the device ran (the cloud did not finish first)
        assert res.kv_imported_tokens == len(ids) - 1 and res.device_prompt_tokens == 1

    async def ask(kv_wire: str, rid: str, kv_from: int | None = 0, kv_rate: float | None = None):
        ch = await proto_ws.open_channel(cloud.url, torch_engine.fingerprint)
        try:
            await ch.send(Generate(rid, ids, 2, kv_from=kv_from, kv_rate=kv_rate, kv_wire=kv_wire))
            while True:
                m = await asyncio.wait_for(ch.recv(), 60)
                if isinstance(m, (Error, Done)):
                    return m
        finally:
            await ch.close()

    err = asyncio.run(ask("int4", "bad-wire"))
    assert isinstance(err, Error) and err.code == "bad_request" and "kv_wire" in err.message, err
    assert isinstance(asyncio.run(ask("int8", "good-wire")), Done)
    # without kv_from there is no hand-off for kv_wire / kv_rate to shape: refused by name, not ignored
    for field, kw in (("kv_wire", dict(kv_wire="int8")), ("kv_rate", dict(kv_wire="float16", kv_rate=1e6))):
        err = asyncio.run(ask(rid=f"no-from-{field}", kv_from=None, **kw))
        assert isinstance(err, Error) and err.code == "bad_request" and field in err.message, err
    with pytest.raises(ValueError, match="kv_wire"):
        Client(cloud_url=cloud.url, engine=onnx_engine, kv_wire="int4")
