"""Structured output and tool calls on the real model: the OpenAI server (through the `openai`
client), the split path (cloud tokens, then device tokens under the same grammar, KV hand-off too)
and random JSON schemas whose every answer validates."""
from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from relayinfer.cloud.engine.llm_engine import AsyncLLMEngine, LLMEngine
from relayinfer.device.profiles import DeviceProfile
from relayinfer.protocol.messages import Generate, Grammar, decode, encode
from relayinfer.protocol.model.decoding import SamplingParams, generate
from relayinfer.protocol.model.grammar import Guide, GrammarError, choice_grammar, json_schema_grammar
from relayinfer.sdk import Client
from servers import openai_client, split_cloud
from conftest import CloudFirstClient

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m"
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                         "population": {"type": "integer", "minimum": 0}},
        "required": ["city", "population"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 12}},
                                       "required": ["tz"], "additionalProperties": False}}}
ASK_CITY = [{"role": "user", "content": "Name a big city and its population, as JSON."}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_guide_masks_and_ends(tokenizer):
    g = Guide(choice_grammar(["yes", "no"]), tokenizer)
    ok = g.allowed([])
    assert 0 < ok.sum() < 10 and all(tokenizer.decode([int(t)]) in ("y", "ye", "yes", "n", "no") for t in ok.nonzero()[0])
    yes = tokenizer.encode("yes", special=False)
    g.sync(yes)
    assert g.done and g.accepting and g.consumed == len(yes)
    bad = Guide(choice_grammar(["yes", "no"]), tokenizer)
    with pytest.raises(GrammarError, match="token .* at answer position 0"):
        bad.sync(tokenizer.encode("maybe", special=False))
    for grammar, what in ((Grammar("regex", "[a-"), "regex"), (Grammar("json_schema", "{no json"), "JSON schema"),
                          (Grammar("lark", "start: undefined_rule"), "lark"), (Grammar("xml", "x"), "kind")):
        with pytest.raises(GrammarError, match=what):
            SamplingParams(grammar=grammar)


def test_constrained_generation_on_the_engine_equals_the_batched_engine(torch_engine, tokenizer):
    """The single-request loop and the batching engine give the same constrained answer (greedy),
    valid under the schema, ended by the grammar ('stop', no EOS token)."""
    ids = tokenizer.encode_chat(ASK_CITY)
    p = SamplingParams(max_new_tokens=60, grammar=json_schema_grammar(CITY))
    out = generate(torch_engine, ids, p)
    text = tokenizer.decode(out.token_ids)
    jsonschema.validate(json.loads(text), CITY)
    assert out.finish_reason == "stop" and tokenizer.eos_id not in out.token_ids
    eng = LLMEngine(torch_engine, kv_cache_bytes=16 << 20)
    got = eng.generate([ids], p)[0]
    assert got == out.token_ids


def test_grammar_travels_in_generate():
    g = json_schema_grammar(CITY)
    msg = Generate("r", [1, 2], 8, grammar=g)
    back = decode(encode(msg))
    assert back.grammar == g and back.grammar.kind == "json_schema" and json.loads(back.grammar.spec) == CITY
    assert decode(encode(Generate("r", [1], 4))).grammar is None


@pytest.fixture(scope="module")
def api(torch_engine, tokenizer):
    """An OpenAI server (aiohttp, 127.0.0.1, free port) on the batching engine; yields a function
    that runs a coroutine taking an `openai.AsyncOpenAI` client."""
    def run(fn):
        async def main():
            engine = AsyncLLMEngine(LLMEngine(torch_engine, kv_cache_bytes=16 << 20))
            async with openai_client(engine, tokenizer, MODEL) as (client, _):
                answers = await fn(client)
            return answers, engine.engine.block_manager.num_used_blocks
        return asyncio.run(main())
    return run


def test_response_format_on_chat_and_completions(api):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}

    async def fn(c):
        full = await c.chat.completions.create(model=MODEL, messages=ASK_CITY, temperature=0, max_tokens=60,
                                               response_format=fmt)
        parts = []
        async for ch in await c.chat.completions.create(model=MODEL, messages=ASK_CITY, temperature=0,
                                                        max_tokens=60, response_format=fmt, stream=True):
            parts.append(ch.choices[0].delta.content or "" if ch.choices else "")
        many = await c.chat.completions.create(model=MODEL, messages=ASK_CITY, temperature=0.7, seed=7, n=3,
                                               max_tokens=120, response_format={"type": "json_object"})
        regex = await c.completions.create(model=MODEL, prompt="Call me at", max_tokens=20,
                                           extra_body={"guided_regex": r" \d{3}-\d{4}"})
        choice = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Is fire hot?"}],
                                                 max_tokens=5, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
        lark = await c.completions.create(model=MODEL, prompt="Count:", max_tokens=20, temperature=0,
                                          extra_body={"guided_grammar": 'start: " " NUM ("," NUM)~2\nNUM: /[0-9]/'})
        return full, "".join(parts), many, regex, choice, lark

    (full, streamed, many, regex, choice, lark), used = api(fn)
    c0 = full.choices[0]
    jsonschema.validate(json.loads(c0.message.content), CITY)
    assert c0.finish_reason == "stop" and streamed == c0.message.content
    assert len(many.choices) == 3 and len({ch.message.content for ch in many.choices}) > 1
    done = [ch for ch in many.choices if ch.finish_reason == "stop"]  # "length": cut by max_tokens
    assert done and all(isinstance(json.loads(ch.message.content), dict) for ch in done)
    import re
    assert re.fullmatch(r" \d{3}-\d{4}", regex.choices[0].text) and regex.choices[0].finish_reason == "stop"
    assert choice.choices[0].message.content in ("yes", "no")
    assert re.fullmatch(r" [0-9](,[0-9]){2}", lark.choices[0].text)
    assert used == 0


