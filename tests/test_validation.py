"""One check of every request value, at every door, by the shared rules of `protocol.validate`:
the OpenAI HTTP API (400, `param` = the field), the websocket `Generate` (Error BAD_REQUEST naming
the field), the SDK (`FieldError`, a ValueError naming the field), the relay's ranking instance
and the pathology service. OpenAI's signed 64-bit seed is accepted whole and mapped identically on
cloud and device. A stream that fails after its headers ends with an error event, a finish_reason
"error" chunk and [DONE]; a websocket request that fails leaves the device to finish alone."""
from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest
import requests

from relayinfer.cloud.engine.llm_engine import AsyncLLMEngine, LLMEngine
from relayinfer.cloud.serve.service import CloudService, ServiceThread
from relayinfer.protocol.transport import ws as proto_ws
from relayinfer.protocol.model.decoding import SamplingParams, sample, seed_key
from relayinfer.protocol.errors import ErrorCode
from relayinfer.protocol.messages import Cancel, Done, Error, ExtendBudget, Generate, Stop, Token
from relayinfer.protocol.validate import SEED_MAX, SEED_MIN, FieldError

MODEL = "smollm2-135m-instruct"
HI = [{"role": "user", "content": "Hi"}]
VOCAB = 49152
INF, NAN = float("inf"), float("nan")


def _slow():
    from relayinfer.device.profiles import DeviceProfile

    return DeviceProfile("test-slow", prefill_ms_per_token=100.0)  # the cloud's first tokens come first


SLOW = _slow()

# --- the rule table, through SamplingParams (every door builds one) ------------------------------

BAD_PARAMS = [
    ("seed", 2 ** 63), ("seed", -2 ** 63 - 1), ("seed", 1.5), ("seed", True), ("seed", "7"),
    ("temperature", INF), ("temperature", NAN), ("temperature", -0.1), ("temperature", 2.5), ("temperature", "1"),
    ("top_p", 1.5), ("top_p", -0.1), ("top_p", NAN), ("top_k", -2), ("top_k", 2 ** 63), ("top_k", True),
    ("top_k", 2.5), ("max_new_tokens", 0), ("max_new_tokens", True), ("max_new_tokens", 2 ** 63),
    ("max_new_tokens", 2.5), ("presence_penalty", 2.5), ("frequency_penalty", -INF), ("repetition_penalty", 0),
    ("repetition_penalty", NAN), ("min_tokens", -1), ("logprobs", 21), ("logprobs", -1),
]


@pytest.mark.parametrize("field,value", BAD_PARAMS)
def test_sampling_params_refuse_naming_the_field(field, value):
    with pytest.raises(FieldError) as e:
        SamplingParams(**{field: value})
    assert e.value.field == field and str(e.value).startswith(f"{field} must be ")
    assert "got" in str(e.value)


@pytest.mark.parametrize("kw,field", [
    (dict(min_tokens=5, max_new_tokens=4), "min_tokens"), (dict(stop_ids=(-1,)), "stop_ids[0]"),
    (dict(stop_ids=tuple(range(65))), "stop_ids"), (dict(stop_ids=(True,)), "stop_ids[0]"),
    (dict(logit_bias=((1, 101.0),)), "logit_bias[1]"), (dict(logit_bias=((1, NAN),)), "logit_bias[1]"),
    (dict(logit_bias=((-1, 1.0),)), "logit_bias[-1]"), (dict(logit_bias=tuple((i, 1.0) for i in range(301))),
                                                         "logit_bias")])
def test_sampling_params_lists_and_pairs(kw, field):
    with pytest.raises(FieldError) as e:
        SamplingParams(**kw)
    assert e.value.field == field


def test_sampling_params_boundaries_accepted_and_normalised():
    p = SamplingParams(temperature=2, top_p=0, top_k=-1, seed=SEED_MIN, max_new_tokens=4.0, min_tokens=4,
                       presence_penalty=-2, frequency_penalty=2, repetition_penalty=2, logprobs=20,
                       logit_bias=((0, -100), (5, 100)), stop_ids=(0,))
    assert (p.top_k, p.max_new_tokens, type(p.max_new_tokens), p.seed) == (0, 4, int, SEED_MIN)
    assert SamplingParams(seed=SEED_MAX, top_k=2 ** 20).seed == SEED_MAX


