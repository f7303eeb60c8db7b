"""P/D serving in one process: prefill -> KV hand-off -> decode equals aggregated serving token for
token in both transfer modes (prefix-cache hits included), on-demand forwarding vs the push router,
faults with retries, and a device split session through the P/D service."""
from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from relayinfer.cloud.engine.llm_engine import LLMEngine
from relayinfer.cloud.pd.gateway import Gateway, Group, GroupSpec, LocalHandle, PDError, Scenario, local_groups
from relayinfer.cloud.pd.instance import Instance, InstanceConfig
from relayinfer.cloud.pd.kv import from_messages, to_messages
from relayinfer.cloud.pd.service import wait_idle
from relayinfer.protocol.model.decoding import SamplingParams

GREEDY = SamplingParams(max_new_tokens=6)


@pytest.fixture(scope="module")
def prompts(chat_prompt_ids, tokenizer):
    from relayinfer.sdk.datasets import chitchat_prompts_by_length

    # the second chat prompt shares the system turn with the first; the last repeats the first
    return list(chat_prompt_ids[:2]) + chitchat_prompts_by_length(tokenizer, [90], per_length=1) + [chat_prompt_ids[0]]


@pytest.fixture(scope="module")
def aggregated(torch_engine, prompts):
    """The aggregated engine's greedy answers (one LLMEngine, continuous batching)."""
    return LLMEngine(torch_engine, kv_cache_bytes=16 << 20).generate(prompts, GREEDY)


def cfg(**kw) -> InstanceConfig:
    return InstanceConfig(kv_cache_bytes=16 << 20, **kw)