def test_structured_output_errors_name_the_field(api):
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
         "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"guided_regex": "[a-"}, "guided_regex"),
        ({"guided_json": CITY, "guided_regex": "a+"}, "guided_regex"),
        ({"structured_outputs": {"json": CITY, "regex": "a"}}, "structured_outputs"),
        ({"guided_choice": []}, "guided_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"guided_json": False}, "guided_json"),
        ({"guided_json": {"type": "integer", "maximum": 10 ** 30}}, "guided_json"),
        ({"guided_json": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}},
         "guided_json"),
        ({"response_format": {"type": "json_object", "schema": CITY}}, "response_format.schema"),
        ({"tools": [{"type": "function", "function": {"name": "n", "parameters": {"type": "integer"}}}],
          "tool_choice": "required"}, "tools[0].function.parameters"),
        ({"tools": [{**WEATHER, "function": {**WEATHER["function"], "strict": True, "extra": 1}}]},
         "tools[0].function.extra"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": ["get_weather"]}}},
         "tool_choice.function.name"),
        ({"messages": [*ASK_WEATHER, {"role": "assistant", "content": None, "tool_calls": [
            {"id": [1], "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}]},
         "messages[1].tool_calls[0]"),
        ({"messages": [*ASK_WEATHER, {"role": "tool", "tool_call_id": "call_nope", "content": "sunny"}]},
         "messages[1].tool_call_id"),
    ]

    async def fn(c):
        out = []
        for extra, _ in cases:
            body = dict(extra)
            msgs = body.pop("messages", ASK_CITY)
            try:
                await c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, extra_body=body)
                out.append(None)
            except openai.BadRequestError as e:
                out.append(e.body.get("param"))
        try:
            await c.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body={"tools": [WEATHER]})
        except openai.BadRequestError as e:
            out.append(e.body.get("param"))
        return out

    got, _ = api(fn)
    assert got == [p for _, p in cases] + ["tools"]


def test_tool_calls_required_named_auto_and_results(api):
    async def fn(c):
        req = await c.chat.completions.create(model=MODEL, messages=ASK_WEATHER, temperature=0, max_tokens=80,
                                              tools=[WEATHER, TIME], tool_choice="required")
        named = await c.chat.completions.create(
            model=MODEL, messages=ASK_WEATHER, temperature=0, max_tokens=60, tools=[WEATHER, TIME],
            tool_choice={"type": "function", "function": {"name": "get_time"}}, parallel_tool_calls=False)
        chunks = [ch async for ch in await c.chat.completions.create(
            model=MODEL, messages=ASK_WEATHER, temperature=0, max_tokens=60, tools=[WEATHER],
            tool_choice="required", parallel_tool_calls=False, stream=True)]
        auto = await c.chat.completions.create(model=MODEL, messages=ASK_WEATHER, temperature=0, max_tokens=20,
                                               tools=[WEATHER])
        call = named.choices[0].message.tool_calls[0]
        back = await c.chat.completions.create(model=MODEL, temperature=0, max_tokens=20, tools=[WEATHER, TIME], messages=[
            *ASK_WEATHER, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "12:00"}], tool_choice="none")
        return req, named, chunks, auto, back

    (req, named, chunks, auto, back), used = api(fn)
    m = req.choices[0].message
    assert req.choices[0].finish_reason == "tool_calls" and m.content is None and m.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in m.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        assert call.id.startswith("call_") and call.type == "function"
    nc = named.choices[0].message.tool_calls
    assert len(nc) == 1 and nc[0].function.name == "get_time"
    jsonschema.validate(json.loads(nc[0].function.arguments), schemas["get_time"])
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    calls = [d.tool_calls for d in deltas if d.tool_calls]
    assert len(calls) == 1 and calls[0][0].index == 0 and calls[0][0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0][0].function.arguments), schemas["get_weather"])
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
    assert not any(d.content for d in deltas)  # the call was held, not streamed as text
    a = auto.choices[0]  # auto: free text here (the model does not answer in the call format)
    assert (a.finish_reason == "tool_calls") == bool(a.message.tool_calls)
    assert a.message.tool_calls or a.message.content
    assert back.choices[0].message.content and back.choices[0].message.tool_calls is None
    assert used == 0


