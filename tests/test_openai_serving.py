"""The OpenAI serving classes called directly, without HTTP, on the shipped SmolLM2 model: the
request models' `to_sampling_params` on edge values, a greedy chat answer equal to the reference
generation and to the same request over HTTP, a streamed chat that joins to the whole answer,
seeded completions with n = 2 equal to their single-choice requests, admission errors naming the
prompt, and a stream closed unread that gives every KV block back."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from relayinfer.cloud.engine.llm_engine import AsyncLLMEngine, LLMEngine
from relayinfer.cloud.serve.openai.api_server import make_app
from relayinfer.cloud.serve.openai.protocol import (APIError, ChatCompletionRequest, CompletionRequest, ServedModel,
                                                    choice_seed)
from relayinfer.cloud.serve.openai.serving_chat import OpenAIServingChat
from relayinfer.cloud.serve.openai.serving_completion import OpenAIServingCompletion
from relayinfer.cloud.serve.openai.serving_engine import SSEStream
from relayinfer.cloud.serve.openai.serving_models import OpenAIServingModels
from relayinfer.protocol.model.decoding import SamplingParams
from relayinfer.protocol.validate import FieldError

MODEL = "smollm2-135m-instruct"
SERVED = ServedModel(MODEL, ("model.gguf",), 49152)
QUESTION = "Write a haiku about the sea."
HI = [{"role": "user", "content": QUESTION}]
KV_BYTES = 16 << 20  # max_model_len 352


# --- request models, no engine -------------------------------------------------------------------

def chat_req(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest.from_json({"messages": HI, **body}, SERVED)


def test_to_sampling_params_defaults_and_edges():
    p = chat_req().to_sampling_params(20, 352)
    assert (p.temperature, p.top_p, p.max_new_tokens, p.seed, p.logprobs) == (1.0, 1.0, 256, None, None)
    # a left-out max_tokens is capped to what fits, at least 1; completions default to 16
    assert chat_req().to_sampling_params(300, 352).max_new_tokens == 52
    assert chat_req().to_sampling_params(352, 352).max_new_tokens == 1
    comp = CompletionRequest.from_json({"prompt": "The capital of France is"}, SERVED)
    assert comp.to_sampling_params(6, 352).max_new_tokens == 16
    assert CompletionRequest.from_json({"prompt": "x", "min_tokens": 40}, SERVED).to_sampling_params(
        6, 352).max_new_tokens == 40  # the default grows to min_tokens
    with pytest.raises(FieldError, match=r"min_tokens must be at most the 52 tokens that fit after this prompt"):
        chat_req(min_tokens=100).to_sampling_params(300, 352)  # 52 fit
    # top_p 0 is greedy; max_completion_tokens wins over max_tokens; edge values pass through
    p = chat_req(top_p=0, temperature=2, max_tokens=9, max_completion_tokens=3, seed=-(1 << 63), top_k=-1,
                 repetition_penalty=2, logit_bias={"0": -100}, stop=["", "\n"], stop_token_ids=[49151],
                 logprobs=True, top_logprobs=20).to_sampling_params(10, 352)
    assert p == SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=-(1 << 63), max_new_tokens=3,
                               repetition_penalty=2.0, logit_bias=((0, -100.0),), stop_ids=(49151,), logprobs=20)
    assert chat_req(stop=["", "\n"]).stop == ("\n",)


def test_choice_seeds_are_kept_for_choice_0_and_derived_for_the_others():
    req = CompletionRequest.from_json({"prompt": "x", "n": 3, "seed": 7}, SERVED)
    seeds = [req.to_sampling_params(1, 352, j).seed for j in range(3)]
    assert seeds[0] == 7 and seeds[1:] == [choice_seed(7, 1), choice_seed(7, 2)]
    assert len(set(seeds)) == 3 and all(0 <= s < 1 << 63 for s in seeds[1:])
    assert CompletionRequest.from_json({"prompt": "x", "n": 2}, SERVED).to_sampling_params(1, 352, 1).seed is None


@pytest.mark.parametrize("body,param,code", [
    ({"model": "nope"}, "model", "model_not_found"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "missing_required_parameter"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role", "unsupported_parameter"),
    ({"frobnicate": 1}, "frobnicate", "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": " "}]}, "messages", "invalid_value"),
])
def test_chat_request_errors_name_the_field(body, param, code):
    with pytest.raises(APIError) as e:
        ChatCompletionRequest.from_json({"messages": HI, **body}, SERVED)
    assert (e.value.param, e.value.code) == (param, code)
    assert e.value.status == (404 if param == "model" else 400)


def test_completion_prompt_forms():
    req = CompletionRequest.from_json({"prompt": [[1, 2], "ab"]}, SERVED)
    assert req.prompt == ((1, 2), "ab") and req.prompt_param(1) == "prompt[1]"
    with pytest.raises(FieldError) as e:
        CompletionRequest.from_json({"prompt": [1, 49152]}, SERVED)
    assert e.value.field == "prompt[1]"


# --- serving classes on the real model ----------------------------------------------------------

def serving(engine, tokenizer, budget=None):
    models = OpenAIServingModels(engine, MODEL)
    return models, OpenAIServingChat(engine, tokenizer, models), OpenAIServingCompletion(
        engine, tokenizer, models, budget)


async def collect(stream: SSEStream) -> list:
    try:
        return [e async for e in stream]
    finally:
        await stream.aclose()


def test_chat_greedy_equals_reference_stream_and_http(torch_engine, tokenizer):
    n = 16
    ref = torch_engine.generate(tokenizer.encode_chat(HI), SamplingParams(max_new_tokens=n)).token_ids
    ref_text = tokenizer.decode([t for t in ref if t != tokenizer.eos_id])

    async def main():
        engine = AsyncLLMEngine(LLMEngine(torch_engine, kv_cache_bytes=KV_BYTES))
        models, chat, _ = serving(engine, tokenizer)
        req = chat_req(temperature=0, max_tokens=n)
        whole = await chat.create_chat_completion(req)
        events = await collect(await chat.create_chat_completion(
            chat_req(temperature=0, max_tokens=n, stream=True, stream_options={"include_usage": True})))
        runner = web.AppRunner(make_app(engine, tokenizer, MODEL))  # the same engine, over HTTP
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1/chat/completions",
                                  json={"model": MODEL, "messages": HI, "temperature": 0, "max_tokens": n}) as r:
                    http = await r.json()
        finally:
            await runner.cleanup()
        return models.show_available_models(), whole, events, http, engine.engine

    listed, whole, events, http, llm = asyncio.run(main())
    assert listed["data"][0]["id"] == MODEL and listed["data"][0]["max_model_len"] == llm.max_model_len == 352
    choice = whole["choices"][0]
    assert choice["message"]["content"] == ref_text and ref_text.strip()
    assert choice["finish_reason"] == ("stop" if ref[-1] == tokenizer.eos_id else "length")
    assert whole["usage"] == {"prompt_tokens": len(tokenizer.encode_chat(HI)), "completion_tokens": len(ref),
                              "total_tokens": len(tokenizer.encode_chat(HI)) + len(ref),
                              "prompt_tokens_details": {"cached_tokens": 0}}  # the first request: nothing cached
    full_blocks = len(tokenizer.encode_chat(HI)) // 16 * 16  # the same prompt again: its full blocks are cached
    cached = {**whole["usage"], "prompt_tokens_details": {"cached_tokens": full_blocks}}
    assert http["choices"] == whole["choices"] and http["usage"] == cached and full_blocks > 0
    assert whole["object"] == "chat.completion" and http["id"] != whole["id"]
    # streamed: the role first, deltas that join to the whole text, the finish, the usage, [DONE]
    assert events[-1] == b"data: [DONE]\n\n"
    chunks = [json.loads(e[len(b"data: "):]) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"content": "", "role": "assistant"}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == ref_text
    assert chunks[-2]["choices"][0]["finish_reason"] == choice["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == cached
    assert llm.block_manager.num_used_blocks == 0


def test_completion_n2_seeds_equal_single_choice_requests(torch_engine, tokenizer):
    body = {"prompt": "Once upon a time, a robot", "temperature": 1.0, "max_tokens": 8, "seed": 1234}

    async def main():
        engine = AsyncLLMEngine(LLMEngine(torch_engine, kv_cache_bytes=KV_BYTES))
        _, _, comp = serving(engine, tokenizer)
        both = await comp.create_completion(CompletionRequest.from_json({**body, "n": 2}, SERVED))
        first = await comp.create_completion(CompletionRequest.from_json(body, SERVED))
        second = await comp.create_completion(CompletionRequest.from_json({**body, "seed": choice_seed(1234, 1)},
                                                                          SERVED))
        streamed = await collect(await comp.create_completion(
            CompletionRequest.from_json({**body, "n": 2, "stream": True}, SERVED)))
        return both, first, second, streamed, engine.engine

    both, first, second, streamed, llm = asyncio.run(main())
    texts = [c["text"] for c in both["choices"]]
    assert [c["index"] for c in both["choices"]] == [0, 1]
    assert texts == [first["choices"][0]["text"], second["choices"][0]["text"]]
    assert texts[0] != texts[1] and all(texts)
    assert both["usage"]["completion_tokens"] == 16 and both["usage"]["prompt_tokens"] == first["usage"]["prompt_tokens"]
    chunks = [json.loads(e[len(b"data: "):]) for e in streamed[:-1]]
    joined = ["".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i) for i in (0, 1)]
    assert joined == texts  # the same seeds, streamed
    assert llm.block_manager.num_used_blocks == 0


def test_admission_errors_and_an_unread_stream(torch_engine, tokenizer):
    async def main():
        engine = AsyncLLMEngine(LLMEngine(torch_engine, kv_cache_bytes=KV_BYTES))
        _, chat, comp = serving(engine, tokenizer)
        with pytest.raises(APIError) as too_long:
            await comp.create_completion(CompletionRequest.from_json(
                {"prompt": ["Hi", "The capital of France is"], "max_tokens": 350}, SERVED))
        stream = await chat.create_chat_completion(chat_req(temperature=0, max_tokens=200, stream=True))
        held = engine.engine.block_manager.num_used_blocks  # the request runs: its prompt holds blocks
        await stream.aclose()  # closed without reading a single event
        for _ in range(3000):  # the engine thread applies the abort at its next step
            if not engine.engine.seqs:
                break
            await asyncio.sleep(0.01)
        return too_long.value, held, engine.engine

    err, held, llm = asyncio.run(main())
    assert (err.status, err.param, err.code) == (400, "prompt[1]", "context_length_exceeded")
    assert "max_tokens 350" in err.message
    assert held > 0 and llm.block_manager.num_used_blocks == 0 and not llm.seqs
