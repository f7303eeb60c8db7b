"""The one engine interface (cloud/engine/interface.py): the batching engine, the per-request engine
and the P/D engine implement `EngineClient`, and the per-request engine streams what the batching
engine streams for the same greedy request on the real model."""
from __future__ import annotations

import asyncio
import inspect

import pytest

from relayinfer.cloud.engine.interface import EngineClient, EngineLimits, KVParts, RefinedIndices
from relayinfer.cloud.engine.llm_engine import AsyncLLMEngine, LLMEngine, StepOutput
from relayinfer.cloud.engine.per_request import KeptKVStore, PerRequestEngine
from relayinfer.protocol.model.decoding import SamplingParams
from relayinfer.protocol.transport.limits import MemoryBudget
from relayinfer.protocol.model.refine import TemplateMarkers
from relayinfer.protocol.model.tokenizer import Tokenizer

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)
MEMBERS = [n for n in dir(EngineClient) if not n.startswith("_")]


def run(coro, timeout=300):
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="module")
def per_request(torch_engine, model_path):
    markers = TemplateMarkers.from_tokenizer(Tokenizer.from_gguf(model_path))
    return PerRequestEngine(torch_engine, lambda: markers)


def _pd_engine(torch_engine):
    from test_pd import gateway

    from relayinfer.cloud.pd.service import PDEngine

    blocks = (16 << 20) // (16 * 46080)
    return PDEngine(gateway(torch_engine, n_prefill=1, n_decode=1), torch_engine.cfg,
                    min(torch_engine.context_length, blocks * 16), blocks, model=torch_engine.model)


def _check_signature(impl, name: str) -> None:
    """`impl.name` accepts every parameter of the Protocol's member by the same name, kind and
    default, in the same order; its own extra parameters have defaults."""
    want = inspect.signature(getattr(EngineClient, name))
    got = inspect.signature(getattr(type(impl), name))
    wp, gp = list(want.parameters.values()), list(got.parameters.values())
    assert [p.name for p in gp[:len(wp)]] == [p.name for p in wp], (type(impl).__name__, name, got)
    for w, g in zip(wp, gp):
        assert g.kind == w.kind and g.default == w.default, (type(impl).__name__, name, w, g)
    assert all(p.default is not inspect.Parameter.empty or p.kind is p.VAR_KEYWORD for p in gp[len(wp):]), got
    assert inspect.iscoroutinefunction(getattr(type(impl), name)) == inspect.iscoroutinefunction(
        getattr(EngineClient, name)), (type(impl).__name__, name)


def test_three_engines_implement_the_protocol(torch_engine, per_request):
    llm = AsyncLLMEngine(LLMEngine(torch_engine, kv_cache_bytes=8 << 20))
    pd = _pd_engine(torch_engine)
    assert set(MEMBERS) >= {"generate", "abort", "set_budget", "request_stats", "limits", "prefill_tok_s",
                            "metrics_registry", "health", "state", "warmup", "shutdown"}
    for impl in (llm, per_request, pd):
        assert isinstance(impl, EngineClient), type(impl).__name__
        for name in MEMBERS:
            if inspect.isfunction(getattr(EngineClient, name)):
                _check_signature(impl, name)
        assert inspect.isasyncgenfunction(type(impl).generate), type(impl).__name__
        assert impl.health() is None
    cap = llm.engine.num_blocks * llm.engine.block_size
    assert llm.limits == EngineLimits(8192, 49152, cap, kv_pool_bytes=cap * torch_engine.cfg.kv_bytes_per_token)
    assert llm.limits.max_request_tokens == min(8192, cap) and llm.metrics_registry is llm.metrics.registry
    assert per_request.limits == EngineLimits(8192, 49152) and per_request.limits.max_request_tokens == 8192
    assert pd.limits.kv_capacity_tokens == pd.engine.num_blocks * 16 and pd.limits.kv_pool_bytes == 0
    assert not isinstance(torch_engine, EngineClient)  # the model runtime is no engine client


async def _collect(engine, rid, ids, params, budget=None, **kw):
    return [o async for o in engine.generate(rid, ids, params, budget, **kw)]


def test_per_request_engine_streams_what_the_batching_engine_streams(torch_engine, per_request, chat_prompt_ids):
    ids = chat_prompt_ids[2]

    async def main():
        llm = AsyncLLMEngine(LLMEngine(torch_engine, kv_cache_bytes=8 << 20))
        try:
            batched = await _collect(llm, "b", ids, GREEDY)
            cut = await _collect(llm, "bc", ids, GREEDY, 3)
        finally:
            llm.shutdown()
        alone = await _collect(per_request, "p", ids, GREEDY)
        alone_cut = await _collect(per_request, "pc", ids, GREEDY, 3)
        return batched, cut, alone, alone_cut

    batched, cut, alone, alone_cut = run(main())
    assert [o.token_id for o in alone] == [o.token_id for o in batched] and len(batched) == 12
    assert [o.index for o in alone] == list(range(12))
    assert alone[-1].finish_reason == batched[-1].finish_reason == "length"
    assert all(o.finish_reason is None for o in alone[:-1])
    # a cloud budget of 3 ends the stream at token 3 with 'budget' on both engines
    assert [(o.token_id, o.finish_reason) for o in alone_cut] == [(o.token_id, o.finish_reason) for o in cut]
    assert [o.finish_reason for o in alone_cut] == [None, None, "budget"]


def test_per_request_extras_follow_token_0_and_the_session_kv_is_reused(torch_engine, per_request, chat_prompt_ids):
    ids = chat_prompt_ids[0]
    store = KeptKVStore(MemoryBudget(1 << 30), 8192, lambda: torch_engine.cfg.kv_bytes_per_token)
    slot = store.slot()

    async def main():
        refined = await _collect(per_request, "r", ids, GREEDY, 2, refine=0.5)
        handed = await _collect(per_request, "k", ids, GREEDY, 2, kv_from=4)
        first = await _collect(per_request, "t0", ids, GREEDY, session=slot)
        kept = store.kept_tokens
        gen = per_request.generate("t1", ids + [first[0].token_id], GREEDY, session=slot)
        out0 = await gen.__anext__()
        hit = per_request.request_stats("t1").prefix_hit_tokens
        per_request.abort("t1")  # ends without a finish reason; its KV is kept for the next turn
        rest = [o async for o in gen]
        return refined, handed, kept, out0, hit, rest

    refined, handed, kept, out0, hit, rest = run(main())
    assert [type(o) for o in refined] == [StepOutput, RefinedIndices, StepOutput]
    kept_idx = refined[1].kept
    assert 0 < len(kept_idx) < len(ids) and kept_idx == sorted(set(kept_idx))
    assert [type(o) for o in handed] == [StepOutput, KVParts, StepOutput]
    parts = handed[1].messages
    assert parts[0].token_start == 4 and sum(p.num_tokens for p in parts) == len(ids) - 1 - 4
    assert kept == len(ids) + GREEDY.max_new_tokens - 1  # prompt + the answer tokens whose KV was computed
    assert hit == len(ids) and isinstance(out0, StepOutput) and out0.index == 0
    assert all(o.finish_reason is None for o in rest) and len(rest) <= 1
    assert store.kept_tokens > 0
    slot.close()
    assert store.kept_tokens == 0 and per_request.request_stats("t1").prefix_hit_tokens == len(ids)
    assert per_request.request_stats("never") is None
