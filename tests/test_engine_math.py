"""The torch side's math against independent references: grouped-query attention without K/V
expansion vs the expanded float64 form, the model's logits vs a re-derivation of the previous
(expanding) implementation, the batch sampler's pieces vs the full-sort / `rng.choice` reference,
and the block manager's cached-free counter vs a scan under random operations."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relayinfer.cloud.engine.block_manager import BlockManager
from relayinfer.cloud.engine.sampler import sample_batch
from relayinfer.cloud.engine.sequence import Sequence
from relayinfer.cloud.models.llama import CAUSAL, ConcatKV, StaticKV, causal_mask, gqa_attention
from relayinfer.protocol.model.decoding import SamplingParams, draw, sample, top_p_keep


def expanded_attention64(q, k, v, mask):
    """Reference: K/V repeated to every query head, softmax(q k^T / sqrt(d)) v in float64."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s.softmax(-1) @ v


@pytest.mark.parametrize("b,s,t,padded", [(1, 1, 300, False), (5, 1, 40, True), (1, 17, 50, False), (2, 9, 9, False),
                                          (1, 33, 33, False)])
def test_gqa_attention_equals_expanded_float64(b, s, t, padded):
    g = torch.Generator().manual_seed(b * 1000 + s * 10 + t)
    q = torch.randn(b, 9, s, 64, generator=g)
    k, v = torch.randn(b, 3, t, 64, generator=g), torch.randn(b, 3, t, 64, generator=g)
    if padded:  # key padding: sequence i sees its first lens[i] keys
        lens = torch.randint(1, t + 1, (b,), generator=g)
        mask = (torch.arange(t)[None] < lens[:, None])[:, None, None]
    elif s > 1:  # causal after t - s cached keys
        mask = torch.arange(t)[None] <= torch.arange(t - s, t)[:, None]
    else:
        mask = None
    got = gqa_attention(q, k, v, mask)
    assert got.shape == (b, 9, s, 64) and got.dtype == torch.float32
    if s == t:  # no cached keys: the CAUSAL shortcut (is_causal) gives the same values
        torch.testing.assert_close(gqa_attention(q, k, v, CAUSAL), got, atol=1e-6, rtol=1e-6)
        assert torch.equal(causal_mask(s, t), mask)
    torch.testing.assert_close(got.double(), expanded_attention64(q, k, v, mask), atol=2e-6, rtol=1e-5)


