"""Determinism as a property of the batching engine: a seeded (or greedy) request's answer is the
same token for token whatever else runs beside it and however its work is cut and shared: alone,
beside 3-7 other requests of other lengths joining at other steps, as one of n choices of a
prompt, after a prefix-cache hit, under a small chunked-prefill budget, and when preempted.
Answers are short (20 tokens, EOS ignored) to keep the real model cheap on CPU. Every test runs on
both weight formats of the engine: the dequantized fp32 weights and the file's 4-bit blocks
(`weights='gguf'`, torch's int4 kernel)."""
from __future__ import annotations

import pytest

from relayinfer.cloud.engine.llm_engine import LLMEngine
from relayinfer.cloud.engine.metrics import EngineMetrics
from relayinfer.protocol.model.decoding import SamplingParams

BS = 16
N = 20
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_new_tokens=N)
GREEDY = SamplingParams(max_new_tokens=N)


@pytest.fixture(scope="module", params=["fp32", "gguf"])
def torch_engine(request, torch_engine):
    """The session's fp32 engine, then one on the file's 4-bit blocks."""
    if request.param == "fp32":
        return torch_engine
    from relayinfer.cloud.engine.torch_engine import TorchEngine

    return TorchEngine(torch_engine.model_path, threads=1, weights="gguf")


@pytest.fixture(scope="module")
def target(tokenizer):
    """A chat prompt spanning several KV blocks (about 70 tokens)."""
    from relayinfer.sdk.datasets import chitchat_prompts_by_length

    return chitchat_prompts_by_length(tokenizer, [70], per_length=1, seed=11)[0]


@pytest.fixture(scope="module")
def others(tokenizer):
    """Seven prompts of different lengths (about 35 to 260 tokens)."""
    from relayinfer.sdk.datasets import chitchat_prompts_by_length

    return chitchat_prompts_by_length(tokenizer, [35, 45, 90, 130, 170, 200, 240], per_length=1, seed=5)


