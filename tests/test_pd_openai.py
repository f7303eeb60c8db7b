"""The OpenAI API on `pd serve` answers like `cloud serve`: one request per request field (every
field the API reads, `protocol._FIELDS`), sent to both; the P/D answer equals the single engine's
(text, finish reasons, logprobs, usage) or is a 400 naming that field. And the P/D histograms use
the cloud's bucket layout."""
from __future__ import annotations

import json

import pytest
import requests

from relayinfer.cloud.serve.openai import protocol

MODEL = "smollm2-135m-instruct"
KV = 16 << 20
HI = [{"role": "user", "content": "Tell me about cats."}]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}

# field -> (endpoint, the body's fields besides the base ones); every field the API reads has one
CASES = {
    "model": ("chat", {"model": MODEL}),
    "messages": ("chat", {}),
    "prompt": ("comp", {}),
    "max_tokens": ("chat", {"max_tokens": 3}),
    "max_completion_tokens": ("chat", {"max_completion_tokens": 4}),
    "temperature": ("chat", {"temperature": 0.8, "seed": 7}),
    "top_p": ("chat", {"temperature": 0.9, "top_p": 0.5, "seed": 7}),
    "top_k": ("chat", {"temperature": 0.9, "top_k": 5, "seed": 7}),
    "seed": ("chat", {"temperature": 0.7, "seed": 123}),
    "n": ("chat", {"n": 2, "temperature": 0.5, "seed": 5}),
    "best_of": ("comp", {"n": 2, "best_of": 2, "temperature": 0.5, "seed": 5}),
    "stop": ("chat", {"stop": [" a", "."], "max_tokens": 12}),
    "stop_token_ids": ("chat", {"stop_token_ids": [30], "max_tokens": 12}),
    "stream": ("chat", {"stream": True}),
    "stream_options": ("chat", {"stream": True, "stream_options": {"include_usage": True}}),
    "presence_penalty": ("chat", {"presence_penalty": 1.5, "max_tokens": 12}),
    "frequency_penalty": ("chat", {"frequency_penalty": 1.5, "max_tokens": 12}),
    "repetition_penalty": ("chat", {"repetition_penalty": 1.3, "max_tokens": 12}),
    "min_tokens": ("chat", {"min_tokens": 5, "max_tokens": 5, "stop_token_ids": [2]}),
    "logit_bias": ("chat", {"logit_bias": {"42": 100}}),
    "logprobs": ("comp", {"logprobs": 2}),
    "top_logprobs": ("chat", {"logprobs": True, "top_logprobs": 3}),
    "echo": ("comp", {"echo": True, "logprobs": 1}),
    "ignore_eos": ("chat", {"ignore_eos": True}),
    "tools": ("chat", {"tools": [TOOL]}),
    "tool_choice": ("chat", {"tools": [TOOL], "tool_choice": "required", "max_tokens": 24}),
    "parallel_tool_calls": ("chat", {"tools": [TOOL], "parallel_tool_calls": False}),
    "functions": ("chat", {"functions": [TOOL["function"]]}),
    "function_call": ("chat", {"function_call": "auto"}),
    "response_format": ("chat", {"response_format": {"type": "json_object"}, "max_tokens": 12}),
    "guided_json": ("chat", {"guided_json": {"type": "object"}, "max_tokens": 12}),
    "guided_regex": ("chat", {"guided_regex": "[0-9]{3}"}),
    "guided_choice": ("chat", {"guided_choice": ["yes", "no"]}),
    "guided_grammar": ("chat", {"guided_grammar": 'start: "yes" | "no"'}),
    "structured_outputs": ("chat", {"structured_outputs": {"choice": ["red", "blue"]}}),
    "audio": ("chat", {"audio": {"voice": "alloy", "format": "wav"}}),
    "prediction": ("chat", {"prediction": {"type": "content", "content": "x"}}),
    "web_search_options": ("chat", {"web_search_options": {}}),
    "reasoning_effort": ("chat", {"reasoning_effort": "low"}),
    "suffix": ("comp", {"suffix": "!"}),
    "verbosity": ("chat", {"verbosity": "low"}),
    "modalities": ("chat", {"modalities": ["text"]}),
    "user": ("chat", {"user": "u1"}),
    "metadata": ("chat", {"metadata": {"k": "v"}}),
    "store": ("chat", {"store": False}),
    "service_tier": ("chat", {"service_tier": "auto"}),
    "safety_identifier": ("chat", {"safety_identifier": "s"}),
    "prompt_cache_key": ("chat", {"prompt_cache_key": "k"}),
}
BASE = {"chat": ("/v1/chat/completions", {"messages": HI, "max_tokens": 6, "temperature": 0}),
        "comp": ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0})}


