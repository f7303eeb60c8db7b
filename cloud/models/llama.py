"""A compact Llama-family decoder (RMSNorm, RoPE, grouped-query attention, gated MLP) loaded from a GGUF file.

The same blocks run Llama (SmolLM2, Llama 3.x), Qwen2 (Q/K/V biases) and Gemma 3 (embedding scale,
q/k norms, norms after attention and MLP, GeGLU, sliding-window layers with their own RoPE base):
each difference is a `ModelConfig` field (`protocol.model.model_file`), read from the GGUF.

One readable model file in the style of gpt-fast: the KV cache is an object with one method,
`attend(layer, q, k, v, mask, obs)` (store the new K/V, attend over what the queries may see), so
the same blocks serve the single-request engine (`StaticKV`, a pre-allocated cache written in
place), one-off forwards (`ConcatKV`, past/present tensors concatenated) and the batching engine
(`cloud.engine.model_runner.PagedKV`, block tables over a paged cache): the layer math is written
once, here. Grouped-query attention never expands K/V (`gqa_attention`).

GGUF stores the Q/K projection rows permuted for llama.cpp's interleaved rotary layout
(`convert_hf_to_gguf.py`, `LlamaModel.permute`; Llama only: `ModelConfig.rope_permuted`); `load_llama` undoes it so RoPE here is the
`rotate_half` form of the Hugging Face checkpoints and our KV cache matches theirs element for element.
"""
from __future__ import annotations

import os
import time
from functools import partial
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from relayinfer.protocol.model import model_file
from relayinfer.protocol.model.model_file import ModelConfig, open_gguf, read_config


class KVCache(Protocol):
    """Per-layer key/value store and the attention over it. `attend(layer, q, k, v, mask, obs)`
    stores the new keys/values k, v ([B, kv_heads, S, head_dim], K after RoPE) and returns the
    attention output [B, n_heads, S, head_dim] of queries q ([B, n_heads, S, head_dim]) over the
    keys each query may see. `mask` is whatever the cache's caller built for it (a bool mask for
    the contiguous caches here, None for "causal after the cached tokens"); the paged cache of the
    batching engine (`cloud.engine.model_runner.PagedKV`) ignores it and masks per sequence.
    `window` > 0 (a sliding-window layer): a query at position p sees only keys at positions
    > p - window (`window_mask`)."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask,
               obs: "ObservationScores | None" = None, window: int = 0) -> torch.Tensor: ...


CAUSAL = "causal"  # mask value: no cached keys (S == T) and query i sees keys 0..i


def causal_mask(s: int, t: int, device=None) -> torch.Tensor:
    """bool [s, t]: query i (the (t - s + i)-th position) sees keys 0..t - s + i."""
    return torch.ones(s, t, dtype=torch.bool, device=device).tril(t - s)


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """bool [S, T]: key position k_pos[j] is within `window` tokens of query position q_pos[i]
    (q_pos[i] - k_pos[j] < window), the sliding-window rule of Gemma 3 and Mistral (and llama.cpp's
    `LLAMA_SWA_TYPE_STANDARD`). Causality is the caller's mask."""
    return (q_pos[:, None] - k_pos[None, :]) < window


def with_window(mask, s: int, t: int, window: int, device=None):
    """`mask` (None, `CAUSAL` or bool broadcastable to [B, 1, S, T]) of S queries at positions
    t - s .. t - 1 over T keys at 0 .. t - 1, narrowed to a sliding window of `window` tokens
    (0: unchanged). Returns a bool mask (or `mask` itself when no key falls outside the window)."""
    if not window or t <= window:
        return mask
    pos = torch.arange(t, device=device)
    w = window_mask(pos[t - s:], pos, window)
    if mask is None:
        return w
    if isinstance(mask, str):
        return w & causal_mask(s, t, device)
    return mask & w


