"""Prefix-aware routing on the P/D gateway: the routing table (block-hash chains, LRU bound, load
slack), and a 6-turn chat through the P/D service with two prefill and two decode instances that
reuses as many prompt tokens from the cache as the same chat on one engine (`cloud serve`)."""
from __future__ import annotations

import pytest

from relayinfer.cloud.pd.prefix import PrefixRouter, block_chain
from relayinfer.protocol.model.decoding import SamplingParams

TURNS = 6
MAX_NEW = 8


class H:
    def __init__(self, name):
        self.name = name


def test_block_chain_is_the_engine_prefix_cache_hash(torch_engine, chat_prompt_ids):
    from relayinfer.cloud.engine.llm_engine import LLMEngine

    ids = list(chat_prompt_ids[0])
    eng = LLMEngine(torch_engine, kv_cache_bytes=8 << 20)
    eng.generate([ids], SamplingParams(max_new_tokens=2))
    chain = block_chain(ids, eng.block_size)
    assert len(chain) == len(ids) // eng.block_size >= 2
    assert all(h in eng.block_manager.cached for h in chain)  # the gateway's hashes are the engine's
    assert block_chain([ids[0] + 1] + ids[1:], 16)[1] != chain[1]  # chained: block 0 changes every later hash
    with pytest.raises(ValueError, match="block_size"):
        block_chain(ids, 0)


def test_router_prefers_the_longest_prefix_within_the_load_slack():
    r = PrefixRouter(block_size=4, max_blocks=100, slack=2)
    a, b, c = H("a"), H("b"), H("c")
    conv = list(range(40))
    r.record(r.chain(conv[:20]), "b")   # b holds 5 blocks of it
    r.record(r.chain(conv[:8]), "c")    # c holds 2
    chain = r.chain(conv)
    assert r.overlap(chain, "b") == 5 and r.overlap(chain, "c") == 2 and r.overlap(chain, "a") == 0
    assert r.order(chain, [a, b, c], {}) == [b, a, c]                          # longest overlap first
    assert r.order(chain, [a, b, c], {"a": 0, "b": 2, "c": 0})[0] is b        # 2 more in flight: within slack
    assert r.order(chain, [a, b, c], {"a": 0, "b": 3, "c": 0})[0] is c        # 3 more: the next best within it
    assert r.order(chain, [a, b, c], {"a": 0, "b": 3, "c": 3}) == [a, b, c]   # none within: the load order
    assert r.order(r.chain(list(range(100, 140))), [a, b, c], {}) == [a, b, c]  # no overlap: the load order
    r.forget("b")
    assert r.overlap(chain, "b") == 0 and r.order(chain, [a, b, c], {})[0] is c
    off = PrefixRouter(block_size=4, enabled=False)
    off.record(off.chain(conv), "b")
    assert len(off) == 0 and off.order(chain, [a, b, c], {}) == [a, b, c]


def test_router_table_is_bounded_lru():
    r = PrefixRouter(block_size=2, max_blocks=10, slack=0)
    old, new = list(range(0, 12)), list(range(100, 112))  # 6 blocks each
    r.record(r.chain(old), "a")
    r.record(r.chain(new), "b")
    assert len(r) == 10  # capped: old's first blocks went first
    assert r.overlap(r.chain(old), "a") == 0 and r.overlap(r.chain(new), "b") == 6
    r.order(r.chain(old[:8]), [H("a")], {})  # no hit on a's evicted head: nothing refreshed
    for i in range(50):
        r.record(r.chain(list(range(1000 + 2 * i, 1002 + 2 * i))), f"x{i}")
    assert len(r) == 10
    with pytest.raises(ValueError, match="max_blocks"):
        PrefixRouter(max_blocks=0)


# --- a multi-turn chat through the service --------------------------------------------------------

def _chat_turns(tokenizer, n: int) -> list[str]:
    from relayinfer.sdk.datasets import chitchat_prompt

    for i in range(50):
        users = [m["content"] for m in chitchat_prompt(i, max_turns=2 * n) if m["role"] == "user"]
        if len(users) >= n:
            return users[:n]
    raise AssertionError("no chitchat conversation with enough user turns")