SLOW_DEVICE = DeviceProfile("test-slow", prefill_ms_per_token=40.0)


@pytest.fixture(scope="module")
def cloud(torch_engine, device_model_dir):
    with split_cloud(torch_engine, device_model_dir) as running:
        yield running


@pytest.mark.parametrize("kv_handoff", [False, True])
def test_split_answer_keeps_the_schema_and_equals_cloud_only(cloud, onnx_engine, tokenizer, kv_handoff):
    """The cloud streams the first tokens under the grammar, the device feeds them to its own
    matcher and masks its tokens: the split answer is valid and, greedy, equal to cloud-only and
    device-only token for token."""
    c = CloudFirstClient(cloud_url=cloud.url, engine=onnx_engine, profile=SLOW_DEVICE, target_tpot_ms=30.0, cloud_budget=6,
               kv_handoff=kv_handoff)
    ids = tokenizer.encode_chat(ASK_CITY)
    split = c.complete(ids, max_new_tokens=60, json_schema=CITY)
    cloud_only = c.complete(ids, max_new_tokens=60, json_schema=CITY, mode="cloud-only")
    device_only = c.complete(ids, max_new_tokens=60, json_schema=CITY, mode="device-only")
    assert split.mode == "split" and split.cloud_tokens > 0 and split.device_tokens > 0
    assert split.token_ids == cloud_only.token_ids == device_only.token_ids
    jsonschema.validate(json.loads(split.text), CITY)
    assert split.finish_reason == "stop"
    c.close()