def engine_for(torch_engine, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_bytes", 64 << 20)
    return LLMEngine(torch_engine, block_size=BS, **kw)


def run(engine: LLMEngine, schedule: dict[int, list[tuple[str, list[int], SamplingParams]]],
        after_first: dict[str, list[tuple[str, list[int], SamplingParams]]] | None = None,
        metrics: EngineMetrics | None = None) -> dict[str, list[int]]:
    """Step `engine` to completion, adding requests at the given step numbers, and those in
    `after_first[rid]` right after request `rid` produced its first token (each step observed by
    `metrics` when given); tokens per request."""
    after_first = dict(after_first or {})
    out: dict[str, list[int]] = {}

    def add(items):
        for rid, ids, sp in items:
            engine.add_request(rid, ids, sp, ignore_eos=True)
            out[rid] = []

    step = 0
    while schedule or after_first or engine.has_unfinished():
        add(schedule.pop(step, []))
        outs = engine.step()
        if metrics is not None:
            metrics.observe(outs, engine.last_stats)
        for o in outs:
            assert o.index == len(out[o.request_id])
            out[o.request_id].append(o.token_id)
            if o.index == 0:
                add(after_first.pop(o.request_id, []))
        step += 1
        assert step < 3000
    assert engine.block_manager.num_used_blocks == 0
    return out


@pytest.fixture(scope="module")
def alone(torch_engine, target):
    """The seeded and the greedy answer of `target`, each run alone on a fresh engine."""
    return {name: run(engine_for(torch_engine), {0: [(name, target, sp)]})[name]
            for name, sp in (("seeded", SEEDED), ("greedy", GREEDY))}


def test_alone_twice_is_the_same(torch_engine, target, alone):
    assert len(alone["seeded"]) == len(alone["greedy"]) == N
    assert alone["seeded"] != alone["greedy"]  # the seeded request does sample
    again = run(engine_for(torch_engine, enable_prefix_caching=False), {0: [("s", target, SEEDED)]})
    assert again["s"] == alone["seeded"]


def test_beside_other_requests_of_other_lengths(torch_engine, target, others, alone):
    """The target with 3, then up to 7 others: some start with it, some join while it decodes,
    sampled others with their own seeds; and once joining while the others decode."""
    other_sp = [SamplingParams(temperature=0.7, seed=i, max_new_tokens=16 + i) if i % 2 else
                SamplingParams(max_new_tokens=16 + i) for i in range(len(others))]
    sched = {0: [("seeded", target, SEEDED), ("greedy", target, GREEDY)]
             + [(f"o{i}", others[i], other_sp[i]) for i in range(3)],
             2: [(f"o{i}", others[i], other_sp[i]) for i in range(3, 5)],
             5: [(f"o{i}", others[i], other_sp[i]) for i in range(5, 7)]}
    out = run(engine_for(torch_engine, max_num_batched_tokens=256), sched)
    assert out["seeded"] == alone["seeded"] and out["greedy"] == alone["greedy"]
    late = {0: [(f"o{i}", others[i], other_sp[i]) for i in range(4)], 4: [("seeded", target, SEEDED)]}
    assert run(engine_for(torch_engine, enable_prefix_caching=False), late)["seeded"] == alone["seeded"]


def test_identical_requests_in_one_step_then_prefix_hits_through_decode_blocks(torch_engine, target, alone):
    """Two identical seeded requests prefilled in the same step give the same answer; afterwards
    a request whose prompt is the target's prompt + answer finds every full block in the prefix
    cache, the blocks filled by decode included."""
    engine = engine_for(torch_engine)
    metrics = EngineMetrics(engine)
    out = run(engine, {0: [("a", target, SEEDED), ("b", target, SEEDED)]}, metrics=metrics)
    assert out["a"] == out["b"] == alone["seeded"]
    longer = list(target) + out["b"] + [target[-1]]
    out2 = run(engine, {0: [("c", longer, GREEDY)]}, metrics=metrics)
    hit = engine.request_stats("c").prefix_hit_tokens
    assert hit == ((len(longer) - 1) // BS) * BS > len(target)
    assert metrics.registry.get_sample_value("relayinfer_engine_prefix_cache_hit_tokens_total") == hit
    assert len(out2["c"]) == N


def test_n_choices_and_after_a_prefix_hit(torch_engine, target, alone):
    """As choice 0 of n = 4 (the forks join on its cached prompt blocks after its first token),
    and as a fork itself after another choice of the same prompt cached them."""
    engine = engine_for(torch_engine)
    forks = [(f"f{j}", target, SamplingParams(temperature=0.9, top_p=0.95, seed=j, max_new_tokens=N))
             for j in range(1, 4)]
    out = run(engine, {0: [("c0", target, SEEDED)]}, after_first={"c0": forks})
    assert out["c0"] == alone["seeded"]
    assert all(engine.request_stats(f"f{j}").prefix_hit_tokens == ((len(target) - 1) // BS) * BS
               for j in range(1, 4))
    first = [("first", target, SamplingParams(temperature=0.9, seed=99, max_new_tokens=N))]
    out = run(engine, {0: first}, after_first={"first": [("seeded", target, SEEDED), ("greedy", target, GREEDY)]})
    assert out["seeded"] == alone["seeded"] and out["greedy"] == alone["greedy"]
    assert engine.request_stats("seeded").prefix_hit_tokens > 0


def test_small_chunked_prefill_budget_and_preemption(torch_engine, target, others, alone):
    """Prefill cut into chunks of 8 tokens (not a multiple of the block), beside others; then a KV
    cache so small that running sequences are preempted and recomputed."""
    sched = {0: [(f"o{i}", others[i], GREEDY) for i in (1, 3)] + [("seeded", target, SEEDED)],
             1: [("greedy", target, GREEDY)]}
    out = run(engine_for(torch_engine, max_num_batched_tokens=8), sched)
    assert out["seeded"] == alone["seeded"] and out["greedy"] == alone["greedy"]
    probe = engine_for(torch_engine)
    per_block = BS * probe.kv_bytes_per_token
    need = -(-(len(others[4]) + N) // BS)
    engine = engine_for(torch_engine, kv_cache_bytes=(need + 2) * per_block, max_num_batched_tokens=64)
    sched = {0: [(f"o{i}", others[i], GREEDY) for i in (4, 2)] + [("seeded", target, SEEDED)],
             1: [("greedy", target, GREEDY)]}
    out = run(engine, sched)
    assert engine.scheduler.num_preemptions > 0
    assert out["seeded"] == alone["seeded"] and out["greedy"] == alone["greedy"]


def test_after_a_longer_prompt_cached_its_prefix(torch_engine, target, alone):
    """The target's prompt blocks first computed as the start of a longer prompt (prefill of 90
    tokens, not 70): its answers are still the ones it gets alone. On the file's 4-bit blocks this
    needs prefill rows to attend as decode rows do (`ModelRunner.row_invariant`): SDPA's causal
    kernel blocks by the chunk's length, and bf16-rounded matmul inputs turned its ~1e-5 differences
    in K into other tokens from token 13 on."""
    engine = engine_for(torch_engine)
    run(engine, {0: [("longer", list(target) + [13] * 20, GREEDY)]})
    out = run(engine, {0: [("seeded", target, SEEDED), ("greedy", target, GREEDY)]})
    assert engine.request_stats("seeded").prefix_hit_tokens >= BS
    assert out["seeded"] == alone["seeded"] and out["greedy"] == alone["greedy"]