def test_seed_key_maps_signed_64_bit_seeds_to_their_unsigned_bits():
    assert [seed_key(s) for s in (0, 7, SEED_MAX, -1, SEED_MIN)] == [0, 7, SEED_MAX, 2 ** 64 - 1, 2 ** 63]
    logits = np.random.default_rng(0).standard_normal(VOCAB).astype(np.float32)
    draws = {s: [sample(logits, SamplingParams(temperature=1.0, seed=s), i) for i in range(8)]
             for s in (-1, SEED_MIN, SEED_MAX, 2 ** 64 - 1 - 2 ** 64)}
    assert draws[-1] == [sample(logits, SamplingParams(temperature=1.0, seed=-1), i) for i in range(8)]
    assert draws[-1] != draws[SEED_MAX] and draws[SEED_MIN] != draws[SEED_MAX]


# --- the HTTP API (one batching service, its HTTP side) ------------------------------------------

@pytest.fixture(scope="module")
def service(torch_engine):
    llm = AsyncLLMEngine(LLMEngine(torch_engine, kv_cache_bytes=16 << 20))
    svc = CloudService(torch_engine, torch_engine.fingerprint, llm=llm, model_name=MODEL)
    with ServiceThread(svc) as running:
        yield running


@pytest.fixture(scope="module")
def base(service):
    return f"http://127.0.0.1:{service.http_port}"


def chat(base, **body) -> requests.Response:
    return requests.post(base + "/v1/chat/completions", json={"model": MODEL, "messages": HI, **body}, timeout=120)


def comp(base, **body) -> requests.Response:
    return requests.post(base + "/v1/completions", json={"model": MODEL, **body}, timeout=120)