_leaf = st.sampled_from([{"type": "integer"}, {"type": "boolean"}, {"type": "string", "maxLength": 8},
                         {"enum": ["red", "green", "blue"]}, {"type": "number"}, {"type": "null"}])
_schema = st.recursive(_leaf, lambda inner: st.one_of(
    st.dictionaries(st.sampled_from(["a", "b", "name", "id", "x"]), inner, min_size=1, max_size=3).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props),
                       "additionalProperties": False}),
    inner.map(lambda s: {"type": "array", "items": s, "minItems": 1, "maxItems": 3})), max_leaves=5)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=_schema, seed=st.integers(0, 1000))
def test_every_answer_validates_under_random_schemas(torch_engine, tokenizer, schema, seed):
    ids = tokenizer.encode_chat([{"role": "user", "content": "Answer in JSON."}])
    out = generate(torch_engine, ids, SamplingParams(max_new_tokens=96, temperature=1.0, seed=seed,
                                                     grammar=json_schema_grammar(schema)))
    if out.finish_reason == "length":  # cut by max_tokens: a prefix of a valid answer, nothing to validate
        return
    assert out.finish_reason in ("stop", "eos")
    jsonschema.validate(json.loads(tokenizer.decode(out.token_ids, skip_special=True)), schema)


def test_bad_grammar_in_generate_gets_bad_request_naming_it(cloud, torch_engine):
    from relayinfer.protocol.errors import ErrorCode
    from relayinfer.protocol.transport import ws as proto_ws

    async def main():
        ch = await proto_ws.open_channel(cloud.url, torch_engine.fingerprint)
        out = []
        for rid, g in (("regex", Grammar("regex", "(unclosed")), ("kind", Grammar("yaml", "a: 1")),
                       ("false", Grammar("json_schema", "false")),
                       ("big", Grammar("json_schema", '{"type":"integer","maximum":1000000000000000000000000000000}')),
                       ("loop", Grammar("json_schema", '{"$ref":"#"}'))):
            await ch.send(Generate(rid, [1, 2, 3], 8, grammar=g))
            out.append(await asyncio.wait_for(ch.recv(), 30))
        await ch.send(Generate("good", [1, 2, 3], 2, grammar=choice_grammar(["yes", "no"])))  # the session lives on
        frames = [await asyncio.wait_for(ch.recv(), 60) for _ in range(2)]
        await ch.close()
        return out, frames

    errors, frames = asyncio.run(main())
    for err in errors:
        assert err.code == ErrorCode.BAD_REQUEST.value and err.message.startswith("grammar must be"), err
    assert frames[0].request_id == "good" and type(frames[0]).__name__ == "Token"


def test_conversation_turns_keep_the_schema(cloud, onnx_engine):
    """Multi-turn (the device keeps the previous turn's KV): every turn's split answer validates."""
    c = CloudFirstClient(cloud_url=cloud.url, engine=onnx_engine, profile=SLOW_DEVICE, target_tpot_ms=30.0, cloud_budget=4)
    conv = c.conversation(max_new_tokens=60, json_schema=CITY)
    for q in ("Name a big city and its population, as JSON.", "Another city, please."):
        r = conv.send(q)
        jsonschema.validate(json.loads(r.text), CITY)
        assert r.finish_reason == "stop" and r.cloud_tokens > 0
    c.close()


def test_split_answer_the_cloud_completes_before_the_hand_off(cloud, onnx_engine, tokenizer):
    """A grammar the cloud completes within its budget ends the answer at the cloud ('stop', no
    device token), as cloud-only does."""
    c = CloudFirstClient(cloud_url=cloud.url, engine=onnx_engine, profile=SLOW_DEVICE, target_tpot_ms=30.0, cloud_budget=8)
    ids = tokenizer.encode_chat([{"role": "user", "content": "Is fire hot? Answer yes or no."}])
    g = choice_grammar(["yes", "no"])
    split = c.complete(ids, max_new_tokens=16, grammar=g)
    cloud_only = c.complete(ids, max_new_tokens=16, grammar=g, mode="cloud-only")
    assert split.text in ("yes", "no") and split.finish_reason == "stop" and split.fault is None
    assert split.token_ids == cloud_only.token_ids and split.device_tokens == 0
    c.close()