def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: torch.Tensor | str | None = None) -> torch.Tensor:
    """Grouped-query attention (Ainslie et al. 2023, "GQA") without expanding K/V.

    q [B, n_heads, S, head_dim], k/v [B, kv_heads, T, head_dim] (n_heads a multiple of kv_heads;
    query head i reads KV head i // (n_heads // kv_heads)), mask bool broadcastable to
    [B, 1, S, T] (True = visible), None (all visible) or `CAUSAL` (S == T, lower triangle: SDPA's
    `is_causal`, which skips the masked blocks: 2.3x faster than the same bool mask at 2,048
    tokens on CPU, bit-identical). Returns [B, n_heads, S, head_dim] in q's
    dtype. One query position (decode): the `rep` query heads sharing a KV head become `rep` query
    rows of that head, one plain SDPA call ([B, kv_heads, rep, head_dim]); several positions:
    `scaled_dot_product_attention(enable_gqa=True)`, which on CPU runs the fused flash kernel with
    the KV head broadcast (no copy; bit-identical to the expanded K/V, measured in the tests).
    """
    b, h, s, hd = q.shape
    kvh = k.shape[1]
    causal = isinstance(mask, str)
    if causal:
        if mask != CAUSAL or k.shape[2] != s:
            raise ValueError(f"mask {mask!r} needs S == T (got S={s}, T={k.shape[2]}); pass a bool mask")
        mask = None
        if s == 1:
            causal = False
    if s == 1 and h != kvh:
        if mask is not None and mask.dim() == 4:
            mask = mask[:, :, -1:]  # [B, 1, 1, T]: the one query's keys, shared by its rep rows
        o = F.scaled_dot_product_attention(q.reshape(b, kvh, h // kvh, hd), k, v, attn_mask=mask)
        return o.reshape(b, h, 1, hd)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=h != kvh)


class _ContiguousAttend:
    """`attend` for caches whose `update(layer, k, v)` returns the layer's whole K/V
    ([B, kv_heads, T, head_dim]): store, then `gqa_attention` under the caller's mask."""

    def attend(self, layer, q, k, v, mask, obs=None, window: int = 0):
        k, v = self.update(layer, k, v)
        mask = with_window(mask, q.shape[2], k.shape[2], window, q.device)
        if obs is not None:
            obs.add(q, k, causal_mask(q.shape[2], k.shape[2], q.device) if isinstance(mask, str) else mask)
        return gqa_attention(q, k, v, mask)


class ConcatKV(_ContiguousAttend):
    """Past tensors in, present tensors out (concatenation along the sequence axis), for one-off
    full forwards (prompt logprobs). `past[i]` is (k, v) of layer i, each [B, kv_heads, P,
    head_dim]; `present[i]` holds them with the new tokens appended."""

    def __init__(self, past: list[tuple[torch.Tensor, torch.Tensor]]):
        self.past, self.present = past, [None] * len(past)

    def update(self, layer, k, v):
        pk, pv = self.past[layer]
        k, v = torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)
        self.present[layer] = (k, v)
        return k, v


