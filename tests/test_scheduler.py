"""The scheduler and its postprocess without a model: real chitchat prompts (token ids), a fake
runner that "samples" fixed token ids, and checks of the bookkeeping the engine relies on (tokens
appended, the finish rule, blocks committed, freed and cached, failures kept to their sequence);
then random arrivals and aborts under a small KV cache with the block counts checked every step;
and `EngineMetrics` fed a step's outputs and stats by hand."""
from __future__ import annotations

import random

import numpy as np
import pytest

from relayinfer.cloud.engine.block_manager import BlockManager
from relayinfer.cloud.engine.llm_engine import StepOutput
from relayinfer.cloud.engine.metrics import EngineMetrics, Finished, StepStats
from relayinfer.cloud.engine.scheduler import Scheduler, SchedulerConfig, StepResult
from relayinfer.cloud.engine.sequence import Sequence, SequenceStatus
from relayinfer.protocol.model.decoding import SamplingParams

BS = 16
EOS = 2
VOCAB = 128


@pytest.fixture(scope="module")
def prompts(tokenizer):
    from relayinfer.sdk.datasets import chitchat_prompts_by_length

    return chitchat_prompts_by_length(tokenizer, [40, 70, 110, 150], per_length=2, seed=7)


def scheduler(num_blocks: int = 64, max_tokens: int = 64, prefix: bool = True) -> Scheduler:
    return Scheduler(SchedulerConfig(max_tokens, 16), BlockManager(num_blocks, BS, prefix), EOS)


def fake_run(batch, answers: dict[str, list[int]]):
    """What the engine passes to `postprocess`: per sampling sequence the next id of its scripted
    answer (ids 10.. when the script ran out), and float32 logits [n, VOCAB] peaked at it."""
    toks = [(answers.get(s.seq.request_id) or [])[s.seq.num_output_tokens:][:1] or [10 + s.seq.num_output_tokens]
            for s in batch if s.sample]
    toks = [t[0] for t in toks]
    logits = np.zeros((len(toks), VOCAB), np.float32)
    logits[np.arange(len(toks)), toks] = 5.0
    return toks, logits


def drive(sch: Scheduler, answers: dict[str, list[int]], steps: int = 500) -> dict[str, list[int]]:
    """Schedule + fake run + postprocess until idle; the generated ids per request."""
    out: dict[str, list[int]] = {}
    for _ in range(steps):
        if not sch.has_unfinished():
            return out
        plan = sch.schedule()
        res = sch.postprocess(plan.batch, *fake_run(plan.batch, answers))
        assert not res.failed
        for seq, _ in res.sampled:
            out.setdefault(seq.request_id, []).append(seq.token_ids[-1])
    raise AssertionError("did not finish")


def test_postprocess_appends_decides_the_end_and_frees(prompts):
    sch = scheduler()
    bm = sch.bm
    p = SamplingParams(max_new_tokens=6, stop_ids=(7,))
    seqs = {"eos": Sequence("eos", prompts[0], p, 6), "stop": Sequence("stop", prompts[1], p, 6),
            "length": Sequence("length", prompts[2], p, 6), "budget": Sequence("budget", prompts[3], p, 3)}
    for s in seqs.values():
        sch.add(s)
    answers = {"eos": [11, 12, EOS, 13], "stop": [7], "length": [20, 21, 22, 23, 24, 25, 26]}
    out = drive(sch, answers)
    assert out == {"eos": [11, 12, EOS], "stop": [7], "length": [20, 21, 22, 23, 24, 25],
                   "budget": [10, 11, 12]}
    assert {r: s.finish_reason for r, s in seqs.items()} == {r: r for r in seqs}
    assert all(s.status is SequenceStatus.FINISHED and not s.block_table for s in seqs.values())
    assert bm.num_free_blocks == bm.num_blocks and not sch.running and not sch.waiting
    # every full block of every sequence went to the prefix cache under its chain hash
    for s in seqs.values():
        full = (len(s.token_ids) - 1) // BS  # the last token is sampled, never computed
        assert all(h in bm.cached for h in s.block_hashes[:full])
    assert bm.num_cached_free_blocks == bm.scan_cached_free_blocks() > 0