def test_any_json_and_text_that_looks_like_a_control_token(api, tokenizer):
    """`true` is any JSON value; a regex whose only text is a control token's (the end-of-turn
    marker, which ends answers) is refused before any work, naming the field."""
    async def fn(c):
        anyjson = await c.chat.completions.create(model=MODEL, messages=ASK_CITY, temperature=0, max_tokens=40,
                                                  extra_body={"guided_json": True})
        try:
            await c.chat.completions.create(model=MODEL, messages=ASK_CITY, temperature=0, max_tokens=16,
                                            extra_body={"guided_regex": r"<\|im_end\|>"})
            marker = None
        except openai.BadRequestError as e:
            marker = e.body
        return anyjson, marker

    (anyjson, marker), used = api(fn)
    if anyjson.choices[0].finish_reason == "stop":
        json.loads(anyjson.choices[0].message.content)
    assert marker["param"] == "guided_regex" and "control token" in marker["message"]
    assert used == 0


def test_tool_calls_of_a_free_answer_are_checked_against_the_parameters():
    from relayinfer.cloud.serve.openai.structured import parse_tools

    one = parse_tools({"tools": [WEATHER], "parallel_tool_calls": False})
    many = parse_tools({"tools": [WEATHER]})
    good = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
    assert one.calls(good)[0]["function"]["name"] == "get_weather"
    assert one.calls('{"name": "get_weather", "arguments": {}}') is None  # required city/unit missing
    assert one.calls('{"name": "get_weather", "arguments": {"city": "Paris", "unit": "k"}}') is None
    assert one.calls(f"[{good}, {good}]") is None and len(many.calls(f"[{good}, {good}]")) == 2
    assert one.calls('{"name": "other", "arguments": {}}') is None and one.calls("Paris is sunny.") is None


def test_servers_compile_grammars_off_the_event_loop(api, cloud, onnx_engine, torch_engine, tokenizer, monkeypatch):
    """Compiling a grammar (milliseconds to seconds) happens on worker threads on every serving path
    (the OpenAI parse and first-token check, the batching engine, the per-request engine, the split
    service's admission and the device's run), never in a thread running an event loop (which
    streams the other requests meanwhile); the answers still keep the schema."""
    import uuid

    from relayinfer.cloud.engine.per_request import PerRequestEngine
    from relayinfer.protocol.model import grammar as grammar_mod

    calls: list[tuple[str, bool]] = []  # (what compiled, whether its thread runs an event loop)

    def recording(fn, what):
        """`fn` recording each call; for the lru-cached check, each call that compiled (a miss)."""
        def wrapped(*a):
            try:
                asyncio.get_running_loop()
                on_loop = True
            except RuntimeError:
                on_loop = False
            misses = fn.cache_info().misses if hasattr(fn, "cache_info") else None
            out = fn(*a)
            if misses is None or fn.cache_info().misses > misses:
                calls.append((what, on_loop))
            return out
        return wrapped

    monkeypatch.setattr(grammar_mod, "_prototype", recording(grammar_mod._prototype, "matcher"))
    monkeypatch.setattr(grammar_mod, "_compiled", recording(grammar_mod._compiled, "check"))

    def fresh():  # a schema no earlier request compiled (a fresh property name)
        key = f"k{uuid.uuid4().hex[:8]}"
        return key, {"type": "object", "properties": {key: {"type": "integer", "minimum": 0, "maximum": 9}},
                     "required": [key], "additionalProperties": False}

    def answer_keeps(text, key):
        assert list(json.loads(text)) == [key], text

    key, schema = fresh()
    fmt = {"type": "json_schema", "json_schema": {"name": "fresh", "schema": schema, "strict": True}}

    async def chat(client):
        r = await client.chat.completions.create(model=MODEL, messages=ASK_CITY, max_tokens=32, temperature=0,
                                                 response_format=fmt)
        return r.choices[0].message.content

    text, used = api(chat)
    answer_keeps(text, key)
    assert used == 0 and {w for w, _ in calls} == {"check", "matcher"} and not any(on for _, on in calls), calls

    key, schema = fresh()
    p = SamplingParams(max_new_tokens=32, grammar=json_schema_grammar(schema))  # checked (compiled) here
    calls.clear()

    async def per_request():
        per = PerRequestEngine(torch_engine, lambda: None)
        try:
            return [o.token_id async for o in per.generate("r", tokenizer.encode_chat(ASK_CITY), p)]
        finally:
            per.shutdown()

    answer_keeps(tokenizer.decode(asyncio.run(per_request()), skip_special=True), key)
    assert calls and not any(on for _, on in calls), calls

    calls.clear()
    key, schema = fresh()  # the split path: the service's admission and engine, then the device
    c = CloudFirstClient(cloud_url=cloud.url, engine=onnx_engine, profile=DeviceProfile("t", prefill_ms_per_token=40.0),
               cloud_budget=4)
    res = c.complete(tokenizer.encode_chat(ASK_CITY), max_new_tokens=32, grammar=json_schema_grammar(schema))
    answer_keeps(res.text, key)
    assert res.mode == "split" and len(calls) >= 3 and not any(on for _, on in calls), calls