class StaticKV(_ContiguousAttend):
    """Pre-allocated cache written in place (gpt-fast style): k and v are
    [n_layers, B, kv_heads, capacity, head_dim]; `length` tokens are filled. Grows by doubling
    when a write would overflow, so callers need not know the answer length up front."""

    def __init__(self, cfg: ModelConfig, batch: int = 1, capacity: int = 256,
                 dtype=torch.float32, device="cpu"):
        shape = (cfg.n_layers, batch, cfg.n_kv_heads, capacity, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0
        self._pending = 0

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def reserve(self, n: int) -> None:
        """Make room for `n` more tokens; called once per forward before the layers run."""
        need = self.length + n
        if need > self.capacity:
            cap = max(need, 2 * self.capacity)
            pad = (0, 0, 0, cap - self.capacity)
            self.k, self.v = F.pad(self.k, pad), F.pad(self.v, pad)
        self._pending = n

    def update(self, layer, k, v):
        s, e = self.length, self.length + k.shape[2]
        self.k[layer, :, :, s:e] = k
        self.v[layer, :, :, s:e] = v
        return self.k[layer, :, :, :e], self.v[layer, :, :, :e]

    def commit(self) -> None:
        self.length += self._pending
        self._pending = 0


class ObservationScores:
    """SnapKV-style importance of each key position (Li et al. 2024, "SnapKV: LLM Knows What You
    are Looking for Before Generation", sec. 4): the attention probabilities that the last `window`
    query positions pay to every key, summed over those queries, heads and layers.

    Fused attention kernels return no weights, so only the window's rows are recomputed:
    [B, H, window, T] per layer instead of [B, H, T, T]. `scores` is float32 [B, T].
    """

    def __init__(self, window: int = 16):
        self.window, self.scores = window, None

    def add(self, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> None:
        """q [B, n_heads, S, head_dim], k [B, kv_heads, T, head_dim] (grouped: query head i reads
        KV head i // rep), mask bool [S, T] / [B, 1, S, T] or None. Computed in float32 whatever
        the model dtype (bfloat16 sums tie ~20 % of the positions' scores)."""
        w = min(self.window, q.shape[2])
        b, h, _, hd = q.shape
        kvh = k.shape[1]
        qw = q[:, :, -w:].reshape(b, kvh, (h // kvh) * w, hd).float()  # the rep heads of a KV head as rows
        logits = (qw @ k.float().transpose(-1, -2)).view(b, h, w, -1) / hd ** 0.5
        if mask is not None:
            logits = logits.masked_fill(~mask[-w:], float("-inf"))
        p = logits.softmax(-1).sum(dim=(1, 2))
        self.scores = p if self.scores is None else self.scores + p


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        """x [..., dim] in the model dtype; the statistics are taken in float32 (as transformers'
        LlamaRMSNorm: a float16 sum of squares overflows), the result is in x's dtype."""
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rope_inv_freq(cfg: ModelConfig, theta: float | None = None) -> torch.Tensor:
    """RoPE's inverse frequencies, float32 [head_dim / 2]: `model_file.rope_inv_freq` as a tensor
    (the numbers of the device graph's RoPE tables)."""
    return torch.from_numpy(model_file.rope_inv_freq(cfg, theta))


def rope_bases(cfg: ModelConfig) -> torch.Tensor:
    """float32 [R, 1, head_dim / 2]: the inverse frequencies of each of the model's R RoPE bases
    (`ModelConfig.rope_thetas`; R = 1 but for Gemma 3's local and global layers), for `rope`."""
    return torch.stack([rope_inv_freq(cfg, th) for th in cfg.rope_thetas])[:, None]


def rope(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [S, head_dim] for integer `positions` [S] ([B, S] gives [B, S, head_dim])
    (RoFormer, Su et al. 2021). `inv_freq` [head_dim / 2], or [R, 1, head_dim / 2] for R RoPE
    bases at once (cos, sin [R, S, head_dim] / [R, B, S, head_dim])."""
    if inv_freq.dim() == 3:  # one table per base: broadcast the bases over the positions' axes
        inv_freq = inv_freq.view(inv_freq.shape[0], *([1] * positions.dim()), inv_freq.shape[-1])
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x, cos, sin):
    """x [B, H, S, head_dim] rotated in the rotate_half layout."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # keep bf16/fp16 activations in their dtype
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.h, self.kvh, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.window = cfg.window(layer)
        self.wq = nn.Linear(cfg.dim, self.h * self.hd, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, self.kvh * self.hd, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, self.kvh * self.hd, bias=cfg.qkv_bias)
        self.wo = nn.Linear(self.h * self.hd, cfg.dim, bias=False)
        if cfg.qk_norm:  # Gemma 3: RMSNorm over head_dim of every query / key head, before RoPE
            self.q_norm, self.k_norm = RMSNorm(self.hd, cfg.norm_eps), RMSNorm(self.hd, cfg.norm_eps)

    def forward(self, x, cos, sin, mask, cache: KVCache, layer: int, obs: "ObservationScores | None" = None):
        """x [B, S, dim] -> [B, S, dim]; cos/sin broadcastable to [B, 1, S, head_dim]; `mask` and
        the attention over cached keys belong to `cache` (see `KVCache.attend`)."""
        b, s, _ = x.shape
        if hasattr(self, "wqkv"):  # Q/K/V concatenated (`FUSED`): one matmul
            q, k, v = self.wqkv(x).split((self.h * self.hd, self.kvh * self.hd, self.kvh * self.hd), -1)
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        q, k = q.view(b, s, self.h, self.hd), k.view(b, s, self.kvh, self.hd)
        v = v.view(b, s, self.kvh, self.hd).transpose(1, 2)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
        o = cache.attend(layer, q, k, v, mask, obs, window=self.window)
        return self.wo(o.transpose(1, 2).reshape(b, s, self.h * self.hd))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.attn_norm, self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps), RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg, layer)
        self.gate = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.act = F.silu if cfg.act == "silu" else partial(F.gelu, approximate="tanh")
        self.rope_index = cfg.rope_thetas.index(cfg.layer_rope_theta(layer))
        if cfg.post_norms:  # Gemma 2/3: the attention and MLP outputs are normalised before the residual add
            self.post_attn_norm, self.post_ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps), RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x, cos, sin, mask, cache, layer, obs=None):
        """x [B, S, dim] -> [B, S, dim]; cos/sin [R, ..., S, head_dim]: the tables of every RoPE base
        (`rope_bases`), of which the layer takes its own."""
        cos, sin = cos[self.rope_index], sin[self.rope_index]
        a = self.attn(self.attn_norm(x), cos, sin, mask, cache, layer, obs)
        x = x + (self.post_attn_norm(a) if hasattr(self, "post_attn_norm") else a)
        h = self.ffn_norm(x)
        g, u = self.gate_up(h).chunk(2, -1) if hasattr(self, "gate_up") else (self.gate(h), self.up(h))
        m = self.down(self.act(g) * u)  # SwiGLU / GeGLU (Shazeer 2020)
        return x + (self.post_ffn_norm(m) if hasattr(self, "post_ffn_norm") else m)


class Llama(nn.Module):
    """Llama decoder. Weights fp32 by default; `cfg` from the GGUF metadata."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_bases(cfg), persistent=False)

    def _apply(self, fn, recurse=True):
        """`.to` / `.half()` / `.cuda()` ...: `inv_freq` follows the device but stays float32 (a
        bfloat16 table rounds the frequencies by up to 0.3 %: RoPE angles off by ~1 rad at
        position 1000, the keys no longer those of the float32 model or the device's graph)."""
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32:
            self.inv_freq = rope_bases(self.cfg).to(self.inv_freq.device)
        return self

    def forward(self, input_ids: torch.Tensor, cache: KVCache, start: torch.Tensor | int,
                last_only: bool = True, obs: "ObservationScores | None" = None,
                positions: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run `input_ids` [B, S] (int64) at positions start..start+S-1 after the `start` cached
        tokens. Returns logits float32 [B, V] for the last position (`last_only`) or [B, S, V].
        `obs` collects the attention that the last prompt positions pay to every key (refinement).
        `positions`: int64 [S] or [B, S] RoPE positions instead of start..start+S-1 (the cache slots
        stay start..: a refined prompt keeps its original positions, `bench refine`). `mask`: bool
        [S, start+S] or [B, 1, S, start+S] keys each query sees instead of the causal mask (left
        padding in a batch)."""
        b, s = input_ids.shape
        pos = start + torch.arange(s, device=input_ids.device)
        cos, sin = rope(pos if positions is None else positions, self.inv_freq)
        if cos.dim() == 4:  # per-row positions [R, B, S, hd]: broadcast over heads
            cos, sin = cos[:, :, None], sin[:, :, None]
        if mask is not None:
            pass
        elif isinstance(start, int) and s == 1:
            mask = None  # one query sees every cached key
        elif isinstance(start, int) and start == 0:
            mask = CAUSAL  # nothing cached: SDPA's is_causal
        else:  # causal over cached + new keys: key j visible to query i iff j <= start + i
            mask = torch.arange(start + s, device=input_ids.device)[None, :] <= pos[:, None]
        x = self.decoder(self.embed_tokens(input_ids), cos, sin, mask, cache, obs)
        return self.head(x[:, -1] if last_only else x)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [..., dim] of int64 ids, times `cfg.embed_scale` (Gemma) in the model dtype."""
        x = self.embed(input_ids)
        return x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype) if self.cfg.embed_scale != 1.0 else x

    def decoder(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask, cache: KVCache,
                obs: "ObservationScores | None" = None) -> torch.Tensor:
        """All blocks: embeddings x [B, S, dim] -> hidden states [B, S, dim]. cos/sin from `rope`
        over `inv_freq` ([R, ...] for the R RoPE bases), each broadcastable to [B, 1, S, head_dim];
        `mask` is handed to `cache.attend` unchanged. The
        batching engine calls this with its paged cache (B = 1, S = every token of the step)."""
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, cache, i, obs)
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: hidden [..., dim] -> logits [..., vocab] (model dtype)."""
        return self.lm_head(self.norm(x))


PACKED_MIN_ROWS = 3  # fewer rows run F.linear on the dense weight (`PackedLinear`), unless measured


class PackedLinear(nn.Module):
    """`nn.Linear` whose fp32 weight is also held pre-packed in oneDNN's blocked layout
    (`torch.ops.mkldnn._reorder_linear_weight`, the weight prepacking of PyTorch Inductor's CPU
    freezing pass) and run by `torch.ops.mkldnn._linear_pointwise` from `min_rows` rows on
    (`PACKED_MIN_ROWS`, or what `kernel_min_rows` measured on this CPU).

    Why (bench/results/packed_linear.md, one core): the packed kernel runs the model's linears at
    4-16 rows 1.3-1.5x faster than `F.linear`'s MKL path and the same at prefill sizes (the
    batching engine's small decode batches, where the weights are read once for all rows), but at
    1-2 rows it is 0.81x on an Intel Xeon (equal on an AMD EPYC): there `F.linear` on the dense
    weight runs (MKL's GEMV). Both copies are kept: twice the weight bytes (+540 MB for
    SmolLM2-135M). Results equal `F.linear`'s to fp32 rounding (~1e-6 relative; neither is bitwise
    independent of the row count).

    x float32 [..., in_features] -> [..., out_features]; `weight` (and the state dict) is the dense
    float32 [out_features, in_features] weight.
    """

    def __init__(self, lin: nn.Linear, batch_hint: int = 16):
        super().__init__()
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.dense = lin.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.dense, batch_hint)
        self.bias = None if lin.bias is None else nn.Parameter(lin.bias.detach(), requires_grad=False)
        self.min_rows = PACKED_MIN_ROWS

    @property
    def weight(self) -> torch.Tensor:
        return self.dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() < self.min_rows * self.in_features:
            return F.linear(x, self.dense, self.bias)
        return self.kernel(x)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """The packed oneDNN kernel at any row count (what `forward` runs from `min_rows` rows)."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.dense


