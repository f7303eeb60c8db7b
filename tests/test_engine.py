"""Continuous-batching engine: greedy equality with one-request-at-a-time `TorchEngine`, prefix
reuse, preemption under a small KV budget, cancellation, the asyncio wrapper, and the block
manager's bookkeeping on its own."""
from __future__ import annotations

import asyncio

import pytest
from prometheus_client import generate_latest

from relayinfer.cloud.engine.block_manager import BlockManager
from relayinfer.cloud.engine.llm_engine import AsyncLLMEngine, LLMEngine, StepOutput
from relayinfer.cloud.engine.metrics import EngineMetrics
from relayinfer.cloud.engine.model_runner import kv_bytes_per_token
from relayinfer.cloud.engine.sequence import Sequence
from relayinfer.protocol.model.decoding import SamplingParams

GREEDY = SamplingParams(max_new_tokens=16)
BS = 16


@pytest.fixture(scope="module")
def prompts(chat_prompt_ids, tokenizer):
    from relayinfer.sdk.datasets import chitchat_prompts_by_length

    return list(chat_prompt_ids) + chitchat_prompts_by_length(tokenizer, [70, 160], per_length=1)


@pytest.fixture(scope="module")
def reference(torch_engine, prompts):
    """Greedy tokens of each prompt generated alone (fp32, batch 1)."""
    return [torch_engine.generate(p, GREEDY).token_ids for p in prompts]


def step(engine: LLMEngine, m: EngineMetrics) -> list[StepOutput]:
    """One engine step, its outputs and stats fed to `m` (as `AsyncLLMEngine` does)."""
    outs = engine.step()
    m.observe(outs, engine.last_stats)
    return outs


def run_all(engine: LLMEngine, schedule: dict[int, list[tuple[str, list[int]]]],
            m: EngineMetrics | None = None) -> dict[str, list[int]]:
    """Step the engine to completion, adding requests at the given step numbers; tokens per id,
    checking answer indices arrive in order. Metrics go to `m` (a new one when None)."""
    m = m if m is not None else EngineMetrics(engine)
    out: dict[str, list[int]] = {}
    n = 0
    while schedule or engine.has_unfinished():
        for rid, ids in schedule.pop(n, []):
            engine.add_request(rid, ids, GREEDY)
            out[rid] = []
        for o in step(engine, m):
            assert o.index == len(out[o.request_id])
            out[o.request_id].append(o.token_id)
        n += 1
        assert n < 2000
    return out


def metric(m: EngineMetrics, name: str, labels: dict | None = None) -> float:
    return m.registry.get_sample_value(name, labels or {})


def test_batch_equals_single_with_chunked_prefill_and_mid_flight_join(torch_engine, prompts, reference):
    engine = LLMEngine(torch_engine, kv_cache_bytes=32 << 20, block_size=BS, max_num_batched_tokens=48)
    m = EngineMetrics(engine)
    # two requests start, the others join while those are decoding (step 3 and step 6)
    sched = {0: [("r0", prompts[0]), ("r3", prompts[3])], 3: [("r1", prompts[1]), ("r4", prompts[4])],
             6: [("r2", prompts[2])]}
    out = run_all(engine, sched, m)
    for i, ref in enumerate(reference):
        assert out[f"r{i}"] == ref, f"prompt {i}"
    # the late joiners found the shared system turn in the prefix cache and did not recompute it
    assert all(engine.request_stats(r).prefix_hit_tokens >= BS for r in ("r1", "r2", "r4"))
    # chunked prefill: no step computed more than the 48-token budget, yet the 160-token prompt ran
    assert len(prompts[4]) > 48
    assert metric(m, "relayinfer_engine_batch_tokens_bucket", {"le": "64.0"}) == \
        metric(m, "relayinfer_engine_batch_tokens_count")
    assert engine.block_manager.num_used_blocks == 0
    assert metric(m, "relayinfer_engine_generation_tokens_total") == sum(map(len, reference))