def test_cancel_or_budget_while_the_grammar_compiles_applies(torch_engine, tokenizer, monkeypatch):
    """A request's abort or new cloud budget that comes while its grammar compiles (on a worker
    thread) is applied once it is compiled, on both engines: aborted, nothing is generated and
    nothing is left behind; a budget of 2 ends the answer after 2 tokens."""
    import time

    from relayinfer.cloud.engine.per_request import PerRequestEngine
    from relayinfer.protocol.model import grammar as grammar_mod

    real = grammar_mod.new_guide

    def slow(*a, **kw):  # a compile that takes 0.4 s
        time.sleep(0.4)
        return real(*a, **kw)

    monkeypatch.setattr(grammar_mod, "new_guide", slow)
    ids = tokenizer.encode_chat(ASK_CITY)
    p = SamplingParams(max_new_tokens=24, grammar=json_schema_grammar(CITY))

    async def during_compile(engine, then):
        async def collect():
            return [o async for o in engine.generate("r", ids, p)]
        task = asyncio.create_task(collect())
        await asyncio.sleep(0.1)
        then(engine)
        return await task

    async def batched(then):
        engine = AsyncLLMEngine(LLMEngine(torch_engine, kv_cache_bytes=16 << 20))
        try:
            outs = await during_compile(engine, then)
            for _ in range(50):  # the engine thread frees what it had
                if not engine.engine.has_unfinished():
                    break
                await asyncio.sleep(0.02)
            return outs, engine.engine.block_manager.num_used_blocks, engine._compiling
        finally:
            engine.shutdown()

    async def per_request(then):
        per = PerRequestEngine(torch_engine, lambda: None)
        try:
            return await during_compile(per, then), per._live
        finally:
            per.shutdown()

    outs, used, compiling = asyncio.run(batched(lambda e: e.abort("r")))
    assert outs == [] and used == 0 and compiling == {}
    outs, used, _ = asyncio.run(batched(lambda e: e.set_budget("r", 2)))
    assert [o.finish_reason for o in outs] == [None, "budget"] and used == 0
    outs, live = asyncio.run(per_request(lambda e: e.abort("r")))
    assert outs == [] and live == {}
    outs, _ = asyncio.run(per_request(lambda e: e.set_budget("r", 2)))
    assert [o.finish_reason for o in outs] == [None, "budget"]


