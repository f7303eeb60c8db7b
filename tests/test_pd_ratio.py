"""The ratio controller across scenario groups: an idle instance of a group with slack is lent to a
group that misses its TTFT SLO and cannot fix it by itself, after the imbalance lasted
`borrow_patience` windows, and given back once the borrower is calm; with real requests in flight
on both groups none is lost."""
from __future__ import annotations

import asyncio

import pytest

from relayinfer.cloud.pd.gateway import Gateway, Group, GroupSpec, Scenario, local_groups
from relayinfer.cloud.pd.ratio import RatioController
from relayinfer.protocol.model.decoding import SamplingParams


class Handle:
    def __init__(self, name, role):
        self.name, self.role = name, role

    async def set_role(self, role):
        self.role = role


def two_groups():
    chat = Group(Scenario("chat", 1000, 100), [Handle("c-p0", "prefill")], [Handle("c-d0", "decode")])
    long_ = Group(Scenario("long", 8000, 200), [Handle("l-p0", "prefill"), Handle("l-p1", "prefill")],
                  [Handle("l-d0", "decode")])
    gw = Gateway([chat, long_])
    gw.reports = {h.name: {"running": 0, "queued_requests": 0} for h in gw.handles}
    return gw, chat, long_


def window(g, ttft_ms, tpot_ms=10.0):
    g.ttft_ms.extend([ttft_ms] * 10)
    g.tpot_ms.extend([tpot_ms] * 10)


def test_idle_instance_is_lent_after_sustained_imbalance_and_given_back():
    gw, chat, long_ = two_groups()
    ctl = RatioController(gw, borrow_patience=3, return_patience=2, cooldown_s=0.0, patience=1)
    for t in range(2):  # chat: TTFT 2 s > 1 s; its one decode instance cannot move: it needs a prefill one
        window(chat, 2000.0)
        assert asyncio.run(ctl.step(now=float(t))) == []
    gw.reports["l-p0"]["running"] = 1  # busy: not lent
    window(chat, 2000.0)
    moves = asyncio.run(ctl.step(now=2.0))
    assert [(m["kind"], m["instance"], m["from"], m["group"], m["to"]) for m in moves] == \
        [("lend", "l-p1", "long", "chat", "prefill")]
    assert chat.ratio == "2P:1D" and long_.ratio == "1P:1D" and chat.prefill[1].role == "prefill"
    reg = gw.metrics.registry
    assert reg.get_sample_value("relayinfer_pd_ratio_moves_total", {"kind": "lend", "src": "long", "dst": "chat"}) == 1
    assert reg.get_sample_value("relayinfer_pd_instances", {"group": "long", "role": "prefill"}) == 1
    window(chat, 2000.0)  # still missing, but the lender keeps one prefill instance: nothing more to lend
    assert asyncio.run(ctl.step(now=3.0)) == [] and len(ctl.loans) == 1
    window(chat, 300.0)
    assert asyncio.run(ctl.step(now=4.0)) == []  # calm for one window: return_patience is 2
    window(chat, 300.0)
    moves = asyncio.run(ctl.step(now=5.0))
    assert [(m["kind"], m["instance"], m["group"], m["to"]) for m in moves] == [("return", "l-p1", "long", "prefill")]
    assert chat.ratio == "1P:1D" and long_.ratio == "2P:1D" and not ctl.loans
    assert reg.get_sample_value("relayinfer_pd_ratio_moves_total", {"kind": "return", "src": "chat", "dst": "long"}) == 1


def test_no_loan_without_a_lender_with_slack_or_when_the_group_can_fix_itself():
    gw, chat, long_ = two_groups()
    ctl = RatioController(gw, borrow_patience=1, cooldown_s=0.0, patience=5)
    window(chat, 2000.0)
    window(long_, 7000.0)  # long is near its own TTFT SLO (7 s of 8 s > 0.7 x): no slack to lend
    assert asyncio.run(ctl.step(now=0.0)) == []
    chat.decode.append(Handle("c-d1", "decode"))  # now chat could move a decode instance itself
    window(chat, 2000.0)
    assert asyncio.run(ctl.step(now=1.0)) == [] and not ctl.loans
    with pytest.raises(ValueError, match="borrow_patience"):
        RatioController(gw, borrow_patience=0)


def test_lending_with_real_requests_in_flight_loses_none(torch_engine, chat_prompt_ids):
    from relayinfer.cloud.engine.llm_engine import LLMEngine
    from relayinfer.cloud.pd.instance import InstanceConfig
    from relayinfer.cloud.pd.service import wait_idle

    params = SamplingParams(max_new_tokens=8)
    prompts = list(chat_prompt_ids[:3])
    ref = LLMEngine(torch_engine, kv_cache_bytes=16 << 20).generate(prompts, params)

    async def main():
        gw = Gateway(local_groups(torch_engine, [GroupSpec(Scenario("chat", 60000, 5000), 1, 1),
                                                 GroupSpec(Scenario("long", 60000, 5000), 2, 1)],
                                  InstanceConfig(kv_cache_bytes=16 << 20)))
        await gw.start()
        chat, long_ = gw.groups
        ctl = RatioController(gw, borrow_patience=2, return_patience=1, cooldown_s=0.0, patience=1)

        async def one(rid, ids, tag):
            return [o.token_id async for o in gw.generate(rid, ids, params, tag=tag)]

        try:
            # requests on both groups while the imbalance builds and the loan is made
            first = [asyncio.create_task(one(f"a{i}", ids, "long")) for i, ids in enumerate(prompts)]
            moves, t = [], 0
            while not any(m["kind"] == "lend" for m in moves) and t < 200:  # bounded: ~4 s at most
                window(chat, 90000.0)  # chat misses its TTFT SLO (fake numbers), long has slack
                await gw.refresh_reports()  # a long prefill instance is idle once its prefills are done
                moves += await ctl.step(now=float(t))
                t += 1
                await asyncio.sleep(0.02)
            lent = [m for m in moves if m["kind"] == "lend"]
            assert len(lent) == 1 and chat.ratio == "2P:1D" and long_.ratio == "1P:1D", moves
            second = [asyncio.create_task(one(f"b{i}", ids, "chat")) for i, ids in enumerate(prompts * 2)]
            outs_a, outs_b = await asyncio.gather(asyncio.gather(*first), asyncio.gather(*second))
            borrowed = next(h for h in chat.prefill if h.name == lent[0]["instance"])
            served = borrowed.instance.counters["prefills"]
            window(chat, 100.0)
            await wait_idle(gw)
            back = await ctl.step(now=1000.0)
            third = await asyncio.gather(*(one(f"c{i}", ids, "long") for i, ids in enumerate(prompts)))
            reports = await wait_idle(gw)
            return outs_a, outs_b, third, served, back, reports, gw.metrics.registry
        finally:
            await gw.stop()

    outs_a, outs_b, third, served, back, reports, reg = asyncio.run(main())
    assert outs_a == ref and outs_b == ref * 2 and third == ref  # every request answered, greedy-exact
    assert served >= 1  # the lent instance prefilled chat requests
    assert [(m["kind"], m["group"]) for m in back] == [("return", "long")]
    assert reg.get_sample_value("relayinfer_pd_requests_total", {"group": "chat", "outcome": "ok"}) == 6
    assert reg.get_sample_value("relayinfer_pd_requests_total", {"group": "long", "outcome": "ok"}) == 6
    assert reg.get_sample_value("relayinfer_pd_requests_total", {"group": "chat", "outcome": "error"}) is None
    assert all(r["kv_blocks_used"] == 0 and r["held"] == 0 for r in reports.values()), reports
