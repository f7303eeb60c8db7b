"""Runs one engine step on the `Llama` weights over a paged KV cache.

All tokens scheduled in a step (prefill chunks of some sequences, one decode token of others) are
flattened into one [N, dim] activation so every linear layer (Q/K/V/O projections, SwiGLU,
norms) is one matmul over the whole batch: that is where continuous batching gains on a CPU (the
weights are read once per step instead of once per sequence). Attention runs per sequence on its
own keys, gathered from the paged cache through its block table (PagedAttention, Kwon et al.
SOSP 2023, done here by `index_select` instead of a fused kernel). The per-sequence attention call
has the same shapes and mask as `Llama.forward` on that sequence alone, so the only numeric
difference from one-request-at-a-time is the row count of the matmuls.

KV storage: per layer one K and one V tensor, float32 [kv_heads, num_blocks * block_size, head_dim]
(K after RoPE), i.e. blocks of `block_size` consecutive slots. Token position p of a sequence
lives in slot `block_table[p // block_size] * block_size + p % block_size`. This is the
[num_blocks, block_size] page layout with the head axis moved first, so that gathering one
sequence's keys by slot (`index_select` on axis 1) yields [kv_heads, T, head_dim] contiguous in
one copy, without the permute a [num_blocks, 2, kv_heads, block_size, head_dim] layout needs.

Grouped-query attention: for a decode token the `rep = n_heads // kv_heads` query heads that share
a KV head are laid out as `rep` query rows of that head ([1, kv_heads, rep, head_dim]), so keys are
never expanded; for prefill chunks (causal mask) the keys are expanded as in `Llama.forward`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from relayinfer.cloud.models.llama import Llama, apply_rope, rope
from relayinfer.protocol.model_file import ModelConfig

from .scheduler import ScheduledSeq


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> int:
    """K and V of one token over all layers: 2 * n_layers * kv_heads * head_dim * element size."""
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size()


class ModelRunner:
    """Owns the paged KV tensors and executes scheduled batches.

    Args:
        model: a loaded `Llama` (eval mode); only its submodules are used.
        num_blocks, block_size: cache geometry (blocks x tokens per block).
    """

    def __init__(self, model: Llama, num_blocks: int, block_size: int):
        self.model, self.cfg = model, model.cfg
        self.num_blocks, self.block_size = num_blocks, block_size
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        cfg = self.cfg
        shape = (cfg.n_kv_heads, num_blocks * block_size, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(cfg.n_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """Cache slots of token positions [start, end) of a sequence with `block_table`."""
        bs = self.block_size
        pos = torch.arange(start, end, device=self.device)
        return torch.tensor(block_table, dtype=torch.long, device=self.device)[pos // bs] * bs + pos % bs

    @torch.inference_mode()
    def gather_kv(self, slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """P/D export: K/V of `slots` into `out` [n_layers, 2, kv_heads, len(slots), head_dim], one
        `index_select` per layer and K/V straight into the buffer (no intermediate copy)."""
        for li in range(self.cfg.n_layers):
            torch.index_select(self.k[li], 1, slots, out=out[li, 0])
            torch.index_select(self.v[li], 1, slots, out=out[li, 1])
        return out

    @torch.inference_mode()
    def scatter_kv(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """P/D import: write `kv` [n_layers, 2, kv_heads, len(slots), head_dim] into `slots`."""
        for li in range(self.cfg.n_layers):
            self.k[li].index_copy_(1, slots, kv[li, 0])
            self.v[li].index_copy_(1, slots, kv[li, 1])

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        """Compute the scheduled tokens, write their K/V to the cache, and return float32 logits
        [n_sample, vocab] for the last token of each scheduled sequence that samples (`.sample`),
        in batch order."""
        m, cfg, bs, dev = self.model, self.cfg, self.block_size, self.device
        h, kvh, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        rep = h // kvh
        ids, pos, slot, spans, last_rows, gathers = [], [], [], [], [], []
        ar = torch.arange(bs, device=dev)
        row = 0
        for s in batch:
            seq, a, b = s.seq, s.start, s.start + s.n
            ids.extend(seq.token_ids[a:b])
            p = list(range(a, b))
            pos.extend(p)
            slot.extend(seq.block_table[q // bs] * bs + q % bs for q in p)
            spans.append((row, row + s.n, a, b))
            table = torch.tensor(seq.block_table[: -(-b // bs)], dtype=torch.long, device=dev)
            gathers.append((table[:, None] * bs + ar).flatten()[:b])  # slots of positions 0..b-1
            row += s.n
            if s.sample:
                last_rows.append(row - 1)
        ids_t = torch.tensor(ids, dtype=torch.long, device=dev)
        pos_t = torch.tensor(pos, dtype=torch.long, device=dev)
        slot_t = torch.tensor(slot, dtype=torch.long, device=dev)
        cos, sin = rope(pos_t, m.inv_freq)                # [N, hd]
        cos, sin = cos[:, None], sin[:, None]              # broadcast over heads: [N, 1, hd]
        masks = [None if (e - r) == 1 else
                 torch.arange(b, device=dev)[None, :] <= torch.arange(a, b, device=dev)[:, None]
                 for (r, e, a, b) in spans]                # causal over cached + new keys
        n = ids_t.shape[0]
        x = m.embed(ids_t[None])                           # [1, N, dim]
        for li, layer in enumerate(m.layers):
            att = layer.attn
            xn = layer.attn_norm(x)
            q = att.wq(xn).view(n, h, hd)
            k = att.wk(xn).view(n, kvh, hd)
            v = att.wv(xn).view(n, kvh, hd)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            kc, vc = self.k[li], self.v[li]
            kc[:, slot_t] = k.transpose(0, 1)              # [kvh, N, hd] written to their slots
            vc[:, slot_t] = v.transpose(0, 1)
            outs = []
            for (r, e, a, b), g, mask in zip(spans, gathers, masks):
                ks, vs = kc.index_select(1, g)[None], vc.index_select(1, g)[None]  # [1, kvh, b, hd]
                if mask is None:  # one query: its rep heads become rep rows of their KV head
                    qs = q[r].view(1, kvh, rep, hd)
                    o = F.scaled_dot_product_attention(qs, ks, vs)      # [1, kvh, rep, hd]
                    outs.append(o.reshape(1, h * hd))
                    continue
                ks = ks[:, :, None].expand(1, kvh, rep, b, hd).reshape(1, h, b, hd)
                vs = vs[:, :, None].expand(1, kvh, rep, b, hd).reshape(1, h, b, hd)
                qs = q[r:e].transpose(0, 1)[None]          # [1, h, s, hd]
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)
                outs.append(o[0].transpose(0, 1).reshape(e - r, h * hd))
            o = torch.cat(outs) if len(outs) > 1 else outs[0]
            x = x + att.wo(o[None])
            hn = layer.ffn_norm(x)
            x = x + layer.down(F.silu(layer.gate(hn)) * layer.up(hn))
        if not last_rows:
            return torch.empty(0, cfg.vocab_size)
        x = m.norm(x[0, last_rows])
        return m.lm_head(x).float()