def old_forward(model, ids: list[int]) -> torch.Tensor:
    """The previous implementation re-derived from the weights: RoPE in rotate_half form, K/V
    expanded to all heads, explicit causal softmax, all in float64. Logits [S, vocab]."""
    cfg = model.cfg
    h, kvh, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    s = len(ids)
    params = model.state_dict()  # dense weights (a packed linear gives its weight back here)

    def w(name):  # float64 copy of one weight, made when used (the whole model would be 1 GB)
        return (model.lm_head.weight if name == "lm_head.weight" else params[name]).detach().double()

    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = torch.arange(s, dtype=torch.float64)[:, None] * inv
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()

    def norm(x, wt):
        return wt * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps)

    def rot(x):  # [heads, S, hd]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    causal = torch.ones(s, s, dtype=torch.bool).tril()
    x = model.embed.weight.detach()[torch.tensor(ids)].double()
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        xn = norm(x, w(p + "attn_norm.weight"))
        q = rot((xn @ w(p + "attn.wq.weight").T).view(s, h, hd).transpose(0, 1))
        k = rot((xn @ w(p + "attn.wk.weight").T).view(s, kvh, hd).transpose(0, 1))
        v = (xn @ w(p + "attn.wv.weight").T).view(s, kvh, hd).transpose(0, 1)
        k = k[:, None].expand(kvh, h // kvh, s, hd).reshape(h, s, hd)
        v = v[:, None].expand(kvh, h // kvh, s, hd).reshape(h, s, hd)
        a = (q @ k.transpose(-1, -2) / math.sqrt(hd)).masked_fill(~causal, float("-inf")).softmax(-1) @ v
        x = x + a.transpose(0, 1).reshape(s, h * hd) @ w(p + "attn.wo.weight").T
        hn = norm(x, w(p + "ffn_norm.weight"))
        g = hn @ w(p + "gate.weight").T
        x = x + (g * torch.sigmoid(g) * (hn @ w(p + "up.weight").T)) @ w(p + "down.weight").T
    return norm(x, w("norm.weight")) @ w("lm_head.weight").T


def test_model_logits_equal_previous_implementation(torch_engine, chat_prompt_ids):
    """Prefill (all positions) and token-by-token decode through `StaticKV`, and the export cache
    `ConcatKV`, give the float64 expanded-K/V re-derivation's logits within fp32 rounding (1e-5 x max |logit| + 2e-5 x |logit|)."""
    model, ids = torch_engine.model, chat_prompt_ids[1][:40]
    ref = old_forward(model, ids)
    with torch.inference_mode():
        kv = StaticKV(model.cfg, capacity=8)  # grows while decoding: the doubling path too
        kv.reserve(len(ids) - 4)
        pre = model(torch.tensor([ids[:-4]]), kv, 0, last_only=False)[0]
        kv.commit()
        dec = []
        for j in range(len(ids) - 4, len(ids)):
            kv.reserve(1)
            dec.append(model(torch.tensor([[ids[j]]]), kv, kv.length)[0])
            kv.commit()
        empty = torch.zeros(1, model.cfg.n_kv_heads, 0, model.cfg.head_dim)
        cat = model(torch.tensor([ids]), ConcatKV([(empty, empty)] * model.cfg.n_layers), 0, last_only=False)[0]
    got = torch.cat([pre, torch.stack(dec)]).double()
    # fp32 rounding over 30 layers scales with the operands, not with one logit: a logit near 0 carries
    # the error of its row's large ones. The bound is 1e-5 x the largest |logit| (~30, so ~3e-4) plus
    # 2e-5 x |logit|; CPUs whose kernels sum in another order (AVX2 vs AVX-512) were seen at 1.24e-4.
    # A wrong mask, RoPE or KV position moves logits by > 1e-2.
    atol = 1e-5 * ref.abs().max().item()
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=atol)
    torch.testing.assert_close(cat.double(), ref, rtol=2e-5, atol=atol)
    top2 = ref.topk(2, -1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * atol  # the greedy token is defined past rounding
    assert clear.sum() >= len(ids) // 2 and torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])


def full_sort_keep(p: np.ndarray, top_p: float) -> np.ndarray:
    """The previous nucleus filter: stable argsort of the whole vocabulary."""
    order = np.argsort(-p, kind="stable")
    return order[: int(np.searchsorted(np.cumsum(p[order]), top_p)) + 1]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), vocab=st.sampled_from([7, 100, 2048, 49152]),
       scale=st.sampled_from([0.05, 1.0, 4.0, 30.0]), top_p=st.sampled_from([0.1, 0.5, 0.9, 0.99, 0.999999]),
       ties=st.booleans())
def test_top_p_keep_equals_full_sort(seed, vocab, scale, top_p, ties):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(vocab) * scale
    if ties:  # a block of equal logits straddling the nucleus boundary
        x[rng.integers(0, vocab, vocab // 2)] = np.quantile(x, 0.99)
    p = np.exp(x - x.max())
    p /= p.sum()
    got, ref = top_p_keep(p, top_p), full_sort_keep(p, top_p)
    np.testing.assert_array_equal(got, ref)  # same kept ids in the same order
    q = np.zeros_like(p)
    q[got] = p[got]
    for s in range(3):  # and the same draw as numpy's choice from the renormalised distribution
        assert draw(q / q.sum(), np.random.default_rng((seed, s))) == \
            np.random.default_rng((seed, s)).choice(vocab, p=q / q.sum())


def test_sample_batch_greedy_argmax_and_seeded_rows_independent_of_batch():
    rng = np.random.default_rng(3)
    logits = torch.from_numpy((rng.standard_normal((6, 5000)) * 3).astype(np.float32))
    logits[0, 10] = logits[0, 20] = logits[0].max() + 1  # a tie: the first maximum wins, as np.argmax
    greedy = SamplingParams(max_new_tokens=4)
    seeded = SamplingParams(temperature=0.9, top_p=0.8, top_k=100, seed=11, max_new_tokens=4)
    pen = SamplingParams(repetition_penalty=1.3, max_new_tokens=4)
    seqs = [Sequence(f"s{i}", [1, 2, 3, i], sp, 4) for i, sp in enumerate([greedy, seeded, greedy, pen, seeded, greedy])]
    toks = sample_batch(logits, seqs, eos_id=0)
    assert toks[0] == 10
    for i in (0, 2, 5):
        assert toks[i] == int(np.argmax(logits[i].numpy()))
    for i in (1, 3, 4):
        assert toks[i] == sample(logits[i].numpy(), seqs[i].params, 0, seqs[i].token_ids, 4, 0)
    # a seeded row draws the same token alone as in the batch
    assert sample_batch(logits[1:2], seqs[1:2], eos_id=0) == [toks[1]]
    with pytest.raises(ValueError, match="logits must be"):
        sample_batch(logits[:2], seqs, eos_id=0)


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "grow", "free"]), st.integers(0, 10**6)), max_size=60),
       prefix=st.booleans())