def test_pd_equals_aggregated_in_both_transfer_modes(torch_engine, prompts, aggregated):
    async def main(mode):
        p, d = Instance(torch_engine, "p", "prefill", cfg(transfer=mode)), Instance(torch_engine, "d", "decode", cfg())
        out, payloads = [], []
        try:
            for i, ids in enumerate(prompts):
                ho = await p.prefill(f"r{i}", ids, GREEDY)
                payloads.append(ho.kv)
                toks = [ho.new_token] + [o.token_id async for o in d.decode(ho)]
                out.append(toks)
            hits = [d.engine.request_stats(f"r{i}").prefix_hit_tokens for i in range(len(prompts))]
            return out, payloads, hits, p.load(), d.load()
        finally:
            p.shutdown()
            d.shutdown()

    runs = {mode: asyncio.run(main(mode)) for mode in ("contiguous", "block-fixed")}
    for mode, (out, payloads, hits, pl, dl) in runs.items():
        assert out == aggregated, mode
        # the decode instance's own prefix cache: the repeated prompt reuses every full block it received
        assert hits[-1] == (len(prompts[-1]) // 16) * 16 and hits[1] >= 16, (mode, hits)
        assert pl["kv_blocks_used"] == dl["kv_blocks_used"] == 0 and pl["held"] == 0
    (_, con, _, pc, dc), (_, blk, _, pb, db) = runs["contiguous"][:5], runs["block-fixed"][:5]
    per_token = 2 * torch_engine.cfg.n_layers * torch_engine.cfg.n_kv_heads * torch_engine.cfg.head_dim * 4
    for c, b, ids in zip(con, blk, prompts):
        assert c.nbytes == b.nbytes == len(ids) * per_token  # same bytes moved in both modes
        assert c.num_objects == 1 and b.num_objects == -(-len(ids) // 16)
        np.testing.assert_array_equal(np.concatenate(b.parts, axis=3), c.parts[0])
    assert pc["kv_bytes_out"] == pb["kv_bytes_out"] == dc["kv_bytes_in"] == db["kv_bytes_in"]
    # the KV payload travels as protocol messages too (one frame, or one per block)
    back = from_messages(to_messages(blk[0], "r0"))
    assert back.mode == "block-fixed" and np.array_equal(np.concatenate(back.parts, axis=3), con[0].parts[0])


def gateway(torch_engine, n_prefill=2, n_decode=1, **kw) -> Gateway:
    return Gateway(local_groups(torch_engine, [GroupSpec(Scenario("chat", 5000, 500), n_prefill, n_decode)],
                                cfg()), **kw)


async def collect(gw, rid, ids, **kw):
    return [o.token_id async for o in gw.generate(rid, ids, GREEDY, **kw)]


def test_on_demand_forwarding_rejects_and_tries_next_push_uses_stale_reports(torch_engine, prompts, aggregated):
    async def main(forwarding):
        gw = gateway(torch_engine, forwarding=forwarding)
        await gw.start()
        p0, p1 = (h.instance for h in gw.groups[0].prefill)
        try:
            p0.outstanding["someone-else"] = 10 ** 6  # p0's real queue: far beyond any TTFT budget
            gw.reports = {"chat-p0": {"queued_prefill_tokens": 0}, "chat-p1": {"queued_prefill_tokens": 500}}
            gw.report_interval_s = 1e9  # the push router's view stays this stale one
            toks = await collect(gw, "a", prompts[1])
            assert toks == aggregated[1]
            return p0.counters, p1.counters, gw.metrics.registry
        finally:
            p0.outstanding.clear()
            await gw.stop()

    c0, c1, reg = asyncio.run(main("on-demand"))
    assert c0["rejected"] == 1 and c0["prefills"] == 0 and c1["prefills"] == 1
    assert reg.get_sample_value("relayinfer_pd_forward_rejections_total", {"group": "chat"}) == 1
    c0, c1, reg = asyncio.run(main("push"))  # the stale report sends it to the loaded instance
    assert c0["prefills"] == 1 and c0["rejected"] == 0 and c1["prefills"] == 0


def test_every_instance_rejecting_forces_the_shortest_wait(torch_engine, prompts, aggregated):
    async def main():
        gw = gateway(torch_engine, retry_backoff_s=0.05)
        gw.groups[0].scenario.ttft_slo_ms = 200.0
        p0, p1 = (h.instance for h in gw.groups[0].prefill)
        p0.outstanding["x"], p1.outstanding["y"] = 10 ** 6, 2 * 10 ** 6
        try:
            t0 = time.perf_counter()
            toks = await collect(gw, "a", prompts[0])
            return toks, time.perf_counter() - t0, p0.counters, gw.metrics.registry
        finally:
            await gw.stop()

    toks, wall, c0, reg = asyncio.run(main())
    assert toks == aggregated[0] and c0["prefills"] == 1  # p0 reported the shorter wait
    assert reg.get_sample_value("relayinfer_pd_forward_forced_total", {"group": "chat"}) == 1
    assert reg.get_sample_value("relayinfer_pd_forward_rejections_total", {"group": "chat"}) >= 4


def test_faults_are_retried_and_leave_no_kv(torch_engine, prompts, aggregated):
    async def main():
        gw = gateway(torch_engine, n_decode=2, max_retries=2)
        await gw.start()
        (p0, p1), (d0, d1) = ([h.instance for h in hs] for hs in (gw.groups[0].prefill, gw.groups[0].decode))
        try:
            p0.set_fault(die_after_export=1)
            p1.set_fault(die_after_export=1)
            a = await collect(gw, "a", prompts[1])       # both prefill instances die once: retried twice
            d0.set_fault(die_after_tokens=3)
            d1.set_fault(die_after_tokens=3)
            b = await collect(gw, "b", prompts[2])       # the decode dies after 3 tokens: resumed elsewhere
            p0.set_fault(die_after_export=5)
            p1.set_fault(die_after_export=5)
            with pytest.raises(PDError, match="failed after 2 retries.*died"):
                await collect(gw, "c", prompts[0])
            reports = await wait_idle(gw)
            return a, b, reports, gw.metrics.registry
        finally:
            await gw.stop()

    a, b, reports, reg = asyncio.run(main())
    assert a == aggregated[1] and b == aggregated[2]
    assert reg.get_sample_value("relayinfer_pd_retries_total", {"group": "chat"}) == 2 + 1 + 3
    assert reg.get_sample_value("relayinfer_pd_requests_total", {"group": "chat", "outcome": "error"}) == 1
    assert all(r["kv_blocks_used"] == 0 and r["held"] == 0 and r["running"] == 0 for r in reports.values()), reports


def test_classification_by_tag_and_length(torch_engine):
    short, long_ = Scenario("chat", 1000, 100, max_prompt_tokens=512), Scenario("long", 8000, 200)
    gw = Gateway([Group(short), Group(long_)])
    assert gw.classify(100).name == "chat" and gw.classify(3000).name == "long"
    assert gw.classify(100, tag="long").name == "long" and gw.classify(100, tag="nope").name == "chat"


# --- the split service on the P/D pools ----------------------------------------------------------

@pytest.fixture(scope="module")
def pd_cloud(torch_engine):
    from relayinfer.cloud.pd.service import PDEngine, PDService
    from relayinfer.cloud.serve.service import ServiceThread

    gw = gateway(torch_engine, n_prefill=1, n_decode=1)
    blocks = (16 << 20) // (16 * 46080)
    llm = PDEngine(gw, torch_engine.cfg, min(torch_engine.context_length, blocks * 16), blocks, model=torch_engine.model)
    with ServiceThread(PDService(torch_engine, torch_engine.fingerprint, llm=llm)) as running:
        yield running


def test_split_session_through_pd_gateway(pd_cloud, onnx_engine, chat_prompt_ids, torch_engine):
    from test_split import BUDGET, client

    MAX_NEW = 12
    ref = torch_engine.generate(chat_prompt_ids[2], SamplingParams(max_new_tokens=MAX_NEW)).token_ids
    gw = pd_cloud.llm.gateway
    p, d = gw.groups[0].prefill[0].instance, gw.groups[0].decode[0].instance
    c = client(pd_cloud, onnx_engine)
    split = c.complete(chat_prompt_ids[2], max_new_tokens=MAX_NEW)
    assert split.token_ids == ref and split.cloud_tokens <= BUDGET
    assert gw.metrics.registry.get_sample_value("relayinfer_pd_requests_total", {"group": "chat", "outcome": "error"}) \
        is None
    # (on a loaded machine the paced device may still win the race to the first token: device-only)
    assert split.mode == "device-only" or (split.mode == "split" and split.cloud_tokens > 0), (split.mode, split.fault)
    assert d.counters["decodes"] == 0 and p.counters["generates"] == 1  # the device never used a decode instance
    cloud_only = c.complete(chat_prompt_ids[2], max_new_tokens=MAX_NEW, mode="cloud-only")
    assert cloud_only.token_ids == ref and d.counters["decodes"] == 1  # no budget: prefill -> KV -> decode
    deadline = time.monotonic() + 30
    while (p.load()["kv_blocks_used"] or d.load()["kv_blocks_used"] or pd_cloud.metrics.active_requests._value.get()) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert p.load()["kv_blocks_used"] == d.load()["kv_blocks_used"] == 0  # after Stop nothing is left
    assert pd_cloud.metrics.active_requests._value.get() == 0


def test_ratio_model_and_hysteresis():
    from relayinfer.cloud.pd.ratio import Hysteresis, PerfModel, Workload, best_ratio, decode_capacity, prefill_capacity

    perf = PerfModel(prefill_tok_s=2000.0, decode_a_ms=20.0, decode_c_ms=2.0, max_batch=64)
    long_prompts = Workload(mean_prompt_tokens=4000, mean_output_tokens=20, ttft_slo_ms=6000, tpot_slo_ms=100)
    chat = Workload(mean_prompt_tokens=200, mean_output_tokens=200, ttft_slo_ms=1000, tpot_slo_ms=100)
    # M/D/1 at the SLO: service 2 s, T 6 s -> rho* = 2 (6 - 2) / (12 - 2) = 0.8 -> 0.4 req/s per instance
    assert prefill_capacity(1, long_prompts, perf) == pytest.approx(0.4)
    # b* = (100 - 20) / 2 = 40 sequences, step 100 ms, 199 tokens -> 40 / 19.9 s per instance
    assert decode_capacity(1, chat, perf) == pytest.approx(40 / 19.9)
    n_p_long, n_d_long, cap_long = best_ratio(8, long_prompts, perf)
    n_p_chat, n_d_chat, cap_chat = best_ratio(8, chat, perf)
    assert n_p_long > n_d_long and n_p_chat < n_d_chat  # prompt-heavy vs answer-heavy scenarios
    assert cap_long == pytest.approx(min(prefill_capacity(n_p_long, long_prompts, perf),
                                         decode_capacity(n_d_long, long_prompts, perf)))
    h = Hysteresis(patience=2, cooldown_s=10.0, slack=0.7)
    bad_ttft = dict(ttft_p90=1500, tpot_p90=50, ttft_slo=1000, tpot_slo=100, n_p=2, n_d=4)
    assert h.observe(0.0, **bad_ttft) is None            # one window is not enough
    assert h.observe(5.0, **bad_ttft) == "to_prefill"    # two in a row: move a decode instance to prefill
    assert h.observe(10.0, **bad_ttft) is None and h.observe(12.0, **bad_ttft) is None  # patience and cooldown
    assert h.observe(20.0, **bad_ttft) == "to_prefill"
    assert h.observe(30.0, **{**bad_ttft, "tpot_p90": 90}) is None  # no slack on the decode side: stay
    assert h.observe(40.0, **{**bad_ttft, "n_d": 1}) is None        # never below one per role


def test_ratio_controller_moves_an_instance_between_roles():
    from relayinfer.cloud.pd.ratio import RatioController

    class Handle:
        def __init__(self, name, role):
            self.name, self.role = name, role

        async def set_role(self, role):
            self.role = role

    g = Group(Scenario("chat", 1000, 100), [Handle("p0", "prefill")], [Handle("d0", "decode"), Handle("d1", "decode")])
    gw = Gateway([g])
    gw.reports = {"d0": {"running": 5}, "d1": {"running": 1}}
    ctl = RatioController(gw, patience=1, cooldown_s=0.0)
    g.ttft_ms.extend([2000.0] * 10)  # TTFT p90 2 s > 1 s SLO, TPOT 10 ms: decode has slack
    g.tpot_ms.extend([10.0] * 10)
    moves = asyncio.run(ctl.step(now=0.0))
    assert [(m["instance"], m["to"]) for m in moves] == [("d1", "prefill")]  # the least busy one
    assert g.ratio == "2P:1D" and g.prefill[1].role == "prefill" and not g.ttft_ms
    assert gw.metrics.registry.get_sample_value("relayinfer_pd_instances", {"group": "chat", "role": "prefill"}) == 2
    g.ttft_ms.extend([2000.0] * 10)
    assert asyncio.run(ctl.step(now=1.0)) == []  # one decode instance left: never below one per role


def test_instances_that_cannot_all_be_placed_are_refused_up_front(monkeypatch):
    """More Ray CPUs asked than the cluster has: ValueError at once, naming the counts and the
    --actor-cpus that fits, before any actor starts (Ray itself would leave them pending for ever)."""
    import ray

    from relayinfer.cloud.pd.ray_pool import RayPool

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    monkeypatch.setattr(ray, "available_resources", lambda: {"CPU": 2.0})
    monkeypatch.setattr(ray, "put", lambda *a: pytest.fail("an actor was started"))
    specs = [GroupSpec(Scenario("chat", 5000, 500), 1, 1), GroupSpec(Scenario("long", 9000, 500), 1, 1)]
    with pytest.raises(ValueError, match=r"4 instances x 1 Ray CPUs each = 4 CPUs asked; the Ray cluster has 2 .*"
                                         r"only 2 can be placed: pass --actor-cpus 0.5"):
        RayPool(None, specs, actor_cpus=1.0)


def test_pd_moves_a_bfloat16_kv_cache_bit_for_bit(torch_engine, prompts):
    """An engine in bfloat16 (as on a GPU): the prefill instance's KV payload is bfloat16 (half the
    float32 bytes), it travels as "bfloat16" protocol frames and back bit for bit, and P/D answers
    equal the same engine serving the prompts one after another, in both transfer modes. (In turn,
    not each on a fresh engine: a prompt whose prefix is cached attends over the cached keys in
    another kernel, and in bfloat16 that can flip a near-tied token, docs/SERVING.md.)"""
    import torch

    from relayinfer.cloud.engine.torch_engine import TorchEngine
    from relayinfer.cloud.pd.kv import _tensor

    half = TorchEngine(torch_engine.model_path, threads=1, dtype="bfloat16")
    one = LLMEngine(half, kv_cache_bytes=16 << 20)  # in turn, as the prefill instance gets them: prompt 1 reuses
    alone = [one.generate([ids], GREEDY)[0] for ids in prompts[:3]]  # prompt 0's cached system turn there too

    async def main(mode):
        p, d = Instance(half, "p", "prefill", cfg(transfer=mode)), Instance(half, "d", "decode", cfg())
        out, payloads = [], []
        try:
            for i, ids in enumerate(prompts[:3]):
                ho = await p.prefill(f"r{i}", ids, GREEDY)
                payloads.append(ho.kv)
                out.append([ho.new_token] + [o.token_id async for o in d.decode(ho)])
            return out, payloads
        finally:
            p.shutdown()
            d.shutdown()

    per_token = 2 * half.cfg.n_layers * half.cfg.n_kv_heads * half.cfg.head_dim * 2
    for mode in ("contiguous", "block-fixed"):
        out, payloads = asyncio.run(main(mode))
        assert out == alone, mode
        for pl, ids in zip(payloads, prompts):
            assert pl.nbytes == len(ids) * per_token and pl.parts[0].dtype.name == "bfloat16"
        msgs = to_messages(payloads[0], "r0")
        assert {m.kv.dtype for m in msgs} == {"bfloat16"}
        back = from_messages(msgs)
        for a, b in zip(back.parts, payloads[0].parts):
            assert a.dtype.name == "bfloat16" and _tensor(a).dtype == torch.bfloat16  # typed again, not uint16
            assert torch.equal(_tensor(a).view(torch.int16), _tensor(b).view(torch.int16))
    # what Ray actors rebuild the model from keeps the dtype: the same weights, bit for bit
    from relayinfer.cloud.pd.ray_pool import build_model, model_weights

    rebuilt = build_model(*model_weights(half.model))
    for (name, a), b in zip(half.model.state_dict().items(), rebuilt.state_dict().values()):
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b), name