BAD_HTTP = [  # body (besides model, messages, max_tokens=2), the field named
    ({"seed": 2 ** 64}, "seed"), ({"seed": 2 ** 63}, "seed"), ({"seed": -2 ** 63 - 1}, "seed"),
    ({"seed": True}, "seed"), ({"seed": "1"}, "seed"), ({"seed": 1.5}, "seed"),
    ({"temperature": "0.5"}, "temperature"), ({"temperature": True}, "temperature"),
    ({"top_k": True}, "top_k"), ({"top_k": 2 ** 63}, "top_k"), ({"top_k": -2}, "top_k"),
    ({"n": True}, "n"), ({"n": 1.5}, "n"), ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 2 ** 63}, "max_tokens"), ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"min_tokens": 3}, "min_tokens"), ({"min_tokens": True}, "min_tokens"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"presence_penalty": "1"}, "presence_penalty"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids[0]"), ({"stop_token_ids": [True]}, "stop_token_ids[0]"),
    ({"stop_token_ids": [2 ** 63]}, "stop_token_ids[0]"), ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
    ({"logit_bias": {str(VOCAB): 1}}, "logit_bias"), ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"5": True}}, "logit_bias"), ({"logit_bias": {"5": "1"}}, "logit_bias"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": True}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"logprobs": 1}, "logprobs"),
    ({"stream": "yes"}, "stream"), ({"ignore_eos": 1}, "ignore_eos"), ({"stop": 5}, "stop"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": [1]}, "logit_bias"),
    # token-id keys in decimal only: int() would take each of these (two of them as a second 5)
    ({"logit_bias": {"+5": 1}}, "logit_bias"), ({"logit_bias": {" 5": 1}}, "logit_bias"),
    ({"logit_bias": {"1_000": 1}}, "logit_bias"), ({"logit_bias": {"5": 1, "05": 1}}, "logit_bias"),
    ({"logit_bias": {"\u0665": 1}}, "logit_bias"),
    # an option accepted must work; ignored fields only of their OpenAI type
    ({"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"), ({"stream": True, "stream_options": {"x": 1}}, "stream_options.x"),
    ({"user": 5}, "user"), ({"metadata": "x"}, "metadata"), ({"store": "yes"}, "store"),
    ({"service_tier": 7}, "service_tier"), ({"parallel_tool_calls": "x"}, "parallel_tool_calls"),
    ({"model": 5}, "model"), ({"model": ["m"]}, "model"),
    ({"messages": [{"role": "user", "content": "Hi", "name": 5}]}, "messages[0].name"),
    ({"max_tokens": None, "min_tokens": 10 ** 6}, "min_tokens"),
]


@pytest.mark.parametrize("body,param", BAD_HTTP)
def test_http_bad_values_get_400_naming_the_field(base, body, param):
    r = chat(base, **{"max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    e = r.json()["error"]
    assert e["param"] == param and e["type"] == "invalid_request_error", e
    assert e["message"].startswith(f"{param} must be ") and ", got " in e["message"], e  # the one format


@pytest.mark.parametrize("body,param", [
    ({"prompt": [VOCAB]}, "prompt[0]"), ({"prompt": [1, -1]}, "prompt[1]"), ({"prompt": [[1], [2, VOCAB]]}, "prompt[1][1]"),
    ({"prompt": "Hi", "logprobs": 21}, "logprobs"), ({"prompt": "Hi", "logprobs": True}, "logprobs"),
    ({"prompt": "Hi", "best_of": 0}, "best_of"), ({"prompt": "Hi", "seed": 2 ** 64}, "seed"),
    ({"prompt": "Hi", "echo": 1}, "echo")])
def test_completions_bad_values_get_400_naming_the_field(base, body, param):
    r = comp(base, **{"max_tokens": 2, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert r.json()["error"]["message"].startswith(f"{param} must be "), r.text


@pytest.mark.parametrize("prompt,param", [(["Hi", " "], "prompt[1]"), ([""], "prompt"), (["", "Hi"], "prompt[0]")])
def test_an_empty_prompt_of_a_batch_is_named_by_its_index(base, prompt, param):
    r = comp(base, prompt=prompt, max_tokens=2)
    assert r.status_code == 400, r.text
    e = r.json()["error"]
    assert e["param"] == param and e["message"].startswith(f"{param} is empty"), e


def test_http_signed_seeds_accepted_and_reproducible(base, service):
    answers = {}
    for seed in (-1, SEED_MAX, SEED_MIN, 7):
        r = chat(base, max_tokens=6, temperature=0.7, seed=seed)
        assert r.status_code == 200, r.text
        answers[seed] = r.json()["choices"][0]["message"]["content"]
        again = chat(base, max_tokens=6, temperature=0.7, seed=seed).json()["choices"][0]["message"]["content"]
        assert again == answers[seed]
    n2 = chat(base, max_tokens=6, temperature=0.7, seed=-1, n=2)  # derived seeds of the other choices too
    assert n2.status_code == 200 and n2.json()["choices"][0]["message"]["content"] == answers[-1], n2.text
    assert service.health() is None and requests.get(base + "/healthz", timeout=30).json()["status"] == "ok"
    # boundary values of the other fields are served
    ok = chat(base, max_tokens=2, min_tokens=2, temperature=2, top_p=1, top_k=-1, presence_penalty=-2,
              frequency_penalty=2, repetition_penalty=2, logit_bias={"0": -100, str(VOCAB - 1): 100},
              stop_token_ids=[VOCAB - 1], logprobs=True, top_logprobs=20, n=2.0)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4, ok.text
    assert comp(base, prompt=[0, VOCAB - 1], max_tokens=1, temperature=0).status_code == 200


# --- the websocket Generate ----------------------------------------------------------------------

BAD_GENERATE = [  # Generate fields (prompt [1, 2, 3], max_new_tokens 4 unless given), the field named
    (dict(seed=2 ** 63), "seed"), (dict(seed=2 ** 64 - 1), "seed"), (dict(temperature=INF), "temperature"),
    (dict(temperature=NAN), "temperature"), (dict(top_p=NAN), "top_p"), (dict(top_k=2 ** 40), "top_k"),
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(max_new_tokens=2 ** 62), "max_new_tokens"),
    (dict(min_tokens=9), "min_tokens"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=INF), "presence_penalty"), (dict(stop_ids=[VOCAB]), "stop_ids[0]"),
    (dict(stop_ids=[-5]), "stop_ids[0]"), (dict(prompt_ids=[1, VOCAB]), "prompt_ids[1]"),
    (dict(prompt_ids=[-1]), "prompt_ids[0]"), (dict(prompt_ids=[]), "prompt_ids"),
    (dict(cloud_budget=-1), "cloud_budget"), (dict(refine=NAN), "refine"), (dict(kv_from=3), "kv_from"),
]


def _ws(service, script):
    async def main():
        ch = await proto_ws.open_channel(service.url, service.fingerprint, client="test")
        try:
            return await script(ch)
        finally:
            await ch.close()
    return asyncio.run(asyncio.wait_for(main(), 120))


def test_websocket_generate_bad_values_get_bad_request_naming_the_field(service):
    async def script(ch):
        got = []
        for i, (kw, _) in enumerate(BAD_GENERATE):
            fields = {"prompt_ids": [1, 2, 3], "max_new_tokens": 4, **kw}
            await ch.send(Generate(f"bad{i}", **fields))
            got.append(await asyncio.wait_for(ch.recv(), 60))
        await ch.send(Generate("ok", [1, 2, 3], 3, temperature=0.7, seed=-1))  # the session still serves
        toks = []
        while not isinstance(m := await asyncio.wait_for(ch.recv(), 60), (Done, Error)):
            toks.append(m)
        return got, toks, m
    got, toks, end = _ws(service, script)
    for (kw, field), e in zip(BAD_GENERATE, got):
        assert isinstance(e, Error) and e.code == ErrorCode.BAD_REQUEST.value, (kw, e)
        assert e.message.startswith(f"{field} must be "), (kw, e.message)
    assert isinstance(end, Done) and len(toks) == end.cloud_tokens == 3 and all(isinstance(t, Token) for t in toks)
    assert service.health() is None


# --- the SDK --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,field", [
    (dict(seed=2 ** 63), "seed"), (dict(temperature=INF), "temperature"), (dict(max_new_tokens=True), "max_new_tokens"),
    (dict(top_k="5"), "top_k"), (dict(stop_ids=[VOCAB]), "stop_ids[0]"), (dict(cloud_budget=-1), "cloud_budget"),
    (dict(target_tpot_ms=NAN), "target_tpot_ms"), (dict(temprature=0.5), "temprature")])
def test_sdk_generate_raises_naming_the_field(onnx_engine, kw, field):
    from relayinfer.sdk import Client

    c = Client(engine=onnx_engine, mode="device-only")
    with pytest.raises(FieldError) as e:
        c.generate("Hi", **kw)
    assert e.value.field == field
    with pytest.raises(FieldError) as e:
        c.generate([1, VOCAB], max_new_tokens=2)
    assert e.value.field == "prompt[1]"


def test_seed_minus_one_split_answer_equals_device_only(service, torch_engine, onnx_engine, tokenizer):
    """Cloud and device map the signed seed identically: a seeded answer handed off after the
    cloud's first tokens equals the device's own and the cloud engine's, on the batched and the
    per-request path."""
    from relayinfer.sdk import Client

    prompt = tokenizer.encode_chat("Tell me a story about the sea.")
    kw = dict(max_new_tokens=10, temperature=0.9, seed=-1)
    ref = torch_engine.generate(prompt, SamplingParams(**kw)).token_ids
    assert Client(engine=onnx_engine, mode="device-only").complete(prompt, **kw).token_ids == ref
    with ServiceThread(CloudService(torch_engine, torch_engine.fingerprint), http_port=None) as per_request:
        for svc in (service, per_request):
            c = Client(cloud_url=svc.url, engine=onnx_engine, profile=SLOW, target_tpot_ms=30.0, cloud_budget=4)
            split = c.complete(prompt, **kw)
            assert split.fault is None and split.mode == "split", (svc.llm, split.fault, split.error)
            assert 0 < split.handoff_index < len(split.token_ids) and split.token_ids == ref, svc.llm



def test_logit_bias_reaches_the_cloud_of_a_split_answer(service, torch_engine, onnx_engine, tokenizer):
    """A logit_bias that bans the greedy answer's first two tokens changes the answer; the split
    answer (cloud tokens first, then the device's) equals the device-only one and the cloud engine's,
    so the cloud sampled with the same bias. logprobs, which the SDK does not return, is refused."""
    from relayinfer.sdk import Client

    prompt = tokenizer.encode_chat("Tell me a story about the sea.")
    plain = torch_engine.generate(prompt, SamplingParams(max_new_tokens=10)).token_ids
    kw = dict(max_new_tokens=10, logit_bias=((plain[0], -100.0), (plain[1], -100.0)))
    ref = torch_engine.generate(prompt, SamplingParams(**kw)).token_ids
    assert ref[0] != plain[0]
    assert Client(engine=onnx_engine, mode="device-only").complete(prompt, **kw).token_ids == ref
    c = Client(cloud_url=service.url, engine=onnx_engine, profile=SLOW, target_tpot_ms=30.0, cloud_budget=4)
    split = c.complete(prompt, **kw)
    assert split.fault is None and split.mode == "split" and split.cloud_tokens >= 1, (split.fault, split.error)
    assert split.token_ids == ref
    with pytest.raises(FieldError) as e:
        c.complete(prompt, max_new_tokens=4, logprobs=2)
    assert e.value.field == "logprobs"

# --- the relay's ranking instance and the pathology service --------------------------------------

@pytest.fixture(scope="module")
def ranking(data):
    import torch

    from relayinfer.cloud.models.hstu import HSTU, HSTUConfig
    from relayinfer.cloud.relay.instance import InstanceConfig, RankingInstance
    from relayinfer.cloud.relay.latency import LatencyModel

    torch.manual_seed(0)
    lat = LatencyModel(full=[], prefix=[-1.0, 0.1, 0.0], cached=[1.0, 0.0, 0.0])
    return RankingInstance(HSTU(HSTUConfig(num_items=data.num_items)).eval(), lat, InstanceConfig())


@pytest.mark.parametrize("change,field", [
    (dict(ts=[2 ** 63, 5]), "timestamps[0]"), (dict(ts=[-1, 5]), "timestamps[0]"), (dict(ts=[1, 2 ** 41]), "timestamps[1]"),
    (dict(items=[2 ** 64 - 1, 2]), "item_ids[0]"), (dict(cands=[2 ** 63]), "candidate_ids[0]"),
    (dict(user=2 ** 63), "user_id"), (dict(request_ts=-5), "request_ts")])
def test_relay_rank_bad_values_named(ranking, change, field):
    args = {"user": 1, "items": [1, 2], "ts": [100, 200], "cands": [3, 4], "request_ts": None, **change}
    with pytest.raises(FieldError) as e:
        ranking.rank(args["user"], args["items"], args["ts"], args["cands"], args["request_ts"])
    assert e.value.field == field
    s, _ = ranking.rank(1, [1, 2], [100, 200], [3, 4], 300)  # still serving
    assert s.shape == (2,) and np.isfinite(s).all()


def test_patho_bad_values_get_bad_request_naming_the_field():
    from relayinfer.cloud.patho.encoder import ViTEncoder
    from relayinfer.cloud.patho.service import PathoService, PathoServiceThread, SlideScreener
    from relayinfer.cloud.patho.vit import VIT_TINY_TEST
    from relayinfer.protocol.messages import Embeddings, Tensor, TileBatch

    feats = np.zeros((2, 1280), np.float32)
    nan = feats.copy()
    nan[1, 3] = np.nan
    empty = Tensor.from_numpy(np.zeros((0, 224, 224, 3), np.uint8))
    cases = [  # TileBatch fields, the field named
        (dict(coords=[[0, 0], [-1, 5]], features=Tensor.from_numpy(feats)), "coords[1][0]"),
        (dict(coords=[[0, 0], [2 ** 63, 5]], features=Tensor.from_numpy(feats)), "coords[1][0]"),
        (dict(coords=[[0, 0], [1, 1]], features=Tensor.from_numpy(nan)), "features"),
        (dict(coords=[[0, 0], [1, 1]], features=Tensor.from_numpy(feats), device_scores=[0.5]), "device_scores"),
        (dict(coords=[[0, 0], [1, 1]], features=Tensor.from_numpy(feats), device_scores=[0.5, math.inf]),
         "device_scores[1]"),
        (dict(coords=[[0, 0], [1, 1]], features=Tensor.from_numpy(feats), slide_id="s" * 300), "slide_id"),
    ]
    svc = PathoService(SlideScreener(ViTEncoder(cfg=VIT_TINY_TEST, seed=0)))

    async def main(url, fp):
        ch = await proto_ws.open_channel(url, fp, client="test")
        try:
            out = []
            for i, (kw, _) in enumerate(cases):
                await ch.send(TileBatch(**{"request_id": f"r{i}", "slide_id": "s", "tiles": empty, **kw}))
                out.append(await asyncio.wait_for(ch.recv(), 60))
            await ch.send(TileBatch("ok", "s", [[0, 0], [1, 1]], empty, features=Tensor.from_numpy(feats),
                                    device_scores=[0.0, 1.0], last=True))
            out.append(await asyncio.wait_for(ch.recv(), 60))
            return out
        finally:
            await ch.close()
    with PathoServiceThread(svc) as running:
        got = asyncio.run(asyncio.wait_for(main(running.url, running.fingerprint), 120))
    for (kw, field), e in zip(cases, got):
        assert isinstance(e, Error) and e.code == ErrorCode.BAD_REQUEST.value and e.message.startswith(
            f"{field} must be "), (field, e)
    assert isinstance(got[-1], Embeddings) and 0 <= got[-1].slide_score <= 1


# --- streams that fail end with what happened ------------------------------------------------------

class FailingEngine:
    """An `AsyncLLMEngine` whose requests fail after `after` tokens (RuntimeError), as an engine
    fault mid-stream does; everything else is the real engine's."""

    def __init__(self, engine: AsyncLLMEngine, after: int):
        self._engine, self.after = engine, after

    def __getattr__(self, name):
        return getattr(self._engine, name)

    async def generate(self, request_id, prompt_ids, params, *args, **kw):
        gen = self._engine.generate(request_id, prompt_ids, params, *args, **kw)
        try:
            n = 0
            async for out in gen:
                if n == self.after:
                    raise RuntimeError("injected engine fault")
                n += 1
                yield out
        finally:
            await gen.aclose()


def test_openai_stream_that_fails_ends_with_error_event_finish_reason_and_done(torch_engine, tokenizer):
    openai = pytest.importorskip("openai")
    from aiohttp import web

    from relayinfer.cloud.serve.openai.api_server import make_app

    async def main():
        real = AsyncLLMEngine(LLMEngine(torch_engine, kv_cache_bytes=16 << 20))
        runner = web.AppRunner(make_app(FailingEngine(real, after=3), tokenizer, MODEL), handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        base = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1"
        client = openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0, timeout=60)
        res = {"chunks": []}
        try:
            stream = await client.chat.completions.create(model=MODEL, messages=HI, temperature=0, max_tokens=12,
                                                          stream=True, n=2)
            with pytest.raises(openai.APIError) as e:
                async for chunk in stream:
                    res["chunks"].append(chunk)
            res["error"] = e.value
            import aiohttp
            async with aiohttp.ClientSession() as s:
                async with s.post(f"{base}/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 12,
                                                               "temperature": 0, "stream": True,
                                                               "stream_options": {"include_usage": True}}) as r:
                    res["raw"] = (r.status, await r.text())
        finally:
            await client.close()
            await runner.cleanup()
        res["used_blocks"] = real.engine.block_manager.num_used_blocks
        return res

    res = asyncio.run(asyncio.wait_for(main(), 300))
    assert "injected engine fault" in res["error"].message and res["chunks"]  # some tokens came first
    status, text = res["raw"]
    events = [x[len("data: "):] for x in text.split("\n\n") if x]
    assert status == 200 and events[-1] == "[DONE]", events
    err = next(i for i, x in enumerate(events) if x.startswith('{"error"'))
    body = json.loads(events[err])["error"]
    assert body["type"] == "server_error" and body["code"] == 500 and "injected engine fault" in body["message"]
    finals = [json.loads(x) for x in events[err + 1:-1]]
    assert [c["choices"][0]["finish_reason"] for c in finals[:-1]] == ["error"]
    assert finals[-1]["choices"] == [] and finals[-1]["usage"]["completion_tokens"] == 3  # usage up to the fault
    assert sum(len(json.loads(x)["choices"][0]["text"]) > 0 for x in events[:err]) >= 1
    assert res["used_blocks"] == 0  # the failed requests freed their KV blocks


def test_websocket_request_that_fails_leaves_the_device_to_finish_alone(torch_engine, onnx_engine):
    """The split service's per-request path fails at its second decode step: the device gets an
    Error for the request and finishes the answer itself, equal to its own greedy answer."""
    from relayinfer.sdk import Client

    class Failing:
        def __init__(self, engine):
            self._e, self.calls = engine, 0

        def __getattr__(self, name):
            return getattr(self._e, name)

        def decode(self, tok, kv):
            self.calls += 1
            if self.calls >= 2:
                raise RuntimeError("injected decode fault")
            return self._e.decode(tok, kv)

    svc = CloudService(Failing(torch_engine), torch_engine.fingerprint)
    with ServiceThread(svc, http_port=None) as running:
        alone = Client(engine=onnx_engine, mode="device-only").complete("Hi there!", max_new_tokens=8)
        split = Client(cloud_url=running.url, engine=onnx_engine, profile=SLOW, cloud_budget=None).complete(
            "Hi there!", max_new_tokens=8)
    assert split.fault == "cloud-error" and "internal error" in (split.error or ""), (split.fault, split.error)
    assert split.token_ids == alone.token_ids and split.cloud_tokens >= 1


# --- the P/D gateway's doors (HTTP, websocket and its Python engine) -----------------------------

def test_pd_doors_refuse_naming_the_field_and_serve_signed_seeds(torch_engine):
    from relayinfer.cloud.pd.service import PDEngine, PDService
    from test_pd import gateway

    blocks = (16 << 20) // (16 * 46080)
    llm = PDEngine(gateway(torch_engine, n_prefill=1, n_decode=1), torch_engine.cfg,
                   min(torch_engine.context_length, blocks * 16), blocks, model=torch_engine.model)
    with ServiceThread(PDService(torch_engine, torch_engine.fingerprint, llm=llm, model_name=MODEL)) as svc:
        url = f"http://127.0.0.1:{svc.http_port}"
        for body, param in [({"seed": 2 ** 64}, "seed"), ({"temperature": "1"}, "temperature"),
                            ({"top_k": True}, "top_k"), ({"stop_token_ids": [VOCAB]}, "stop_token_ids[0]")]:
            r = chat(url, max_tokens=2, **body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        seeded = [chat(url, max_tokens=4, temperature=0.7, seed=s) for s in (-1, -1, SEED_MIN)]
        assert all(r.status_code == 200 for r in seeded), [r.text for r in seeded]
        assert seeded[0].json()["choices"][0]["message"]["content"] == seeded[1].json()["choices"][0]["message"]["content"]

        async def script(ch):
            await ch.send(Generate("bad", [1, VOCAB], 4))
            return await asyncio.wait_for(ch.recv(), 60)
        e = _ws(svc, script)
        assert isinstance(e, Error) and e.code == ErrorCode.BAD_REQUEST.value and e.message.startswith("prompt_ids[1] must be ")

        async def direct():
            return [o async for o in llm.generate("direct", [1, VOCAB], SamplingParams(max_new_tokens=2))]
        with pytest.raises(FieldError, match=r"^prompt_ids\[1\] must be "):
            asyncio.run(direct())  # refused before the gateway (in the service's loop) is reached
        assert svc.health() is None


# --- requests that race their own control messages, values at the edge of a field's range --------
# A Stop or Cancel right behind its Generate, an id reused right after its Done, `kv_from` at the last
# prompt token, a chat role that is no string, an integer beyond any float: each ends in a named
# result (Done, or BAD_REQUEST / 400), never INTERNAL or 500, and the service serves on.

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


@pytest.mark.parametrize("kv_from", [None, 1], ids=["batched", "per-request"])
def test_the_token_that_ends_the_answer_carries_the_finish_reason(service, tokenizer, kv_from):
    """The cloud's last token names the end as the sampler decided it, and only that token does:
    'length' at max_tokens, 'eos' on EOS (a chat prompt answered to its end), on both cloud paths."""
    chat = tokenizer.encode_chat([{"role": "user", "content": "Say hi."}])

    async def script(ch):
        out = []
        for rid, prompt, n in (("len", chat, 3), ("eos", chat, 200)):
            await ch.send(Generate(rid, prompt, n, kv_from=kv_from))
            toks, end = await _until_end(ch, rid)
            out.append(([t for t in toks if isinstance(t, Token)], end))  # KVTransfer frames aside
        return out

    (toks_len, done_len), (toks_eos, done_eos) = _ws(service, script)
    assert isinstance(done_len, Done) and done_len.reason == "length" and len(toks_len) == 3
    assert [t.finish_reason for t in toks_len] == [None, None, "length"]
    assert isinstance(done_eos, Done) and done_eos.reason == "eos", done_eos
    assert toks_eos[-1].token_id == tokenizer.eos_id and toks_eos[-1].finish_reason == "eos"
    assert all(t.finish_reason is None for t in toks_eos[:-1])


# --- values inside their range whose arithmetic overflows, repeats, control messages ---------------
# A temperature of 1e-310 or a repetition_penalty of 1e-310 is inside its range, but logits / 1e-310
# overflow to inf and inf - inf is NaN: the draw then returned token 0 whatever the model said.

def test_sampler_limits_of_overflowing_logits():
    logits = np.random.default_rng(1).standard_normal(VOCAB).astype(np.float32)
    greedy = int(np.argmax(logits))
    assert all(sample(logits, SamplingParams(temperature=t, seed=3), 0) == greedy for t in (5e-324, 1e-310, 9e-6))
    ctx = [7, 11, 13]
    logits[ctx] = [3.0, 2.0, -1.0]  # the seen positive ones go to +inf under r = 1e-310, the negative one to ~0
    p = SamplingParams(temperature=1.0, repetition_penalty=1e-310, seed=5)
    assert {sample(logits, p, i, ctx, len(ctx)) for i in range(40)} == {7, 11}  # uniform over the +inf logits
    bad = logits.copy()
    bad[100] = np.nan
    with pytest.raises(FloatingPointError, match="NaN"):
        sample(bad, SamplingParams(temperature=0.7, seed=1), 0)


@pytest.mark.parametrize("kv_from", [None, 1], ids=["batched", "per-request"])
def test_overflowing_sampling_values_are_served_as_their_limit(service, tokenizer, kv_from):
    """On both cloud paths: temperature 1e-310 is the greedy answer; repetition_penalty 1e-310 at
    temperature 1 draws only tokens already in the context (their positive logits went to +inf)."""
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Tell me a story about the sea."}])

    async def script(ch):
        out = []
        for rid, kw in (("greedy", {}), ("tiny-t", dict(temperature=1e-310, seed=1)),
                        ("tiny-r", dict(temperature=1.0, repetition_penalty=1e-310, seed=2))):
            await ch.send(Generate(rid, prompt, 6, kv_from=kv_from, **kw))
            toks, end = await _until_end(ch, rid)
            assert isinstance(end, Done), end
            out.append([t.token_id for t in toks if isinstance(t, Token)])
        return out

    greedy, tiny_t, tiny_r = _ws(service, script)
    assert tiny_t == greedy and len(greedy) == 6
    seen = set(prompt)
    for t in tiny_r:
        assert t in seen, (t, tiny_r)
        seen.add(t)
    http = chat(f"http://127.0.0.1:{service.http_port}", max_tokens=4, temperature=1e-310, seed=9)
    zero = chat(f"http://127.0.0.1:{service.http_port}", max_tokens=4, temperature=0)
    assert http.status_code == 200 and http.json()["choices"][0]["message"] == zero.json()["choices"][0]["message"]


def test_a_logit_bias_token_given_twice_is_refused(service):
    """Biases of one token would add up past [-100, 100]: the second entry is refused by name."""
    async def script(ch):
        await ch.send(Generate("b", [1, 2, 3], 3, temperature=1.0, logit_bias=[(5, 100.0), (5, 100.0)]))
        return await _until_end(ch, "b")
    toks, end = _ws(service, script)
    assert toks == [] and isinstance(end, Error) and end.code == ErrorCode.BAD_REQUEST.value, end
    assert end.message.startswith("logit_bias[5] must be given once per token id"), end.message
    with pytest.raises(FieldError) as e:
        SamplingParams(logit_bias=((5, 1.0), (6, 1.0), (5, -1.0)))
    assert e.value.field == "logit_bias[5]"


@pytest.mark.parametrize("kv_from", [None, 1], ids=["batched", "per-request"])
@pytest.mark.parametrize("control,field", [(ExtendBudget("c", -1), "cloud_budget"),
                                           (ExtendBudget("c", 2 ** 63 - 1), "cloud_budget"),
                                           (Stop("c", -1), "handoff_index"), (Stop("c", 2 ** 63), "handoff_index")])
def test_a_bad_control_message_ends_its_request_with_the_error_last(service, control, field, kv_from):
    """A Stop / ExtendBudget with a value outside its rule ends its live request: the tokens already
    produced, then one Error naming the field, nothing after it for that id (a request-level Error
    ends the request at the device too); its KV is freed and the id serves again."""
    async def script(ch):
        await ch.send(Generate("c", [1, 2, 3, 4, 5], 200, cloud_budget=200, kv_from=kv_from))
        first = await asyncio.wait_for(ch.recv(), 60)
        await ch.send(control)
        toks, end = await _until_end(ch, "c")
        await ch.send(Generate("tail", [1, 2], 1))  # anything later for "c" would arrive before tail's end
        late = []
        while not (isinstance(m := await asyncio.wait_for(ch.recv(), 60), (Done, Error)) and m.request_id == "tail"):
            late.append(m)
        await ch.send(Generate("c", [1, 2, 3], 2))
        return first, toks, end, late, await _until_end(ch, "c")

    first, toks, end, late, again = _ws(service, script)
    assert isinstance(first, Token) and len(toks) < 199
    assert [m for m in late if m.request_id == "c"] == []
    assert isinstance(end, Error) and end.code == ErrorCode.BAD_REQUEST.value, end
    assert end.message.startswith(f"{field} must be an integer in [0, 1048576]"), end.message
    assert isinstance(again[1], Done) and again[1].cloud_tokens == 2
    assert service.llm.engine.block_manager.num_used_blocks == 0 and service.health() is None


def test_an_empty_request_id_is_refused_naming_it(service):
    async def script(ch):
        await ch.send(Generate("", [1, 2, 3], 2))
        return await asyncio.wait_for(ch.recv(), 60)
    e = _ws(service, script)
    assert isinstance(e, Error) and e.code == ErrorCode.BAD_REQUEST.value
    assert e.message.startswith("request_id must be a string of 1..64 characters"), e.message