def test_concurrent_chitchat_prompts_batched_decode_token_identical(torch_engine, tokenizer, prompts, reference):
    """Eight chat prompts of ~30-230 tokens at once: after their prefill every step decodes all of
    them in one padded attention call per layer (keys of different lengths, key-padding mask);
    each answer equals the per-request model's (`TorchEngine` alone), token for token."""
    from relayinfer.sdk.datasets import chitchat_prompts_by_length

    extra = chitchat_prompts_by_length(tokenizer, [50, 110, 230], per_length=1, seed=3)
    every = list(prompts) + extra
    refs = list(reference) + [torch_engine.generate(p, GREEDY).token_ids for p in extra]
    assert len({len(p) for p in every}) == len(every)  # all lengths differ
    engine = LLMEngine(torch_engine, kv_cache_bytes=96 << 20, block_size=BS, max_num_batched_tokens=1024,
                       enable_prefix_caching=False)
    m = EngineMetrics(engine)
    out = run_all(engine, {0: [(f"r{i}", p) for i, p in enumerate(every)]}, m)
    for i, ref in enumerate(refs):
        assert out[f"r{i}"] == ref, f"prompt {i} ({len(every[i])} tokens)"
    # one step prefills all eight, then decode-only steps until the longest answer ends
    assert metric(m, "relayinfer_engine_batch_tokens_bucket", {"le": "1024.0"}) - \
        metric(m, "relayinfer_engine_batch_tokens_bucket", {"le": "16.0"}) == 1
    assert metric(m, "relayinfer_engine_batch_size_count") == max(map(len, refs))