def test_cached_free_counter_matches_scan(ops, prefix):
    """Random admissions (with shared prefixes), growth and frees: the O(1) counter equals the
    scan over the free list after every operation."""
    bm = BlockManager(num_blocks=12, block_size=2, enable_prefix_caching=prefix)
    live: list[Sequence] = []
    for kind, r in ops:
        if kind == "add":
            toks = [1, 2, 3, 4, 5, 6, 7, 8][: 2 + r % 7] + [r % 3]
            seq = Sequence(f"s{r}", toks, SamplingParams(), 8)
            bm.match_prefix(seq)
            old = seq.num_computed_tokens
            if bm.allocate(seq, seq.num_uncomputed_tokens):
                seq.num_computed_tokens = len(toks)
                bm.commit(seq, old)
                live.append(seq)
            else:
                bm.free_sequence(seq)
        elif kind == "grow" and live:
            seq = live[r % len(live)]
            seq.token_ids.append(r % 5)
            old = seq.num_computed_tokens
            if bm.allocate(seq, 1):
                seq.num_computed_tokens += 1
                bm.commit(seq, old)
            else:
                seq.token_ids.pop()
        elif kind == "free" and live:
            bm.free_sequence(live.pop(r % len(live)))
        assert bm.num_cached_free_blocks == bm.scan_cached_free_blocks()
        assert bm.num_free_blocks + sum(b.ref_count > 0 for b in bm.blocks) == bm.num_blocks


def test_finish_reason_orders_eos_stop_length_budget():
    """The one finish rule: EOS, then a stop id, then max_new_tokens, then the cloud budget."""
    from relayinfer.protocol.model.decoding import finish_reason
    p = SamplingParams(max_new_tokens=4, stop_ids=(7,))
    assert finish_reason(2, 1, p, eos_id=2) == "eos"
    assert finish_reason(7, 1, p, eos_id=2) == "stop"
    assert finish_reason(5, 3, p, eos_id=2) is None
    assert finish_reason(5, 4, p, eos_id=2) == "length"
    assert finish_reason(5, 4, p, eos_id=2, budget=4) == "length"  # the answer's own end wins
    assert finish_reason(5, 2, p, eos_id=2, budget=2) == "budget"
    assert finish_reason(2, 1, p, eos_id=-1) is None  # EOS ignored


def test_generate_message_carries_every_sampling_field_both_ways():
    """The one Generate <-> SamplingParams conversion: every sampling field, logit_bias included,
    survives the wire (msgpack) unchanged; logprobs, which the split protocol does not carry, is
    refused naming the field instead of being dropped."""
    from relayinfer.protocol.messages import decode, encode
    from relayinfer.protocol.model.decoding import generate_message, params_of
    from relayinfer.protocol.validate import FieldError
    p = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=-3, max_new_tokens=9, stop_ids=(5, 6),
                       presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.1, min_tokens=2,
                       logit_bias=((3, 2.5), (9, -100.0)))
    g = decode(encode(generate_message("r", [1, 2, 3], p, cloud_budget=4, refine=0.5)))
    assert params_of(g) == p and g.cloud_budget == 4 and g.refine == 0.5 and g.prompt_ids == [1, 2, 3]
    with pytest.raises(FieldError) as e:
        generate_message("r", [1], SamplingParams(logprobs=2))
    assert e.value.field == "logprobs"