def test_postprocess_counts_prefill_chunks_and_latencies(prompts):
    """A 110-token prompt under a 48-token step budget: three chunks, then a token per step."""
    sch = scheduler(max_tokens=48)
    seq = Sequence("a", prompts[4], SamplingParams(max_new_tokens=3), 3)
    sch.add(seq)
    results: list[StepResult] = []
    plans = []
    while sch.has_unfinished():
        plans.append(sch.schedule())
        results.append(sch.postprocess(plans[-1].batch, *fake_run(plans[-1].batch, {})))
    n = len(prompts[4])
    chunks = -(-n // 48)
    assert [r.prefill_tokens for r in results] == [min(48, n - 48 * i) for i in range(chunks)] + [0, 0]
    assert sum(r.prefill_tokens for r in results) == n
    assert [len(r.sampled) for r in results] == [0] * (chunks - 1) + [1, 1, 1]
    assert [len(r.ttft_s) for r in results] == [0] * (chunks - 1) + [1, 0, 0]
    assert [len(r.tpot_s) for r in results] == [0] * chunks + [1, 1]
    assert [len(pl.queue_s) for pl in plans] == [1] + [0] * (len(plans) - 1)
    assert plans[0].prefix_query_tokens == n and plans[0].prefix_hit_tokens == 0
    assert seq.token_ids[n:] == [10, 11, 12] and seq.finish_reason == "length"


def test_a_failing_sequence_is_reported_and_left_to_the_engine(prompts):
    sch = scheduler(max_tokens=256)
    a, b = (Sequence(r, prompts[i], SamplingParams(max_new_tokens=4), 4) for i, r in enumerate("ab"))
    sch.add(a)
    sch.add(b)
    plan = sch.schedule()
    toks, logits = fake_run(plan.batch, {})
    boom = ValueError("sampling failed for b")
    res = sch.postprocess(plan.batch, [toks[0], boom], logits)
    assert [s for s, _ in res.sampled] == [a] and res.failed == [(b, boom)]
    assert a.token_ids[-1] == 10 and len(b.token_ids) == len(prompts[1])  # b got no token
    assert b in sch.running and b.block_table  # the engine fails it: finish('error') frees it
    sch.finish(b, "error")
    assert b not in sch.running and not b.block_table and b.finish_reason == "error"


def test_kept_blocks_stay_until_freed(prompts):
    sch = scheduler()
    seq = Sequence("p", prompts[0], SamplingParams(max_new_tokens=1), 1, hold_kv=True)
    sch.add(seq)
    assert drive(sch, {}) == {"p": [10]}
    assert seq.finish_reason == "length" and seq.keeps_blocks
    assert len(seq.block_table) == -(-len(prompts[0]) // BS) and sch.bm.num_used_blocks == len(seq.block_table)
    sch.bm.free_sequence(seq)
    assert sch.bm.num_used_blocks == 0


def test_identical_prompts_in_one_step_cache_every_block_through_decode(prompts):
    """Two equal prompts prefilled in the same step, then different answers: a third request
    made of the second's prompt + answer finds every full block, its decode blocks included."""
    sch = scheduler(max_tokens=256)
    a, b = (Sequence(r, prompts[1], SamplingParams(max_new_tokens=40), 40) for r in "ab")
    sch.add(a)
    sch.add(b)
    out = drive(sch, {"a": list(range(20, 60)), "b": list(range(30, 70))})
    assert out["b"] == list(range(30, 70))
    c = Sequence("c", list(b.token_ids) + [5], SamplingParams(max_new_tokens=1), 1)
    sch.add(c)
    plan = sch.schedule()
    assert len(plan.batch) == 1  # both were admitted, and prefilled, in the first step
    computed = len(b.token_ids) - 1  # b's last token was sampled, never computed
    assert plan.prefix_hit_tokens == computed // BS * BS > len(prompts[1])
    assert c.block_hashes[:len(c.block_table)] == b.block_hashes[:len(c.block_table)]


def test_random_arrivals_and_aborts_keep_block_counts_consistent(prompts):
    """Requests arrive and are aborted at random steps on a cache too small for all of them
    (preemption), with prefix caching; after every step the block ref counts equal the block
    tables' references, each running sequence's table covers its computed tokens, and at the
    end every block is free and each finished answer is its script."""
    rng = random.Random(3)
    sch = scheduler(num_blocks=40, max_tokens=96)
    bm = sch.bm
    pending = [Sequence(f"r{i}", prompts[i % len(prompts)], SamplingParams(max_new_tokens=rng.randint(1, 24)), 24)
               for i in range(24)]
    scripts = {s.request_id: [rng.randrange(10, 64) for _ in range(24)] for s in pending}
    live: list[Sequence] = []
    preempted = 0
    for step in range(2000):
        if not pending and not sch.has_unfinished():
            break
        while pending and rng.random() < 0.4:
            live.append(pending.pop(0))
            sch.add(live[-1])
        if live and rng.random() < 0.05:
            victim = live.pop(rng.randrange(len(live)))
            if not victim.is_finished:
                sch.finish(victim, "abort")
        plan = sch.schedule()
        preempted += plan.preempted
        res = sch.postprocess(plan.batch, *fake_run(plan.batch, scripts))
        assert not res.failed
        refs = [0] * bm.num_blocks
        for s in sch.running:
            assert len(s.block_table) * BS >= s.num_computed_tokens
            for bid in s.block_table:
                refs[bid] += 1
        for s in sch.waiting:
            assert not s.block_table
        assert [b.ref_count for b in bm.blocks] == refs
        assert bm.num_free_blocks == refs.count(0)
        assert bm.num_cached_free_blocks == bm.scan_cached_free_blocks()
    assert not sch.has_unfinished() and not pending
    assert bm.num_free_blocks == bm.num_blocks and preempted > 0 and preempted == sch.num_preemptions
    for s in live:
        if s.finish_reason == "length":
            assert s.output_ids == scripts[s.request_id][:s.params.max_new_tokens]


def test_engine_metrics_observe_a_step():
    m = EngineMetrics()
    outs = [StepOutput("a", 5, 0, None), StepOutput("b", EOS, 3, "eos")]
    st = StepStats(batch_seqs=2, batch_tokens=40, prefill_tokens=39, queue_s=(0.02,), ttft_s=(0.3,), tpot_s=(0.05,),
                   prefix_query_tokens=64, prefix_hit_tokens=16, preemptions=1,
                   finished=[Finished("eos", 1.5, 30, 4)], blocks_used=7, blocks_cached=3,
                   running=1, waiting=2)
    m.observe(outs, st)
    m.observe([], StepStats(prefix_query_tokens=64, prefix_hit_tokens=48))
    v = m.registry.get_sample_value
    assert v("relayinfer_engine_generation_tokens_total") == 2 and v("relayinfer_engine_prefill_tokens_total") == 39
    assert v("relayinfer_engine_batch_size_count") == 1 and v("relayinfer_engine_batch_tokens_sum") == 40
    assert v("relayinfer_engine_ttft_seconds_sum") == 0.3 and v("relayinfer_engine_tpot_seconds_count") == 1
    assert v("relayinfer_engine_queue_seconds_bucket", {"le": "0.025"}) == 1
    assert v("relayinfer_engine_preemptions_total") == 1
    assert v("relayinfer_engine_prefix_cache_hit_tokens_total") == 64
    assert v("relayinfer_engine_prefix_cache_hit_rate") == 0.5
    assert v("relayinfer_engine_requests_total", {"reason": "eos"}) == 1
    assert v("relayinfer_engine_request_success_total", {"finished_reason": "stop"}) == 1
    assert v("relayinfer_engine_e2e_request_latency_seconds_sum") == 1.5
    assert v("relayinfer_engine_request_generation_tokens_sum") == 4
    # the gauges hold the state after the last step
    assert (v("relayinfer_engine_kv_blocks_used"), v("relayinfer_engine_running")) == (0, 0)