class GemvLinear(nn.Linear):
    """`nn.Linear` of a half-precision CPU model whose one-row calls run `torch.mv` (a decode step
    of one request) when `min_rows` is 1, as `pack_linears` sets it where that was measured faster
    (`kernel_min_rows`): for bfloat16 on one core of an Intel Xeon the matrix-vector kernel runs the
    model's linears ~1.4x faster than `F.linear`'s one-row GEMM (decode step of one request in
    bf16 62 -> 49 ms), on an AMD EPYC slower; more rows go to `F.linear`. x [..., in_features] in
    the model dtype -> [..., out_features]; the weight and the state dict are `nn.Linear`'s."""

    min_rows = 1

    @classmethod
    def of(cls, lin: nn.Linear) -> "GemvLinear":
        """`lin` itself, now a GemvLinear (its class swapped in place: the same module, parameters
        and hooks; a tied head stays tied)."""
        lin.__class__ = cls
        return lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() != self.in_features or self.min_rows > 1:
            return F.linear(x, self.weight, self.bias)
        return self.kernel(x)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """`torch.mv` on a one-row `x` (what `forward` runs for one row when `min_rows` is 1)."""
        y = torch.mv(self.weight, x.reshape(-1))
        return (y if self.bias is None else y + self.bias).view(*x.shape[:-1], self.out_features)