def test_prefix_reuse_counts_and_tokens(torch_engine, prompts, reference):
    engine = LLMEngine(torch_engine, kv_cache_bytes=32 << 20, block_size=BS)
    m = EngineMetrics(engine)
    a, b = prompts[0], prompts[1]
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)  # shared system turn + header
    assert common >= BS
    assert run_all(engine, {0: [("a", a)]}, m)["a"] == reference[0]
    assert engine.request_stats("a").prefix_hit_tokens == 0
    prefill_before = metric(m, "relayinfer_engine_prefill_tokens_total")
    assert prefill_before == len(a)
    assert run_all(engine, {0: [("b", b)]}, m)["b"] == reference[1]
    hits = engine.request_stats("b").prefix_hit_tokens
    assert hits == (common // BS) * BS > 0
    assert metric(m, "relayinfer_engine_prefill_tokens_total") - prefill_before == len(b) - hits
    # the same prompt again: every full block but the one holding the last token is reused
    assert run_all(engine, {0: [("a2", a)]}, m)["a2"] == reference[0]
    assert engine.request_stats("a2").prefix_hit_tokens == ((len(a) - 1) // BS) * BS
    assert metric(m, "relayinfer_engine_prefix_cache_hit_tokens_total") == hits + ((len(a) - 1) // BS) * BS
    queries = len(a) + len(b) + len(a)
    assert metric(m, "relayinfer_engine_prefix_cache_query_tokens_total") == queries
    assert metric(m, "relayinfer_engine_prefix_cache_hit_rate") == pytest.approx(
        (hits + ((len(a) - 1) // BS) * BS) / queries)


def test_preemption_under_small_budget_loses_nothing(torch_engine, prompts, reference):
    per_block = BS * kv_bytes_per_token(torch_engine.cfg)
    longest = max(-(-(len(p) + GREEDY.max_new_tokens) // BS) for p in prompts)
    engine = LLMEngine(torch_engine, kv_cache_bytes=(longest + 1) * per_block, block_size=BS,
                       max_num_batched_tokens=128)
    m = EngineMetrics(engine)
    total_need = sum(-(-(len(p) + GREEDY.max_new_tokens) // BS) for p in prompts)
    assert engine.num_blocks < total_need / 2  # the load does not fit at once
    out = run_all(engine, {0: [(f"r{i}", p) for i, p in enumerate(prompts)]}, m)
    for i, ref in enumerate(reference):
        assert out[f"r{i}"] == ref, f"prompt {i}"
    pre = metric(m, "relayinfer_engine_preemptions_total")
    assert pre > 0 and pre == sum(engine.request_stats(f"r{i}").num_preemptions for i in range(len(prompts)))
    assert pre == engine.scheduler.num_preemptions
    assert sum(metric(m, "relayinfer_engine_requests_total", {"reason": r}) or 0
               for r in ("length", "eos")) == len(prompts)
    assert engine.block_manager.num_used_blocks == 0


def test_abort_frees_blocks_at_next_step(torch_engine, prompts):
    engine = LLMEngine(torch_engine, kv_cache_bytes=32 << 20, block_size=BS, enable_prefix_caching=False)
    m = EngineMetrics(engine)
    bm = engine.block_manager
    engine.add_request("keep", prompts[0], GREEDY)
    engine.add_request("drop", prompts[4], GREEDY)
    for _ in range(3):
        step(engine, m)
    held = len(engine.seqs["drop"].block_table)
    assert held >= len(prompts[4]) // BS  # its prompt is prefilled (one 256-token step)
    free_before = bm.num_free_blocks
    engine.abort("drop")
    assert all(o.request_id == "keep" for o in step(engine, m))
    # the step freed drop's blocks; keep may have taken at most one block for its next token
    assert bm.num_free_blocks >= free_before + held - 1
    assert "drop" not in engine.seqs and engine.request_stats("drop").finish_reason == "abort"
    while engine.has_unfinished():
        step(engine, m)
    assert bm.num_free_blocks == bm.num_blocks
    assert metric(m, "relayinfer_engine_requests_total", {"reason": "abort"}) == 1
    assert metric(m, "relayinfer_engine_request_success_total", {"finished_reason": "abort"}) == 1


def test_cloud_budget_and_metrics_text(torch_engine, prompts, reference):
    engine = LLMEngine(torch_engine, kv_cache_bytes=8 << 20, block_size=BS)
    m = EngineMetrics(engine)
    engine.add_request("b", prompts[1], GREEDY, cloud_budget=5)
    outs = []
    while engine.has_unfinished():
        outs += step(engine, m)
    assert [o.token_id for o in outs] == reference[1][:5] and outs[-1].finish_reason == "budget"
    assert metric(m, "relayinfer_engine_request_success_total", {"finished_reason": "length"}) == 1
    assert metric(m, "relayinfer_engine_tpot_seconds_count") == 4
    text = generate_latest(m.registry).decode()
    cfg = torch_engine.cfg
    assert f"relayinfer_engine_kv_bytes_per_token {float(2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4)}" in text
    assert "relayinfer_engine_ttft_seconds_count 1.0" in text
    assert "relayinfer_engine_kv_blocks " in text and "relayinfer_engine_prefix_cache_hit_rate" in text


def test_async_engine_streams_and_aborts(torch_engine, prompts, reference):
    async def main():
        eng = AsyncLLMEngine(LLMEngine(torch_engine, kv_cache_bytes=16 << 20, block_size=BS))

        async def collect(rid, ids, limit=None):
            got = []
            async for o in eng.generate(rid, ids, GREEDY):
                got.append(o.token_id)
                if limit and len(got) == limit:
                    break  # leaving the loop aborts the request
            return got

        try:
            full0, full2, cut = await asyncio.gather(collect("a", prompts[0]), collect("c", prompts[2]),
                                                     collect("x", prompts[3], limit=3))
        finally:
            eng.shutdown()
        return eng, full0, full2, cut

    eng, full0, full2, cut = asyncio.run(main())
    assert full0 == reference[0] and full2 == reference[2] and cut == reference[3][:3]
    assert eng.engine.block_manager.num_used_blocks == 0 and not eng.engine.seqs
    # the wrapper feeds its metrics after every step (and the aborts applied at shutdown)
    reg = eng.metrics.registry
    assert reg.get_sample_value("relayinfer_engine_requests_total", {"reason": "abort"}) == 1
    assert reg.get_sample_value("relayinfer_engine_ttft_seconds_count") == 3
    assert reg.get_sample_value("relayinfer_engine_generation_tokens_total") >= len(full0) + len(full2) + 3


def test_block_manager_prefix_refcount_and_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = Sequence("a", [1, 2, 3, 4, 5], GREEDY, 4)
    assert bm.match_prefix(a) == 0 and bm.allocate(a, 5) and len(a.block_table) == 3
    a.num_computed_tokens = 5
    bm.commit(a, 0)  # blocks [1,2] and [3,4] become cached
    b = Sequence("b", [1, 2, 3, 4, 9], GREEDY, 4)
    assert bm.match_prefix(b) == 4 and b.block_table == a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    bm.allocate(b, 1)
    assert bm.num_free_blocks == 0 and not bm.allocate(b, 3) and len(b.block_table) == 3
    bm.free_sequence(a)
    bm.free_sequence(b)
    assert bm.num_free_blocks == 4 and bm.num_cached_free_blocks == 2
    # new allocations take the uncached blocks first, then evict the prefix tail before its head
    c = Sequence("c", [7, 7, 7, 7, 7, 7, 7], GREEDY, 1)
    bm.allocate(c, 6)
    assert bm.num_cached_free_blocks == 1 and bm.evictions == 1
    d = Sequence("d", [1, 2, 3, 4, 6], GREEDY, 1)
    assert bm.match_prefix(d) == 2  # head block [1,2] still cached, [3,4] evicted


def test_seeded_sampling_matches_single(torch_engine, prompts):
    """Sampling is seeded per answer position, so a seeded request draws the same tokens batched."""
    sp = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_new_tokens=12)
    ref = torch_engine.generate(prompts[1], sp).token_ids
    engine = LLMEngine(torch_engine, kv_cache_bytes=8 << 20, block_size=BS)
    got = engine.generate([prompts[1], prompts[0]], [sp, GREEDY])
    assert got[0] == ref




def test_packed_linears_equal_the_dense_model(torch_engine, prompts):
    """The CPU engine's linears run on oneDNN pre-packed weights (`llama.PackedLinear`); the state
    dict gives the dense weights back bit for bit, and the model's logits over a chat prompt (all
    positions) equal those of the same weights in `nn.Linear` to fp32 rounding."""
    import torch

    from relayinfer.cloud.models.llama import PackedLinear, StaticKV, can_pack, load_llama

    dense = load_llama(torch_engine.model_path)
    if not can_pack(dense):
        pytest.skip("this torch build has no oneDNN: linears are not packed")
    packed = torch_engine.model
    assert isinstance(packed.layers[0].attn.wq, PackedLinear) and isinstance(packed.lm_head, PackedLinear)
    assert type(dense.layers[0].attn.wq) is torch.nn.Linear
    sd = packed.state_dict()
    for name, w in dense.state_dict().items():
        assert torch.equal(sd[name], w), name
    ids = torch.tensor([prompts[0]])

    def logits(model):
        kv = StaticKV(model.cfg, capacity=len(prompts[0]))
        kv.reserve(len(prompts[0]))
        with torch.inference_mode():
            return model(ids, kv, 0, last_only=False)

    a, b = logits(packed), logits(dense)
    assert a.shape == (1, len(prompts[0]), packed.cfg.vocab_size)
    torch.testing.assert_close(a, b, atol=2e-3, rtol=1e-4)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.95
    # below the module's min_rows rows the dense weight runs (F.linear, bit for bit); from it on, the
    # packed one; one min_rows for every linear of the model, measured on this CPU at load (1..3)
    from relayinfer.cloud.models.llama import PackedLinear, kernel_min_rows

    rows = {m.min_rows for m in packed.modules() if isinstance(m, PackedLinear)}
    assert len(rows) == 1 and rows <= {1, 2, 3}, rows
    lin = packed.layers[0].up
    x = torch.randn(1, 3, lin.in_features)
    saved, lin.min_rows = lin.min_rows, 3
    try:
        with torch.inference_mode():
            few, many = lin(x[:, :2]), lin(x)
            raw = torch.ops.mkldnn._linear_pointwise(x, lin.packed, lin.bias, "none", [], "")
        assert torch.equal(lin.kernel(x), raw)
    finally:
        lin.min_rows = saved
    assert torch.equal(few, torch.nn.functional.linear(x[:, :2], lin.dense, lin.bias))
    assert torch.equal(many, raw)
    assert kernel_min_rows([lin], rows=(1,), reps=1) in (1, 2)


def test_dtype_names_and_auto():
    """'auto' is float32 on the CPU and bfloat16 on an accelerator; unknown names are refused
    naming the choices; a model passed in keeps its dtype."""
    import torch

    from relayinfer.cloud.engine.torch_engine import pick_device, pick_dtype

    assert pick_dtype("auto", "cpu") == pick_dtype(None, "cpu") == torch.float32
    assert pick_dtype("auto", "cuda:0") == pick_dtype(None, "npu") == torch.bfloat16
    assert pick_dtype("bf16", "cpu") == torch.bfloat16 and pick_dtype(torch.float16, "cpu") == torch.float16
    with pytest.raises(ValueError, match="choose auto, float32, bfloat16 or float16"):
        pick_dtype("int4", "cpu")
    with pytest.raises(ValueError, match="not supported"):
        pick_dtype(torch.float64, "cpu")
    assert pick_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("dtype,top1,kl", [("bfloat16", 0.93, 1e-2), ("float16", 0.98, 1e-3)])
def test_half_precision_engine_is_close_to_float32(torch_engine, prompts, dtype, top1, kl):
    """Weights and KV cache in bfloat16 / float16 (the accelerator path, run here on the CPU): the
    logits at every position of the chat prompts pick the float32 model's top-1 token at >= `top1`
    of positions with a mean KL(fp32 || half) below `kl` nats (measured here: bf16 0.95-0.98 and
    0.0016-0.002, fp16 0.99-1.0 and 4e-5); the batching engine's KV pool holds half the bytes per token
    and its greedy answers start with the float32 engine's first token and go on with tokens in the
    float32 model's top 3 (bf16 may take a near-tied second: its greedy tokens are not fp32's,
    bench/results/fidelity-cloud.md)."""
    import torch

    from relayinfer.cloud.engine.torch_engine import TorchEngine

    from relayinfer.cloud.models.llama import GemvLinear

    half = TorchEngine(torch_engine.model_path, threads=1, dtype=dtype)
    assert half.dtype == getattr(torch, dtype) and next(half.model.parameters()).dtype == half.dtype
    assert half.new_cache(8).k.dtype == half.dtype
    lin = half.model.layers[0].up  # one row runs torch.mv, more F.linear: the same products
    assert isinstance(lin, GemvLinear) and half.model.lm_head.weight is half.model.embed.weight
    x = torch.randn(1, 2, lin.in_features, dtype=half.dtype)
    assert {m.min_rows for m in half.model.modules() if isinstance(m, GemvLinear)} <= {1, 2}  # measured at load
    with torch.inference_mode():
        for rows in (1, 2):  # torch.mv (1) or F.linear (2) for a one-row call: the same products
            lin.min_rows = rows
            torch.testing.assert_close(lin(x[:, :1]).float(), lin(x)[:, :1].float(), rtol=1e-2, atol=1e-2)
        assert torch.equal(lin(x[:, :1]), torch.nn.functional.linear(x[:, :1], lin.weight))  # 2: F.linear itself
    agree, kls = [], []
    for ids in prompts:
        a = torch_engine.forward(ids, torch_engine.new_cache(len(ids)), last_only=False).double()
        b = half.forward(ids, half.new_cache(len(ids)), last_only=False).double()
        assert b.shape == a.shape and torch.isfinite(b).all()
        agree.append((a.argmax(-1) == b.argmax(-1)).double().mean().item())
        la, lb = a.log_softmax(-1), b.log_softmax(-1)
        kls.append((la.exp() * (la - lb)).sum(-1).mean().item())
    assert min(agree) >= top1 and max(kls) < kl, (agree, kls)
    llm = LLMEngine(half, kv_cache_bytes=16 << 20)
    assert llm.kv_bytes_per_token * 2 == kv_bytes_per_token(torch_engine.cfg)
    assert llm.runner.kv[0].dtype == half.dtype
    out = llm.generate(prompts[:2], SamplingParams(max_new_tokens=4))
    ref = LLMEngine(torch_engine, kv_cache_bytes=16 << 20).generate(prompts[:2], SamplingParams(max_new_tokens=4))
    for ids, o, r in zip(prompts[:2], out, ref):  # the half-precision answer is one the fp32 model ranks top
        assert o[0] == r[0] and len(o) == len(r) == 4
        logits = torch_engine.forward(ids + o[:-1], torch_engine.new_cache(len(ids) + 3), last_only=False)[len(ids) - 1:]
        top3 = logits.topk(3, -1).indices.tolist()
        assert all(t in top for t, top in zip(o, top3)), (o, r, top3)