def _run_chat(svc, onnx_engine, tokenizer, turns: list[str]) -> tuple[list[int], list[list[int]]]:
    """Each turn cloud-only over the service's websocket; (cloud cached tokens, answer ids) per turn."""
    from relayinfer.sdk.client import Client

    c = Client(cloud_url=svc.url, engine=onnx_engine, cloud_budget=None, kv_handoff=False)
    msgs, cached, answers = [], [], []
    try:
        for text in turns:
            msgs.append({"role": "user", "content": text})
            res = c.complete(tokenizer.encode_chat(msgs), max_new_tokens=MAX_NEW, mode="cloud-only")
            assert res.fault is None, res.error
            cached.append(res.cloud_cached_tokens)
            answers.append(res.token_ids)
            msgs.append({"role": "assistant", "content": tokenizer.decode(res.token_ids)})
    finally:
        c.close()
    return cached, answers


def _pd_service(torch_engine, prefix_routing: bool):
    from relayinfer.cloud.pd.gateway import Gateway, GroupSpec, Scenario, local_groups
    from relayinfer.cloud.pd.instance import InstanceConfig
    from relayinfer.cloud.pd.service import PDEngine, PDService

    gw = Gateway(local_groups(torch_engine, [GroupSpec(Scenario("chat", 60000, 5000), 2, 2)],
                              InstanceConfig(kv_cache_bytes=16 << 20)), prefix_routing=prefix_routing)
    blocks = (16 << 20) // (16 * torch_engine.cfg.kv_bytes_per_token)
    llm = PDEngine(gw, torch_engine.cfg, min(torch_engine.context_length, blocks * 16), blocks, model=torch_engine.model)
    return PDService(torch_engine, torch_engine.fingerprint, llm=llm)


@pytest.fixture(scope="module")
def one_engine_chat(torch_engine, onnx_engine, tokenizer):
    """The chat on `cloud serve` with one batching engine: (turns, cached tokens, answers)."""
    from relayinfer.cloud.engine.llm_engine import AsyncLLMEngine, LLMEngine
    from relayinfer.cloud.serve.service import CloudService, ServiceThread

    turns = _chat_turns(tokenizer, TURNS)
    one = CloudService(torch_engine, torch_engine.fingerprint,
                       llm=AsyncLLMEngine(LLMEngine(torch_engine, kv_cache_bytes=16 << 20)))
    with ServiceThread(one, http_port=None) as svc:
        return (turns, *_run_chat(svc, onnx_engine, tokenizer, turns))


def _pd_chat(torch_engine, onnx_engine, tokenizer, turns, prefix_routing: bool):
    from relayinfer.cloud.serve.service import ServiceThread

    with ServiceThread(_pd_service(torch_engine, prefix_routing), http_port=None) as svc:
        cached, answers = _run_chat(svc, onnx_engine, tokenizer, turns)
        gw = svc.llm.gateway
        counters = {h.name: dict(h.instance.counters) for h in gw.handles}
        return cached, answers, gw.metrics.registry, counters


def test_multi_turn_chat_through_pd_reuses_the_cache_like_one_engine(torch_engine, onnx_engine, tokenizer,
                                                                       one_engine_chat):
    turns, ref_cached, ref_answers = one_engine_chat
    cached, answers, reg, counters = _pd_chat(torch_engine, onnx_engine, tokenizer, turns, True)
    assert answers == ref_answers  # greedy: P/D answers equal the single engine's
    assert sum(ref_cached) > 0 and cached == ref_cached, (cached, ref_cached)  # turn by turn
    value = lambda name: reg.get_sample_value(name, {"group": "chat"}) or 0  # noqa: E731
    assert value("relayinfer_pd_prefix_hit_tokens_total") == sum(cached)
    prefills = sorted(counters[n]["prefills"] for n in ("chat-p0", "chat-p1"))
    local = value("relayinfer_pd_local_prefills_total")
    # the conversation stuck to one prefill instance, then to the decode instance that holds its
    # last answer (local prefill there): the other prefill instance never saw it
    assert prefills[0] == 0 and prefills[1] + local == TURNS and local >= 1
    assert sum(counters[n]["generates"] for n in ("chat-d0", "chat-d1")) == local
    assert sorted(counters[n]["decodes"] + counters[n]["generates"] for n in ("chat-d0", "chat-d1")) == [0, TURNS]


def test_round_robin_reuses_less_than_prefix_routing(torch_engine, onnx_engine, tokenizer, one_engine_chat):
    turns, ref_cached, ref_answers = one_engine_chat
    cached, answers, _, counters = _pd_chat(torch_engine, onnx_engine, tokenizer, turns, False)
    assert answers == ref_answers
    assert sorted(counters[n]["prefills"] for n in ("chat-p0", "chat-p1")) == [TURNS // 2, TURNS - TURNS // 2]
    assert 0 < sum(cached) < sum(ref_cached), (cached, ref_cached)