@pytest.fixture(scope="module")
def servers(torch_engine):
    from relayinfer.cloud.engine.llm_engine import AsyncLLMEngine, LLMEngine
    from relayinfer.cloud.pd.gateway import Gateway, GroupSpec, Scenario, local_groups
    from relayinfer.cloud.pd.instance import InstanceConfig
    from relayinfer.cloud.pd.service import PDEngine, PDService
    from relayinfer.cloud.serve.service import CloudService, ServiceThread

    one = CloudService(torch_engine, torch_engine.fingerprint, model_name=MODEL,
                       llm=AsyncLLMEngine(LLMEngine(torch_engine, kv_cache_bytes=KV)))
    gw = Gateway(local_groups(torch_engine, [GroupSpec(Scenario("chat", 60000, 5000), 2, 1)],
                              InstanceConfig(kv_cache_bytes=KV)))
    blocks = KV // (16 * torch_engine.cfg.kv_bytes_per_token)
    pd = PDService(torch_engine, torch_engine.fingerprint, model_name=MODEL,
                   llm=PDEngine(gw, torch_engine.cfg, min(torch_engine.context_length, blocks * 16), blocks,
                                model=torch_engine.model))
    with ServiceThread(one) as a, ServiceThread(pd) as b:
        yield f"http://127.0.0.1:{a.http_port}", f"http://127.0.0.1:{b.http_port}", b


def _answer(r: requests.Response) -> tuple[int, object]:
    """(status, what must match): the choices and usage (streamed: every chunk's choices and usage in
    order, ids and times left out), or the error's param and code."""
    if r.status_code != 200:
        e = r.json()["error"]
        return r.status_code, (e["param"], e["code"])
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [json.loads(x[len("data: "):]) for x in r.text.split("\n\n") if x and x != "data: [DONE]"]
        return 200, [(e.get("choices"), e.get("usage"), e.get("error")) for e in events]
    body = r.json()
    return 200, (body["choices"], body["usage"])


def _close(a, b, path="") -> list[str]:
    """Where `a` and `b` differ (floats within 1e-4: logprobs of one model on two engines)."""
    if isinstance(a, float) and isinstance(b, (int, float)):
        return [] if abs(a - b) <= 1e-4 else [f"{path}: {a} != {b}"]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(a)} != {sorted(b)}"]
        return [d for k in a for d in _close(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _close(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def test_every_api_field_has_a_case():
    assert set(protocol._FIELDS[True] | protocol._FIELDS[False]) - set(CASES) == set()


@pytest.mark.parametrize("field", sorted(CASES))
def test_pd_answers_each_field_like_one_engine(servers, field):
    one, pd, _ = servers
    kind, extra = CASES[field]
    path, base = BASE[kind]
    body = {**base, **extra}
    got_one = _answer(requests.post(one + path, json=body, timeout=120))
    got_pd = _answer(requests.post(pd + path, json=body, timeout=120))
    if got_one[0] == 200 and got_pd[0] != 200:  # P/D may refuse what it cannot do, by name
        assert got_pd == (400, (field, "unsupported_parameter")), (field, got_pd)
        return
    assert got_pd[0] == got_one[0], (field, got_one, got_pd)
    diff = _close(got_one[1], got_pd[1])
    assert not diff, (field, diff[:5])


def test_logprobs_come_back_through_pd(servers):
    _, pd, _ = servers
    r = requests.post(pd + "/v1/chat/completions", json={"messages": HI, "max_tokens": 5, "temperature": 0,
                                                          "logprobs": True, "top_logprobs": 2}, timeout=120)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == r.json()["usage"]["completion_tokens"] == 5  # the prefill's first token included
    assert all(c["logprob"] <= 0 and len(c["top_logprobs"]) == 2 for c in content)
    assert all(c["top_logprobs"][0]["logprob"] >= c["logprob"] - 1e-6 for c in content)  # greedy: the top one


def test_pd_histograms_use_the_cloud_buckets(servers):
    from prometheus_client import CollectorRegistry

    from relayinfer.cloud.engine.metrics import LATENCY_BUCKETS, EngineMetrics

    gw = servers[2].llm.gateway
    eng = CollectorRegistry()
    EngineMetrics(registry=eng)

    def edges(registry, name):
        return [s.labels["le"] for m in registry.collect() for s in m.samples if s.name == name + "_bucket"
                and s.labels.get("group", "chat") == "chat" and s.labels.get("mode", "contiguous") == "contiguous"]

    m = gw.metrics
    m.ttft.labels("chat"), m.tpot.labels("chat"), m.kv_transfer.labels("contiguous")  # a child has its buckets
    reg = m.registry
    assert edges(reg, "relayinfer_pd_ttft_seconds") == edges(eng, "relayinfer_engine_ttft_seconds")
    assert float(edges(reg, "relayinfer_pd_ttft_seconds")[-2]) == LATENCY_BUCKETS[-1] == 1800.0  # 30 min
    assert edges(reg, "relayinfer_pd_tpot_seconds") == edges(eng, "relayinfer_engine_tpot_seconds")
    assert edges(reg, "relayinfer_pd_kv_transfer_seconds") == edges(eng, "relayinfer_engine_ttft_seconds")