class BlockLinear(nn.Module):
    """A linear layer over the GGUF file's own 4-bit blocks (Q4_0, Q4_1, Q4_K: `cloud.ggml_blocks.Blocks`
    with bits 4, block 32), run by torch's int4 weight-only kernel `aten._weight_int4pack_mm_for_cpu`
    (the kernel of gpt-fast's / torchao's int4 weight-only quantization). `ggml_blocks` writes every
    such block as w = scale * (q - 8) + offset, which is the kernel's `(q - 8) * scale + zero` with the
    file's own q: the weights are not re-quantized.

    The kernel's fast path takes bfloat16 activations and scales (its float32 path is a slow reference
    loop, 5-65x slower than fp32 `F.linear`, bench/results/matmul_paths.md): x is rounded to bfloat16
    on the way in (8 bits of mantissa per element, finer than llama.cpp's Q8_1 activation blocks), the
    scales and offsets to bfloat16 (the file's are float16); the kernel accumulates in float32 and
    rounds its output to bfloat16, which comes back as float32. Everything around the linears (norms,
    RoPE, attention, the KV cache, the residual stream) stays float32. bench/results/fidelity-cloud.md measures the result
    against the fp32 model and llama.cpp. One kernel at every row count, whose rows are computed
    independently of the batch (a request's numbers do not depend on what it is batched with).

    x float32 [..., in_features] -> float32 [..., out_features]. Bytes per weight: 0.5 + 4 / 32 (bf16
    scale and offset per block), 5.3x fewer than float32.

    Raises:
        ValueError: blocks other than 4-bit blocks of 32, or output features not a multiple of 16.
    """

    GROUP = 32

    def __init__(self, blocks, bias: torch.Tensor | None = None):
        super().__init__()
        if blocks.bits != 4 or blocks.block != self.GROUP:
            raise ValueError(f"BlockLinear runs 4-bit blocks of {self.GROUP}, got {blocks.bits}-bit blocks of {blocks.block}")
        n, nb, g = blocks.q.shape
        if n % 16:  # the kernel's packing takes 16 output rows at a time
            raise ValueError(f"BlockLinear needs output features a multiple of 16, got {n}")
        self.in_features, self.out_features = nb * g, n
        q = torch.from_numpy(np.ascontiguousarray(blocks.q.reshape(n, nb * g)).astype(np.int32))
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2), persistent=False)
        scale = torch.from_numpy(np.ascontiguousarray(blocks.scale, dtype=np.float32))
        offset = torch.zeros_like(scale) if blocks.offset is None else torch.from_numpy(
            np.ascontiguousarray(blocks.offset, dtype=np.float32))
        self.register_buffer("scales_and_zeros", torch.stack((scale.t(), offset.t()), -1).contiguous().bfloat16(),
                             persistent=False)  # [K / 32, N, 2]
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    def _apply(self, fn, recurse=True):
        """`.to(dtype)` / `.float()` leave the kernel's operands as they are (bf16 scales, the int4 pack)."""
        super()._apply(fn, recurse)
        self.scales_and_zeros = self.scales_and_zeros.bfloat16()  # exact: bf16 -> fp32 -> bf16
        return self

    @staticmethod
    def available() -> bool:
        """True when this torch has the CPU int4 kernel."""
        return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
            torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")

    def blocks(self):
        """The `ggml_blocks.Blocks` this layer runs (bits 4, block 32: q uint8 [N, K / 32, 32], scale and
        offset float32 [N, K / 32] holding the kernel's bf16 values), for rebuilding it elsewhere
        (`BlockLinear(layer.blocks(), bias)` computes the same bits). Why not the packed operand: its
        layout is the packing CPU's (AVX512 and AVX2 block N differently), so it must not cross
        machines. q is read back exactly through the kernel itself: identity rows with scale 1 and
        offset 8 give (q - 8) * 1 + 8 = q, integers 0..15 that bfloat16 holds exactly. Costs K * K * N
        multiply-adds (~1 s for all of SmolLM2-135M's layers on 2 cores)."""
        from relayinfer.cloud.ggml_blocks import Blocks

        k, n, g = self.in_features, self.out_features, self.GROUP
        unit = torch.empty_like(self.scales_and_zeros)
        unit[..., 0], unit[..., 1] = 1, 8
        rows = []
        for i in range(0, k, 512):  # [512, K] identity slices: bounded memory
            eye = torch.zeros(min(512, k - i), k, dtype=torch.bfloat16, device=self.packed.device)
            eye[:, i:i + 512].fill_diagonal_(1)
            rows.append(torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, g, unit))
        q = torch.cat(rows).t().to(torch.uint8).reshape(n, k // g, g).cpu().numpy()
        sz = self.scales_and_zeros.float().transpose(0, 1).cpu().numpy()  # [N, K / 32, 2]
        return Blocks(4, g, q, np.ascontiguousarray(sz[..., 0]), np.ascontiguousarray(sz[..., 1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, self.in_features).bfloat16(), self.packed,
                                                      self.GROUP, self.scales_and_zeros).float()
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def runs_on_blocks(model: nn.Module) -> bool:
    """True when some linear of `model` runs on GGUF blocks (`BlockLinear`, `load_llama(weights='gguf')`)."""
    return any(isinstance(m, BlockLinear) for m in model.modules())


def can_pack(model: nn.Module) -> bool:
    """True when `pack_linears` applies: a float32 model on the CPU and a torch built with oneDNN."""
    p = next(model.parameters())
    return (p.device.type == "cpu" and p.dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def kernel_min_rows(linears: list[PackedLinear | GemvLinear], rows=(1, 2), reps: int = 5) -> int:
    """The fewest rows from which the modules' own kernel (`lin.kernel(x)`) is at least as fast as
    `F.linear(x, lin.weight, lin.bias)`, measured here on `linears` (all of a model's but its head:
    more bytes than the CPU's caches, as in a decode step) at the torch thread count in force: 1
    when the kernel wins at every row count in `rows`, else one past the largest row count where
    F.linear wins.

    Why measured: which kernel wins at 1-2 rows differs by CPU (bench/results/packed_linear.md, the
    model's linears, 1 thread: oneDNN's packed fp32 kernel 0.81x F.linear at 1 row on an Intel Xeon,
    1.17x / 1.61x at 1 / 2 rows on an AMD EPYC; bf16 `torch.mv` ~1.4x the one-row F.linear on the
    Xeon, slower on the EPYC). Fastest of `reps` interleaved passes per path; costs 2 * reps *
    len(rows) passes over the weights (~0.8 s for SmolLM2-135M in fp32). Both paths give the same
    results to rounding (~1e-6 relative in fp32)."""
    kernel_wins_from, p = 1, linears[0].weight
    with torch.inference_mode():
        for m in rows:
            xs = {lin.in_features: torch.randn(m, lin.in_features, dtype=p.dtype, device=p.device) for lin in linears}
            best = {"linear": float("inf"), "kernel": float("inf")}
            for _ in range(reps):
                for path in best:
                    t = time.perf_counter()
                    for lin in linears:
                        x = xs[lin.in_features]
                        F.linear(x, lin.weight, lin.bias) if path == "linear" else lin.kernel(x)
                    best[path] = min(best[path], time.perf_counter() - t)
            if best["linear"] < best["kernel"]:
                kernel_wins_from = m + 1
    return kernel_wins_from


def pack_linears(model: nn.Module, min_rows: int | None = None) -> nn.Module:
    """Replace every `nn.Linear` of a float32 CPU `model` by a `PackedLinear` in place (of a
    bfloat16 / float16 CPU model by a `GemvLinear`; a no-op on a GPU, or for float32 without
    oneDNN) and return the model. A weight shared with another module (a tied LM head) is packed as
    its own copy; the dense tensor stays shared. Costs one reorder per weight (~1 s for
    SmolLM2-135M) and the packed copies' bytes. `min_rows`: the row count from which the packed
    kernel runs (`PackedLinear`; for `GemvLinear` 1: one-row calls run `torch.mv`, 2: never); None
    measures it on this CPU (`kernel_min_rows`)."""
    p = next(model.parameters())
    half = p.device.type == "cpu" and p.dtype in (torch.bfloat16, torch.float16)
    if not (can_pack(model) or half):
        return model
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, GemvLinear.of(child) if half else PackedLinear(child))
    mods = [m for m in model.modules() if isinstance(m, (PackedLinear, GemvLinear))]
    if min_rows is None:
        head = getattr(model, "lm_head", None)
        body = [m for m in mods if m is not head] or mods
        min_rows = kernel_min_rows(body, rows=(1,) if half else (1, 2))  # torch.mv takes one row only
    for m in mods:
        m.min_rows = min_rows
    return model


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved -> rotate_half rotary layout)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_NAMES = {"attn_norm": "attn_norm", "ffn_norm": "ffn_norm", "attn_q": "attn.wq", "attn_k": "attn.wk",
          "attn_v": "attn.wv", "attn_output": "attn.wo", "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down",
          "attn_q_norm": "attn.q_norm", "attn_k_norm": "attn.k_norm", "post_attention_norm": "post_attn_norm",
          "post_ffw_norm": "post_ffn_norm"}


WEIGHTS = ("fp32", "gguf")
"""The cloud engine's weight formats: 'fp32' (every tensor dequantized to the model dtype) and 'gguf'
(the file's 4-bit block layers as `BlockLinear`, the rest float32; CPU, float32 only)."""


def check_weights_fit(weights: str, device: str, dtype: torch.dtype, model_path=None) -> None:
    """Refuse a weight format this device, dtype, torch or the GGUF at `model_path` (when given;
    its tensor types are read, not its data) cannot run.

    Raises:
        ValueError: naming the format and why ('gguf' needs the CPU, float32, torch's int4 kernel
            and a file with layer linears in 4-bit blocks).
    """
    if weights not in WEIGHTS:
        raise ValueError(f"weights {weights!r} is not supported; choose one of {', '.join(WEIGHTS)}")
    if weights == "gguf":
        if not str(device).startswith("cpu"):
            raise ValueError(f"weights 'gguf' runs on the CPU only (torch's CPU int4 kernel), not on {device}; "
                             f"use weights 'fp32' with a bfloat16 dtype there")
        if dtype != torch.float32:
            raise ValueError(f"weights 'gguf' keeps float32 activations around the block linears; dtype {dtype} "
                             f"is not supported with it (choose float32 or weights 'fp32')")
        if not BlockLinear.available():
            raise ValueError(f"weights 'gguf' needs torch's CPU int4 kernel, which torch {torch.__version__} lacks")
        if model_path is not None:
            _check_has_blocks(open_gguf(model_path))


def _layer_linears(reader):
    """(tensor, layer index, `Block` key) of each layer linear weight of a GGUF reader."""
    for t in reader.tensors:
        parts = t.name.split(".")
        key = _NAMES.get(parts[2]) if parts[0] == "blk" and parts[-1] == "weight" else None
        if key is not None and key.startswith(("attn.w", "gate", "up", "down")):
            yield t, int(parts[1]), key


def _check_has_blocks(reader) -> None:
    """Raise ValueError when no layer linear of the file is in 4-bit blocks (weights 'gguf' would
    run nothing on blocks)."""
    from relayinfer.cloud.ggml_blocks import FOUR_BIT

    kinds = {t.tensor_type.name for t, _, _ in _layer_linears(reader)}
    if not kinds & FOUR_BIT:
        raise ValueError(f"weights 'gguf': this file has no layer linear in 4-bit blocks ({', '.join(sorted(FOUR_BIT))}); "
                         f"its layer linears are {', '.join(sorted(kinds)) or 'none'}; use weights 'fp32'")


def load_llama(path: str | os.PathLike | None = None, device: str = "cpu",
               dtype: torch.dtype = torch.float32, weights: str = "fp32") -> Llama:
    """Read a GGUF of a supported architecture (default model when None), dequantize every tensor
    to float32 with `gguf.quants.dequantize` (any type gguf knows: F32, F16, BF16, Q4_0, Q4_1,
    Q5_0, Q8_0, Q4_K, Q5_K, Q6_K, ...), and return the model in eval mode on `device`.

    `weights` 'gguf' (`WEIGHTS`): then every layer linear stored as 4-bit blocks (Q4_0, Q4_1, Q4_K)
    runs on those blocks (`BlockLinear`); the others (8-bit types, the output head, F16/F32
    tensors) stay dequantized.

    Raises:
        ModelFileError: missing, truncated or corrupt file, or a tensor missing/misshapen.
        UnsupportedModelError: an architecture outside `model_file.SUPPORTED_ARCHITECTURES`.
        ValueError: a weight format the device / dtype cannot run (`check_weights_fit`).
    """
    check_weights_fit(weights, device, dtype)
    import gguf

    from relayinfer.protocol.model.errors import ModelFileError

    reader = open_gguf(path)
    cfg = read_config(reader)
    with torch.device("meta"):
        model = Llama(cfg)
    state = {}
    for t in reader.tensors:
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        except Exception as e:
            raise ModelFileError(f"cannot dequantize tensor {t.name} ({t.tensor_type.name}): {e}") from e
        parts = t.name.split(".")
        if parts[0] == "blk":
            key = _NAMES.get(parts[2])
            if key is None:
                continue
            if cfg.rope_permuted and parts[2] == "attn_q":
                w = _unpermute(w, cfg.n_heads)
            elif cfg.rope_permuted and parts[2] == "attn_k":
                w = _unpermute(w, cfg.n_kv_heads)
            state[f"layers.{parts[1]}.{key}.{parts[3]}"] = w
        elif t.name == "token_embd.weight":
            state["embed.weight"] = w
        elif t.name == "output_norm.weight":
            state["norm.weight"] = w
        elif t.name == "output.weight":
            state["lm_head.weight"] = w
    if cfg.tied_embeddings:
        state["lm_head.weight"] = state["embed.weight"]
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    for k, shape in expected.items():
        if k not in state:
            raise ModelFileError(f"GGUF file lacks tensor for {k}")
        if tuple(state[k].shape) != shape:
            raise ModelFileError(f"tensor {k} has shape {state[k].shape}, expected {shape}")
    model.load_state_dict({k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in state.items()},
                          assign=True)
    if cfg.tied_embeddings:
        model.lm_head.weight = model.embed.weight
    model.inv_freq = rope_bases(cfg)
    if weights == "gguf":
        _block_linears(model, reader, cfg)
    return model.to(device=device, dtype=dtype).eval()


# A fused linear of a `Block` (key as in `_NAMES`) and the linears it concatenates along the output
# features, in order: they read the same input. Only `BlockLinear`s are fused (`_block_linears`):
# the int4 kernel computes each output column on its own, so the fused columns are the separate
# layers' bits (tests/test_block_weights.py), with one kernel call and one bf16 rounding of x
# instead of three / two (decode steps 1-11 % shorter, bench/results/fused_linears.md).
FUSED = {"attn.wqkv": ("attn.wq", "attn.wk", "attn.wv"), "gate_up": ("gate", "up")}


def set_block_linear(layer: Block, key: str, lin: BlockLinear) -> None:
    """Put `lin` at `key` ('attn.wo', 'down', a `FUSED` key, ...) of `layer`; a fused key removes
    the linears it stands for (those still there: setting it again replaces it).

    Raises:
        ValueError: `key` is one part of a fused linear the layer already has (the forward would
            never read it)."""
    for fused, parts in FUSED.items():
        if key in parts and _has(layer, fused):
            raise ValueError(f"{key} is part of this layer's fused {fused}; set {fused} instead")
    for k in (key, *FUSED.get(key, ())):
        parent, _, leaf = k.rpartition(".")
        if k == key:
            setattr(layer.get_submodule(parent), leaf, lin)
        elif _has(layer, k):
            delattr(layer.get_submodule(parent), leaf)


def _has(layer: nn.Module, key: str) -> bool:
    parent, _, leaf = key.rpartition(".")
    return hasattr(layer.get_submodule(parent), leaf)


def _concat_blocks(parts: list):
    """One `ggml_blocks.Blocks` of 4-bit `parts` stacked along the output rows (no offset = 0)."""
    from relayinfer.cloud.ggml_blocks import Blocks

    off = [np.zeros_like(b.scale) if b.offset is None else b.offset for b in parts]
    return Blocks(4, parts[0].block, np.concatenate([b.q for b in parts]), np.concatenate([b.scale for b in parts]),
                  None if all(b.offset is None for b in parts) else np.concatenate(off))


def _block_linears(model: Llama, reader, cfg: ModelConfig) -> int:
    """Replace each layer linear whose GGUF tensor has 4-bit blocks by a `BlockLinear` over them
    (Q/K rows un-permuted as `load_llama` does for the dense weights), Q/K/V and gate/up each as
    one where all of them are (`FUSED`); returns how many layer linears run on blocks.

    Raises:
        ValueError: the file has no layer linear in 4-bit blocks (nothing would run on blocks)."""
    from relayinfer.cloud.ggml_blocks import FOUR_BIT, decompose

    _check_has_blocks(reader)
    found = {}  # (layer, key) -> (blocks, bias)
    for t, layer, key in _layer_linears(reader):
        k, n = int(t.shape[0]), int(t.shape[1])
        if t.tensor_type.name not in FOUR_BIT or n % 16:  # 8-bit, F16/F32: stay dense
            continue
        blocks = decompose(np.asarray(t.data).reshape(n, -1), t.tensor_type.name, k)
        if key in ("attn.wq", "attn.wk") and cfg.rope_permuted:
            heads = cfg.n_heads if key == "attn.wq" else cfg.n_kv_heads
            blocks = type(blocks)(blocks.bits, blocks.block, _unpermute(blocks.q, heads), _unpermute(blocks.scale, heads),
                                  None if blocks.offset is None else _unpermute(blocks.offset, heads))
        found[layer, key] = blocks, model.layers[layer].get_submodule(key).bias
    if not found:
        raise ValueError("weights 'gguf': no 4-bit layer linear of this file has output features a multiple of 16 "
                         "(torch's int4 kernel packs 16 rows at a time); use weights 'fp32'")
    for i in sorted({i for i, _ in found}):
        mine = {key: v for (j, key), v in found.items() if j == i}
        for fused, parts in FUSED.items():
            if all(p in mine for p in parts):
                got = [mine.pop(p) for p in parts]
                biases = [b for _, b in got]
                bias = None if all(b is None for b in biases) else torch.cat(
                    [torch.zeros(blk.q.shape[0]) if b is None else b.detach().float() for (blk, _), b in zip(got, biases)])
                mine[fused] = _concat_blocks([blk for blk, _ in got]), bias
        for key, (blocks, bias) in mine.items():
            set_block_linear(model.layers[i], key, BlockLinear(blocks, bias))
    return len(found)
