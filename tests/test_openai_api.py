"""OpenAI-compatible API on a real aiohttp server (127.0.0.1, free port) driven by the real
`openai` client: streamed chat equals greedy `TorchEngine` generation, non-streaming completions,
stop strings, /v1/models, and errors in OpenAI's shape."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest

from relayinfer.cloud.engine.llm_engine import AsyncLLMEngine, LLMEngine
from relayinfer.protocol.model.decoding import SamplingParams
from servers import openai_client

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m"
N = 20
QUESTION = "Write a haiku about the sea."


def test_openai_client_against_server(torch_engine, tokenizer):
    ref = torch_engine.generate(tokenizer.encode_chat(QUESTION), SamplingParams(max_new_tokens=N)).token_ids
    ref_text = tokenizer.decode([t for t in ref if t != tokenizer.eos_id])
    assert ref_text.strip()

    async def main():
        engine = AsyncLLMEngine(LLMEngine(torch_engine, kv_cache_bytes=16 << 20))
        res = {}
        async with openai_client(engine, tokenizer, MODEL, 60) as (client, base):
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=N,
                stream=True)
            parts, finish = [], []
            async for chunk in stream:
                if chunk.choices:
                    parts.append(chunk.choices[0].delta.content or "")
                    finish.append(chunk.choices[0].finish_reason)
            res["stream"], res["stream_chunks"], res["finish"] = "".join(parts), len(parts), finish[-1]
            # the same request, not streamed, next to a concurrent plain completion
            chat, comp = await asyncio.gather(
                client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                               temperature=0, max_tokens=N),
                client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0,
                                          max_tokens=5))
            res["chat"], res["usage"], res["comp"] = chat.choices[0].message.content, chat.usage, comp
            # a stop string cuts the answer before it
            stop = ref_text.strip().split()[2]
            cut = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=N,
                stop=[stop])
            res["stop"], res["stop_word"] = cut.choices[0], stop
            res["models"] = [m.id async for m in client.models.list()]
            with pytest.raises(openai.NotFoundError) as e404:
                await client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
            res["e404"] = e404.value
            with pytest.raises(openai.BadRequestError) as e400:
                await client.chat.completions.create(model=MODEL, messages=[], max_tokens=4)
            res["e400"] = e400.value
            with pytest.raises(openai.BadRequestError) as elong:
                await client.completions.create(model=MODEL, prompt="hi", max_tokens=10 ** 6)
            res["elong"] = elong.value
            async with aiohttp.ClientSession() as s:
                async with s.post(f"{base}/chat/completions", data=b"{not json") as r:
                    res["badjson"] = (r.status, await r.json())
        res["used_blocks"] = engine.engine.block_manager.num_used_blocks
        return res

    res = asyncio.run(main())
    assert res["stream"] == ref_text and res["stream_chunks"] > 3
    assert res["finish"] == ("stop" if ref[-1] == tokenizer.eos_id else "length")
    assert res["chat"] == ref_text
    assert res["usage"].prompt_tokens == len(tokenizer.encode_chat(QUESTION)) and res["usage"].completion_tokens == len(ref)
    assert res["comp"].choices[0].text and res["comp"].usage.completion_tokens == 5
    stop_choice = res["stop"]
    assert stop_choice.finish_reason == "stop"
    assert stop_choice.message.content == ref_text[:ref_text.index(res["stop_word"])]
    assert res["models"] == [MODEL]
    assert res["e404"].status_code == 404 and res["e404"].body["code"] == "model_not_found"
    assert res["e400"].status_code == 400 and res["e400"].body["param"] == "messages"
    assert res["elong"].body["code"] == "context_length_exceeded"
    status, body = res["badjson"]
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    assert res["used_blocks"] == 0


def test_usage_reports_prompt_tokens_from_the_prefix_cache(torch_engine, tokenizer):
    """The second turn of a chat reuses the first turn's cached blocks: its usage says how many
    prompt tokens came from the cache (OpenAI's `prompt_tokens_details.cached_tokens`)."""
    async def main():
        engine = AsyncLLMEngine(LLMEngine(torch_engine, kv_cache_bytes=16 << 20))
        async with openai_client(engine, tokenizer, MODEL, 60) as (client, _):
            turn = [{"role": "user", "content": QUESTION}]
            first = await client.chat.completions.create(model=MODEL, messages=turn, temperature=0, max_tokens=8)
            turn += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "Another one."}]
            second = await client.chat.completions.create(model=MODEL, messages=turn, temperature=0, max_tokens=8)
            return first.usage, second.usage

    first, second = asyncio.run(main())
    n1 = len(tokenizer.encode_chat([{"role": "user", "content": QUESTION}]))
    assert first.prompt_tokens_details.cached_tokens == 0
    assert second.prompt_tokens_details.cached_tokens == (n1 // 16) * 16 > 0  # the first prompt's full blocks