def test_shutdown_while_grammars_compile_ends_every_request(torch_engine, tokenizer, monkeypatch):
    """`shutdown()` (off the event loop, as the servers call it) while requests' grammars compile on
    worker threads and another request streams: every one of them raises RuntimeError('the engine
    is shut down') at once, without waiting for the compiles; the compiles that finish afterwards
    add nothing to the engine (no sequence, nothing queued, no KV block held); requests after it
    are refused with the same error. Before that, an abort while a P/D (prefilled) request compiles
    applies as on `generate` (the two share one preparation)."""
    import threading
    import time

    from relayinfer.protocol.model import grammar as grammar_mod

    real = grammar_mod.new_guide
    city = json_schema_grammar(CITY)
    release, ended = threading.Event(), []

    def held(params, *a, **kw):  # CITY compiles end only once the test lets them (after the shutdown)
        try:
            if params.grammar == city:
                release.wait(5.0)
            else:
                time.sleep(0.3)
            return real(params, *a, **kw)
        finally:
            ended.append(params.grammar == city)

    monkeypatch.setattr(grammar_mod, "new_guide", held)
    ids = tokenizer.encode_chat(ASK_CITY)
    p = SamplingParams(max_new_tokens=24, grammar=city)
    write_kv = lambda *a: None  # noqa: E731  never called: no prefilled request is admitted here

    async def main():
        engine = AsyncLLMEngine(LLMEngine(torch_engine, kv_cache_bytes=64 << 20))
        streamed: list[int] = []

        async def stream():  # no grammar: in the batch, generating, when the engine stops
            async for o in engine.generate("s", ids, SamplingParams(max_new_tokens=400), ignore_eos=True):
                streamed.append(o.token_id)

        async def constrained():
            return [o async for o in engine.generate("g", ids, p)]

        async def prefilled(rid, params):
            return [o async for o in engine.generate_prefilled(rid, ids + [1], len(ids), params, write_kv)]

        aborted = asyncio.create_task(prefilled("a", SamplingParams(max_new_tokens=4,
                                                                    grammar=choice_grammar(["yes", "no"]))))
        await asyncio.sleep(0.05)
        engine.abort("a")  # applies once its compile ends: it is never added
        got_aborted = await asyncio.wait_for(aborted, 2.0)
        tasks = [asyncio.create_task(c) for c in (stream(), constrained(), prefilled("p", p))]
        for _ in range(250):
            if streamed:
                break
            await asyncio.sleep(0.02)
        compiling = sorted(engine._compiling)
        t0 = time.monotonic()
        await asyncio.to_thread(engine.shutdown, 5.0)
        ends = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 2.0)
        took = time.monotonic() - t0
        release.set()  # the held compiles end now, after the shutdown
        for _ in range(250):
            if ended.count(True) == 2:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)  # what a late compile would have added
        refused = []
        for params in (SamplingParams(max_new_tokens=2), p):
            try:
                async for _ in engine.generate("late", ids, params):
                    pass
            except RuntimeError as e:
                refused.append(str(e))
        try:
            await engine.warmup()
        except RuntimeError as e:
            refused.append(str(e))
        return engine, streamed, compiling, ends, took, got_aborted, refused

    engine, streamed, compiling, ends, took, got_aborted, refused = asyncio.run(main())
    assert got_aborted == [] and ended == [False, True, True]
    assert streamed and compiling == ["g", "p"]
    assert [type(e) for e in ends] == [RuntimeError] * 3, ends
    assert [str(e) for e in ends] == ["the engine is shut down"] * 3
    assert took < 1.5  # nobody waited for the held compiles
    assert refused == ["the engine is shut down"] * 3
    eng = engine.engine
    assert not eng.seqs and not eng.has_unfinished() and not eng.held and eng.block_manager.num_used_blocks == 0
    assert engine._compiling == {} and engine._queues == {} and engine._thread is None
