"""The OpenAI API as exactly as OpenAI/vLLM give it: one module-scoped cloud service with
the batching engine (its HTTP side serves the OpenAI routes), checked field by field against the
right values, plus the tokenizer's user-text/control-token boundary, the SDK's shown text and the
shared sampler's penalties across the split hand-off."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import requests
import torch

from relayinfer.cloud.engine.llm_engine import AsyncLLMEngine, LLMEngine
from relayinfer.cloud.serve.service import CloudService, ServiceThread
from relayinfer.protocol.model.decoding import SamplingParams, adjust_logits, sample, token_logprobs
from relayinfer.protocol.model.tokenizer import Tokenizer
from conftest import CloudFirstClient

MODEL = "smollm2-135m-instruct"
KV_BYTES = 16 << 20  # 22 blocks of 16 tokens: max_model_len 352 < the 8,192-token context
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def service(torch_engine):
    llm = AsyncLLMEngine(LLMEngine(torch_engine, kv_cache_bytes=KV_BYTES))
    svc = CloudService(torch_engine, torch_engine.fingerprint, llm=llm, model_name=MODEL)
    with ServiceThread(svc) as running:
        yield running


@pytest.fixture(scope="module")
def base(service):
    return f"http://127.0.0.1:{service.http_port}"


def post(base, path, body, **kw) -> requests.Response:
    return requests.post(base + path, json=body, timeout=120, **kw)


def chat(base, **body) -> requests.Response:
    return post(base, "/v1/chat/completions", {"model": MODEL, "messages": HI, **body})


def comp(base, **body) -> requests.Response:
    return post(base, "/v1/completions", {"model": MODEL, **body})


def sse(r: requests.Response) -> list[dict]:
    assert r.status_code == 200, r.text
    lines = [x for x in r.text.split("\n\n") if x]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(x[len("data: "):]) for x in lines[:-1]]


def error(r: requests.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["param"] == param, e
    return e


# --- 1, 2: logprobs and echo --------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_model(model_path):
    pytest.importorskip("transformers")
    from hf_reference import hf_from_gguf

    return hf_from_gguf(model_path)[1]


def hf_logprobs(hf_model, ids) -> np.ndarray:
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].double(), -1).numpy()


N_LP = 4


def test_chat_logprobs_equal_transformers(base, tokenizer, hf_model):
    prompt = tokenizer.encode_chat(HI)
    r = chat(base, max_tokens=N_LP, temperature=0, logprobs=True, top_logprobs=3, top_p=0.5, presence_penalty=1.0)
    body = r.json()
    lp = body["choices"][0]["logprobs"]["content"]
    assert len(lp) == body["usage"]["completion_tokens"] == N_LP
    # the greedy answer with the penalty, from transformers' logits: one forward over prompt + answer
    by_bytes = {tokenizer.token_bytes(i): i for i in range(tokenizer.vocab_size) if i not in tokenizer.added_ids}
    answer = [by_bytes[bytes(e["bytes"])] for e in lp]  # the answer's ids, from their bytes
    refs = hf_logprobs(hf_model, prompt + answer)
    for k, e in enumerate(lp):
        seq = prompt + answer[:k]
        ref = refs[len(seq) - 1]
        tid = int(np.argmax(adjust_logits(ref.astype(np.float32), SamplingParams(presence_penalty=1.0),
                                          seq, len(prompt))))
        assert answer[k] == tid  # the server's token is transformers' greedy pick after the penalty
        assert e["bytes"] == list(tokenizer.token_bytes(tid)) and e["token"] == tokenizer.decode([tid])
        assert abs(e["logprob"] - ref[tid]) < 1e-3  # raw: unchanged by the penalty and top_p
        top = np.argsort(-ref)[:3]
        assert [t["token"] for t in e["top_logprobs"]] == [tokenizer.decode([int(t)]) for t in top]
        assert max(abs(t["logprob"] - ref[i]) for t, i in zip(e["top_logprobs"], top)) < 1e-3
    # streamed: the same entries, spread over the chunks
    chunks = sse(chat(base, max_tokens=N_LP, temperature=0, logprobs=True, top_logprobs=3, top_p=0.5,
                      presence_penalty=1.0, stream=True))
    streamed = [e for c in chunks for ch in c["choices"] if ch["logprobs"] for e in ch["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in lp]
    assert max(abs(a["logprob"] - b["logprob"]) for a, b in zip(streamed, lp)) < 1e-4


def test_completion_logprobs_and_echo(base, tokenizer, hf_model):
    prompt = "The capital of France is"
    ids = tokenizer.encode(prompt)
    r = comp(base, prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True)
    ch = r.json()["choices"][0]
    lp = ch["logprobs"]
    assert ch["text"].startswith(prompt) and len(ch["text"]) > len(prompt)
    assert len(lp["tokens"]) == len(ids) + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    all_ids = ids + tokenizer.encode(ch["text"][len(prompt):])
    assert "".join(lp["tokens"]) == ch["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    ref = hf_logprobs(hf_model, all_ids[:len(ids) + 3])
    for i in range(1, len(ids) + 3):
        assert abs(lp["token_logprobs"][i] - ref[i - 1][all_ids[i]]) < 1e-3
        best = int(np.argmax(ref[i - 1]))
        assert abs(lp["top_logprobs"][i][tokenizer.decode([best])] - ref[i - 1][best]) < 1e-3
    # echo without logprobs, streamed: the prompt comes first
    chunks = sse(comp(base, prompt=prompt, max_tokens=3, temperature=0, echo=True, stream=True))
    assert "".join(c["choices"][0]["text"] for c in chunks) == ch["text"]


# --- 3: penalties, min_tokens, logit_bias in the shared sampler ----------------------------------

def test_adjust_logits_definitions():
    x = np.array([2.0, -1.0, 0.5, 3.0], np.float32)
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    # prompt [0], answer [3, 3, 1]: repetition over prompt+answer, frequency/presence over the answer
    got = adjust_logits(x, p, [0, 3, 3, 1], 1)
    assert got.tolist() == [1.0, -2.0 - 0.25 - 0.5, 0.5, 1.5 - 0.5 - 0.5]
    m = adjust_logits(x, SamplingParams(min_tokens=2, stop_ids=(2,)), [0, 1], 1, eos_id=3)
    assert m[3] == m[2] == -np.inf and m[0] == 2.0  # one answer token so far: EOS and stop ids masked
    assert adjust_logits(x, SamplingParams(min_tokens=1), [0, 1], 1, eos_id=3)[3] == 3.0
    assert adjust_logits(x, SamplingParams(logit_bias=((1, 100.0),)))[1] == 99.0
    assert sample(x, SamplingParams(logit_bias=((1, 100.0),)), 0) == 1
    for bad in (dict(presence_penalty=99), dict(frequency_penalty=-2.5), dict(repetition_penalty=0),
                dict(min_tokens=-1), dict(logit_bias=((1, 101.0),))):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    lp, top = token_logprobs(np.log(np.array([0.5, 0.25, 0.25], np.float32)), 1, 2)
    assert abs(lp - math.log(0.25)) < 1e-6 and top[0][0] == 0 and top[1][0] == 1


PENALTIES = dict(frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3)


def test_penalties_over_http_equal_the_per_request_path(base, torch_engine, tokenizer):
    prompt = tokenizer.encode_chat("Repeat the word 'sea' ten times.")
    plain = torch_engine.generate(prompt, SamplingParams(max_new_tokens=10)).token_ids
    ref = torch_engine.generate(prompt, SamplingParams(max_new_tokens=10, **PENALTIES)).token_ids
    assert ref != plain  # the penalties change this answer
    r = post(base, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0,
                                       **PENALTIES})
    assert r.json()["choices"][0]["text"] == tokenizer.decode(ref, skip_special=True)
    for name, bad in (("presence_penalty", 99), ("frequency_penalty", -3), ("repetition_penalty", 0),
                      ("min_tokens", -1)):
        error(comp(base, prompt="x", max_tokens=2, **{name: bad}), 400, name)
    # min_tokens: EOS (here pushed to the top by logit_bias) cannot end the answer before it
    eos_first = {str(tokenizer.eos_id): 100}
    assert chat(base, max_tokens=8, logit_bias=eos_first).json()["usage"]["completion_tokens"] == 1
    r = chat(base, max_tokens=8, logit_bias=eos_first, min_tokens=3).json()
    assert r["usage"]["completion_tokens"] == 4 and r["choices"][0]["finish_reason"] == "stop"


def test_penalties_split_answer_identical_across_hand_off(service, torch_engine, onnx_engine, tokenizer):
    from relayinfer.device.profiles import DeviceProfile
    from relayinfer.sdk import Client

    prompt = tokenizer.encode_chat("Repeat the word 'sea' ten times.")
    sampling = dict(max_new_tokens=12, temperature=0.7, seed=5, **PENALTIES)
    ref = torch_engine.generate(prompt, SamplingParams(**sampling)).token_ids
    slow = DeviceProfile("test-slow", prefill_ms_per_token=100.0)  # the cloud's first tokens come first
    device = Client(engine=onnx_engine, mode="device-only", profile=slow).complete(prompt, **sampling)
    assert device.token_ids == ref
    # the batched engine (module service) and the per-request service path (no llm) on the cloud side
    with ServiceThread(CloudService(torch_engine, torch_engine.fingerprint)) as per_request:
        for svc in (service, per_request):
            c = CloudFirstClient(cloud_url=svc.url, engine=onnx_engine, profile=slow, target_tpot_ms=30.0, cloud_budget=6)
            split = c.complete(prompt, **sampling)
            assert split.mode == "split" and 0 < split.handoff_index < len(split.token_ids), (svc.llm, split)
            assert split.token_ids == ref, svc.llm


# --- 4: stop_token_ids ---------------------------------------------------------------------------

def test_stop_token_ids(base, torch_engine, tokenizer):
    prompt = tokenizer.encode_chat("Write a haiku about the sea.")
    ref = torch_engine.generate(prompt, SamplingParams(max_new_tokens=8)).token_ids
    stop = ref[4]
    r = post(base, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                                       "stop_token_ids": [stop]})
    ch = r.json()["choices"][0]
    first = ref.index(stop)
    assert ch["finish_reason"] == "stop" and r.json()["usage"]["completion_tokens"] == first + 1
    assert ch["text"] == tokenizer.decode(ref[:first])
    # <|im_start|> (id 1) as a stop id: a raw prompt that would run on into a new turn ends there
    r = comp(base, prompt="<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n",
             max_tokens=8, temperature=0, stop_token_ids=[1])
    ch = r.json()["choices"][0]
    assert ch["finish_reason"] == "stop" and "<|im_start|>" not in ch["text"]
    error(comp(base, prompt="x", stop_token_ids=["a"]), 400, "stop_token_ids[0]")  # the entry that is wrong


def test_ignore_eos_runs_to_max_tokens_and_unknown_fields_are_refused(base, torch_engine, tokenizer):
    prompt = tokenizer.encode_chat("Hi")
    ref = torch_engine.generate(prompt, SamplingParams(max_new_tokens=48)).token_ids
    assert ref[-1] == tokenizer.eos_id and len(ref) < 48  # the greedy answer is short and ends at EOS
    short = comp(base, prompt=prompt, max_tokens=48, temperature=0).json()
    assert short["choices"][0]["finish_reason"] == "stop" and short["usage"]["completion_tokens"] == len(ref)
    m = len(ref) + 6
    for endpoint, body in (("/v1/completions", {"prompt": prompt}), ("/v1/chat/completions", {"messages": [
            {"role": "user", "content": "Hi"}]})):
        r = post(base, endpoint, {"model": MODEL, **body, "max_tokens": m, "temperature": 0, "ignore_eos": True})
        ch = r.json()["choices"][0]
        assert r.json()["usage"]["completion_tokens"] == m and ch["finish_reason"] == "length"
        text = ch["text"] if "text" in ch else ch["message"]["content"]
        assert text.startswith(tokenizer.decode(ref[:-1]))  # greedy: the same answer, then past EOS
        chunks = sse(post(base, endpoint, {"model": MODEL, **body, "max_tokens": m, "temperature": 0,
                                           "ignore_eos": True, "stream": True,
                                           "stream_options": {"include_usage": True}}))
        assert chunks[-1]["usage"]["completion_tokens"] == m
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        r = post(base, endpoint, {"model": MODEL, **body, "max_tokens": m, "temperature": 0, "ignore_eos": False})
        assert r.json()["usage"]["completion_tokens"] == len(ref)
    error(chat(base, max_tokens=2, ignore_eos="yes"), 400, "ignore_eos")
    # a field this server does not read is refused by name, never silently ignored
    for field in ("min_p", "skip_special_tokens", "guided_decoding_backend"):
        e = error(chat(base, max_tokens=2, **{field: 1}), 400, field)
        assert e["code"] == "unsupported_parameter"
    error(chat(base, max_tokens=2, guided_json=1), 400, "guided_json")  # read, and 1 is no JSON schema
    error(comp(base, prompt="x", max_tokens=2, messages=HI), 400, "messages")
    error(chat(base, max_tokens=2, echo=True), 400, "echo")


# --- 5: n > 1 ------------------------------------------------------------------------------------

def test_n_choices_streamed_seeded(base, service, tokenizer):
    body = dict(max_tokens=5, n=2, seed=3, temperature=1.0)
    a = chat(base, **body).json()
    b = chat(base, **body).json()
    assert [c["index"] for c in a["choices"]] == [0, 1]
    texts = [c["message"]["content"] for c in a["choices"]]
    assert texts == [c["message"]["content"] for c in b["choices"]]  # reproducible
    assert texts[0] != texts[1]  # different
    chunks = sse(chat(base, stream=True, stream_options={"include_usage": True}, **body))
    got = {0: "", 1: ""}
    for c in chunks:
        for ch in c["choices"]:
            got[ch["index"]] += ch["delta"].get("content") or ""
    assert [got[0], got[1]] == texts
    assert chunks[-1]["usage"]["completion_tokens"] == a["usage"]["completion_tokens"]
    # one prefill forked: choice 1 starts once choice 0 has prefilled, on its cached full blocks
    msgs = [{"role": "user", "content": "A prompt seen by no other test: " + "sea " * 40}]
    r = chat(base, messages=msgs, **body).json()
    n_prompt = len(tokenizer.encode_chat(msgs))
    eng = service.llm.engine
    first = eng.request_stats(f"{r['id']}-0").prefix_hit_tokens  # the default system turn's block, at most
    assert first <= 16
    assert eng.request_stats(f"{r['id']}-1").prefix_hit_tokens == (n_prompt - 1) // eng.block_size * eng.block_size > first
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"] == len(tokenizer.encode_chat(HI))
    assert service.llm.engine.block_manager.num_used_blocks == 0


# --- 6: limits users can see ---------------------------------------------------------------------

def test_max_model_len_visible_and_named(base, service, tokenizer):
    m = requests.get(base + "/v1/models", timeout=30).json()["data"][0]
    limit = service.llm.engine.max_model_len
    assert m["max_model_len"] == limit == 352
    e = error(comp(base, prompt=[5] * 340, max_tokens=20), 400, "prompt")
    assert e["code"] == "context_length_exceeded"
    assert "340 prompt tokens" in e["message"] and "20 new tokens" in e["message"] and "352" in e["message"]
    e = error(chat(base, messages=[{"role": "user", "content": "hi " * 400}], max_tokens=4), 400, "messages")
    assert e["code"] == "context_length_exceeded" and "352" in e["message"]
    # without max_tokens, the default (16) is capped to what fits: a 346-token prompt gets 6
    r = comp(base, prompt=(tokenizer.encode(" the sea") * 200)[:346], temperature=0)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
    assert r.json()["choices"][0]["finish_reason"] == "length"


# --- 7: the SDK's text is what was streamed ------------------------------------------------------

class Scripted:
    """A device engine that emits a fixed token sequence (one-hot logits), for exact text checks."""

    def __init__(self, script, vocab, eos_id):
        self.script, self.vocab, self.eos_id, self.context_length = list(script), vocab, eos_id, 8192
        self.fingerprint = "scripted"

    def _logits(self, n):
        x = np.zeros(self.vocab, np.float32)
        x[self.script[min(n, len(self.script) - 1)]] = 10.0
        return x

    def prefill(self, ids, kv=None):
        n = 0 if kv is None else kv
        return self._logits(n), n + (0 if kv is None else len(ids))

    def decode(self, token_id, kv):
        return self._logits(kv + 1), kv + 1


def test_sdk_text_equals_streamed_text(tokenizer, monkeypatch):
    import asyncio

    from relayinfer.device.split import SplitOptions, SplitSession

    robot = tokenizer.encode("ok 🤖")
    assert len(robot) >= 3  # the emoji spans several byte tokens
    cases = [(robot + [tokenizer.eos_id], 64, "ok 🤖"),  # ends with EOS: no <|im_end|> shown
             (robot, len(robot) - 1, "ok ")]  # max_new_tokens cuts the emoji: dropped in both
    for script, n, want in cases:
        s = SplitSession(Scripted(script, tokenizer.vocab_size, tokenizer.eos_id), tokenizer, None, "x",
                         options=SplitOptions(mode="device-only", target_tpot_ms=1.0))
        events = []
        res = asyncio.run(s.run([1, 2, 3], SamplingParams(max_new_tokens=n), events.append))
        assert "".join(e.text for e in events) == res.text == want
        assert res.token_ids == script[:n]
    # O(1) per token: the stream decoder never re-decodes the answer
    monkeypatch.setattr(Tokenizer, "decode", lambda *a, **k: pytest.fail("StreamDecoder called decode"))
    dec = tokenizer.stream_decoder()
    ids = tokenizer.encode("naïve 日本語 🤖 text " * 50)
    assert "".join(dec.push(i) for i in ids) == "naïve 日本語 🤖 text " * 50


# --- 8: user text never becomes control tokens ---------------------------------------------------

def test_user_text_never_becomes_control_tokens(tokenizer):
    added = sorted(tokenizer.added_ids)
    assert len(added) == 17
    names = [tokenizer.decode([i]) for i in added]
    content = "a" + "b".join(names) + "c"  # every added token's text, in one message per role
    for role in ("system", "user", "assistant"):
        msgs = [{"role": "system", "content": "S"}, {"role": role, "content": content}]
        ids = tokenizer.encode_chat(msgs)
        plain = tokenizer.encode_chat([{"role": "system", "content": "S"}, {"role": role, "content": "abc"}])
        ctrl = lambda xs: [t for t in xs if t in tokenizer.added_ids]  # noqa: E731
        assert ctrl(ids) == ctrl(plain)  # only the template's markup is control
        assert tokenizer.decode(ids) == tokenizer.render_chat(msgs)
    # ordinary messages are tokenized exactly as encode(render) (transformers' way)
    msgs = [{"role": "user", "content": "Hi 👋, 2+2?\n\nAnd 3+3?"}]
    assert tokenizer.encode_chat(msgs) == tokenizer.encode(tokenizer.render_chat(msgs))


def test_chat_endpoint_user_text_stays_text(base, tokenizer):
    r = chat(base, messages=[{"role": "user", "content": "<|im_end|><|endoftext|>"}], max_tokens=1, logprobs=True)
    assert r.json()["usage"]["prompt_tokens"] == len(tokenizer.encode_chat(
        [{"role": "user", "content": "<|im_end|><|endoftext|>"}]))
    ids = tokenizer.encode_chat([{"role": "user", "content": "<|im_end|><|endoftext|>"}])
    assert ids.count(tokenizer.eos_id) == 2  # system and user turn ends only (the template's)
    assert 0 not in ids  # <|endoftext|> stays text


# --- 11, 12, 13, 16: errors, shapes, defaults and nulls ------------------------------------------

def test_lone_surrogates_get_400_naming_the_field(base):
    for path, body, param in (("/v1/completions", {"prompt": "\ud800 hi"}, "prompt"),
                              ("/v1/completions", {"prompt": ["\udfff"]}, "prompt[0]"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]},
                               "messages[0].content"),
                              ("/v1/chat/completions", {"messages": HI, "stop": "\udc00"}, "stop")):
        error(post(base, path, {"model": MODEL, "max_tokens": 2, **body}), 400, param)


def test_shapes_defaults_and_nulls(base, tokenizer):
    msg = chat(base, max_tokens=2).json()["choices"][0]["message"]
    assert "refusal" in msg and msg["refusal"] is None
    r = chat(base, max_completion_tokens=None, max_tokens=4, temperature=0)
    assert r.json()["usage"]["completion_tokens"] <= 4
    assert chat(base, max_completion_tokens=3, max_tokens=9, temperature=0).json()["usage"]["completion_tokens"] <= 3
    r = comp(base, prompt="1, 2, 3, 4, 5,", temperature=0)
    assert r.json()["usage"]["completion_tokens"] == 16  # OpenAI's default max_tokens for completions
    assert chat(base, max_tokens=2, stream=None).json()["object"] == "chat.completion"
    assert chat(base, max_tokens=2.0, n=1.0).status_code == 200
    error(chat(base, max_tokens=2.5), 400, "max_tokens")
    greedy = chat(base, max_tokens=3, temperature=0).json()["choices"][0]["message"]["content"]
    assert chat(base, max_tokens=3, temperature=1, top_p=0).json()["choices"][0]["message"]["content"] == greedy
    assert chat(base, max_tokens=3, temperature=0, stop=["", "zzz"]).json()["choices"][0]["message"]["content"] == greedy
    assert chat(base, max_tokens=3, temperature=0, stop="").status_code == 200


def test_http_errors_are_json(base):
    r = requests.get(base + "/v1/nope", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = requests.get(base + "/v1/completions", timeout=30)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed" and "POST" in r.headers["Allow"]
    r = requests.post(base + "/v1/completions", data=b"{not json", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


# --- 14: batch prompts ---------------------------------------------------------------------------

def test_batch_prompts_one_choice_each_in_order(base, tokenizer):
    prompts = ["The sea is", "Paris is the capital of"]
    single = [comp(base, prompt=p, max_tokens=3, temperature=0).json()["choices"][0]["text"] for p in prompts]
    r = comp(base, prompt=prompts, max_tokens=3, temperature=0).json()
    assert [c["index"] for c in r["choices"]] == [0, 1] and [c["text"] for c in r["choices"]] == single
    ids = [tokenizer.encode(p) for p in prompts]
    r2 = comp(base, prompt=ids, max_tokens=3, temperature=0).json()
    assert [c["text"] for c in r2["choices"]] == single
    assert r2["usage"]["prompt_tokens"] == sum(map(len, ids)) and r2["usage"]["completion_tokens"] == 6
    chunks = sse(comp(base, prompt=prompts, max_tokens=3, temperature=0, stream=True))
    got = ["", ""]
    for c in chunks:
        for ch in c["choices"]:
            got[ch["index"]] += ch["text"]
    assert got == single


# --- 15: what is not implemented is refused, by name ---------------------------------------------

def test_unimplemented_fields_are_refused_by_name(base, tokenizer):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    cases = [({"tools": [{**tool, "function": {"name": "no spaces"}}]}, "tools[0].function.name"),
             ({"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "g"}}},
              "tool_choice.function.name"),
             ({"tool_choice": "required"}, "tool_choice"), ({"functions": [tool["function"]]}, "functions"),
             ({"response_format": {"type": "xml"}}, "response_format"),
             ({"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                         {"type": "image_url", "image_url": {"url": "x"}}]}]},
              "messages[0].content[1].type"),
             ({"messages": HI + [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]},
              "messages[1].tool_calls[0]"),
             ({"messages": HI + [{"role": "assistant"}]}, "messages[1].content"),
             ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
             ({"messages": [{"role": "function", "content": "x", "name": "f"}]}, "messages[0].role")]
    for body, param in cases:
        e = error(chat(base, max_tokens=2, **body), 400, param)
        assert "NoneType" not in e["message"]
    error(comp(base, prompt="x", suffix="y"), 400, "suffix")
    error(comp(base, prompt="x", best_of=3), 400, "best_of")
    # logit_bias is implemented (shared sampler): +100 on one token makes it the answer
    r = comp(base, prompt="Hello", max_tokens=3, temperature=0, logit_bias={"330": 100})
    assert r.json()["choices"][0]["text"] == tokenizer.decode([330]) * 3


# --- the openai client: every response validated by the package's own types -----------------------

def test_openai_client_logprobs_echo_penalties_stop_ids_n_batch_usage(base, tokenizer):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
    try:
        c = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, temperature=0, logprobs=True,
                                           top_logprobs=2, frequency_penalty=1.0, presence_penalty=0.5)
        assert c.choices[0].message.refusal is None and len(c.choices[0].logprobs.content) == 4
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in c.choices[0].logprobs.content)
        assert c.usage.completion_tokens == 4 and c.usage.total_tokens == c.usage.prompt_tokens + 4
        e = client.completions.create(model=MODEL, prompt="The sea is", max_tokens=3, temperature=0, echo=True,
                                      logprobs=1, extra_body={"stop_token_ids": [tokenizer.eos_id]})
        assert e.choices[0].text.startswith("The sea is") and e.choices[0].logprobs.token_logprobs[0] is None
        b = client.completions.create(model=MODEL, prompt=["The sea is", [504, 3091]], max_tokens=3, temperature=0)
        assert [ch.index for ch in b.choices] == [0, 1] and b.usage.completion_tokens == 6
        stream = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, n=2, seed=7, temperature=1,
                                                stream=True, stream_options={"include_usage": True})
        texts, usage = {0: "", 1: ""}, None
        for chunk in stream:  # each a ChatCompletionChunk
            for ch in chunk.choices:
                texts[ch.index] += ch.delta.content or ""
            usage = chunk.usage or usage
        assert usage.completion_tokens == 8 and texts[0] and texts[1]
        # strict validation by the package's pydantic models (the client itself does not validate);
        # echo's null first logprob is what OpenAI sends but its Completion type says float
        for m in (c, b):
            assert type(m).model_validate(m.model_dump()) == m
        from openai.types import Completion
        with pytest.raises(Exception, match="token_logprobs.0"):
            Completion.model_validate(e.model_dump())
    finally:
        client.close()


# --- 10: metrics ---------------------------------------------------------------------------------

def test_metrics_names_buckets_and_promtool(base, service):
    import shutil
    import subprocess

    chat(base, max_tokens=2)
    text = requests.get(base + "/metrics", timeout=30).text
    for name in ("relayinfer_engine_e2e_request_latency_seconds_bucket", "relayinfer_engine_request_prompt_tokens_bucket",
                 "relayinfer_engine_request_generation_tokens_bucket", "relayinfer_prefill_seconds_bucket",
                 'relayinfer_engine_ttft_seconds_bucket{le="1800.0"}', 'relayinfer_engine_queue_seconds_bucket{le="1800.0"}',
                 'relayinfer_engine_request_success_total{finished_reason="length"}', "relayinfer_engine_kv_blocks ",
                 # names other tools read (bench/soak.py, the security tests) stay
                 "relayinfer_active_sessions", "relayinfer_active_requests", "relayinfer_engine_kv_blocks_used",
                 "relayinfer_engine_running", "relayinfer_engine_waiting", "relayinfer_engine_requests_total"):
        assert name in text, name
    assert "relayinfer_prefill_ms" not in text and "relayinfer_engine_kv_blocks_total" not in text
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian: apt-get install prometheus): metric lint not run")
    out = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and not out.stdout.strip() and not out.stderr.strip(), out.stdout + out.stderr


# --- conformance: a bounded schemathesis run against our /openapi.json ---------------------------

def bounded(spec: dict) -> dict:
    """The served description with generation bounded for CI: short answers and prompts."""
    for path in ("/v1/chat/completions", "/v1/completions"):
        req = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        props = req["properties"]
        req["required"] = req["required"] + ["max_tokens"]
        props["max_tokens"] = {"type": "integer", "minimum": 1, "maximum": 3}
        props.pop("max_completion_tokens", None)
        props["n"]["maximum"] = 2
        props.pop("best_of", None)
        props["min_tokens"]["maximum"] = 3
        if "prompt" in props:
            s, lst, ids, idss = props["prompt"]["oneOf"]
            s["maxLength"] = 40
            lst.update(maxItems=2, items={**lst["items"], "maxLength": 40})
            ids["maxItems"] = 24
            idss.update(maxItems=2, items={**idss["items"], "maxItems": 24})
        else:
            props["messages"]["maxItems"] = 3
    return spec


def test_schemathesis_bounded_run(base):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance

    spec = requests.get(base + "/openapi.json", timeout=30).json()
    assert set(spec["paths"]) == {"/v1/chat/completions", "/v1/completions", "/v1/models"}
    schema = schemathesis.openapi.from_dict(bounded(spec))
    session = requests.Session()
    seen: dict[str, int] = {}
    refused: list[str] = []
    for result in schema.get_all_operations():
        op = result.ok()

        @given(case=op.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        def run(case):
            r = case.call(base_url=base, session=session, timeout=120)
            key = f"{op.method.upper()} {op.path} {r.status_code}"
            seen[key] = seen.get(key, 0) + 1
            if r.status_code == 400:
                refused.append(r.json()["error"]["message"])
            case.validate_response(r, checks=[not_a_server_error, response_schema_conformance,
                                              status_code_conformance])
        run()
    assert not any(k.endswith(" 500") for k in seen), seen
    assert seen.get("POST /v1/chat/completions 200", 0) >= EXAMPLES // 3, (seen, refused)  # not all refused


EXAMPLES = 15
