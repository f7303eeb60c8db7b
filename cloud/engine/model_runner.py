"""Runs one engine step on the `Llama` weights over a paged KV cache.

All tokens scheduled in a step (prefill chunks of some sequences, one decode token of others) are
flattened into one [1, N, dim] activation and run through `Llama.decoder`, the same blocks the
single-request engine runs, so every linear layer (Q/K/V/O projections, SwiGLU, norms) is one
matmul over the whole batch: that is where continuous batching gains on a CPU (the weights are read
once per step instead of once per sequence). Only the attention core differs, and it lives in the
cache object handed to the model: `PagedKV.attend` writes the step's K/V to their slots and attends
each query over its own sequence's keys, gathered from the paged cache through the block tables
(PagedAttention, Kwon et al. SOSP 2023, done here by `index_select` instead of a fused kernel):

* the decode tokens of the step (one query each) attend in one call per layer and padded length:
  a row's keys are gathered by `index_select` and padded (masked) to a multiple of
  `DECODE_BUCKET` tokens, and rows are batched only with rows of the same padded length, so a
  row's attention is the same bits alone or in any batch (padding it to the batch's longest row
  changed it by ~6e-8, which the bf16-rounded matmul inputs of `weights='gguf'` turned into other
  tokens; "batch invariance", He et al., Thinking Machines 2025, "Defeating Nondeterminism in LLM
  Inference");
* a prefill chunk (several queries, causal mask over cached + new keys) attends per sequence.

Both go through `llama.gqa_attention` (grouped-query attention without expanding K/V).

KV storage: per layer one tensor in the model's dtype [2, kv_heads, num_blocks * block_size, head_dim] (K after
RoPE, then V), i.e. blocks of `block_size` consecutive slots. Token position p of a sequence lives
in slot `block_table[p // block_size] * block_size + p % block_size`. This is the
[num_blocks, block_size] page layout with the K/V and head axes moved first, so that gathering
sequences' keys and values by slot is one `index_select` on axis 2 yielding [2, kv_heads, T,
head_dim] in one copy. `ModelRunner.k[i]` / `.v[i]` are views of the K and V halves (P/D export).
"""
from __future__ import annotations

import torch

from relayinfer.cloud.models.llama import CAUSAL, Llama, gqa_attention, rope, runs_on_blocks, with_window
from relayinfer.protocol.kvhandoff import kv_bytes_per_token as _kv_bytes_per_token
from relayinfer.protocol.model.model_file import ModelConfig

from .scheduler import ScheduledSeq

DECODE_BUCKET = 64
"""tokens: a decode row's keys are padded to a multiple of this, and batched with rows of the same
padded length only (see the module docstring)."""


def key_mask(length: int, lens: torch.Tensor, window: int = 0) -> torch.Tensor:
    """bool [B, 1, 1, length]: the padded key slots each of B single queries sees. Key p of a
    sequence of length n (the query at position n - 1; `lens` int64 [B]) is visible iff p < n and,
    for `window` > 0 (a sliding-window layer), n - 1 - p < window."""
    p = torch.arange(length, device=lens.device)[None, :]
    n = lens[:, None]
    seen = p < n
    if window:
        seen = seen & (n - 1 - p < window)
    return seen[:, None, None]


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> int:
    """K and V of one token over all layers in `dtype` (bytes; `protocol.kvhandoff.kv_bytes_per_token`)."""
    return _kv_bytes_per_token(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, torch.empty((), dtype=dtype).element_size())


class PagedKV:
    """The batching engine's `KVCache` for one step (see the module docstring).

    Built by `ModelRunner.run` from the scheduled sequences; the model's blocks call
    `attend(layer, q, k, v, mask, obs)` with q [1, n_heads, N, head_dim] and k, v
    [1, kv_heads, N, head_dim] over the step's N tokens (batch order). `mask` is unused (each
    sequence's mask is built here) and `obs` (prompt scoring) is refused. `window` > 0 (a
    sliding-window layer) narrows each query's keys to its last `window` positions.

    Args:
        kv: per-layer cache tensors [2, kv_heads, slots, head_dim].
        slots: int64 [N], the cache slot of each token of the step.
        dec_rows: int64 [B] rows (token indices) of the step's single-query tokens, or None.
        dec_groups: those rows grouped by padded key length L (a multiple of `DECODE_BUCKET`): per
            group (index int64 [Bg] into dec_rows, gather int64 [Bg * L] the slots of their keys
            padded with slot 0, L, mask bool [Bg, 1, 1, L] key-padding mask (`key_mask`), lens int64
            [Bg] their sequence lengths and the longest as an int, for sliding-window layers).
        spans: (first row, end row, key count, slots int64 [key count], causal mask bool
            [rows, key count], or `llama.CAUSAL` for a chunk from position 0) of each multi-token
            chunk.
        row_spans: instead of `spans` where rows must be computed as decode rows are (see
            `ModelRunner.row_invariant`): (first row, end row, slots int64 [L] of one sequence's
            keys padded to L, a multiple of `DECODE_BUCKET`, L, mask, lens (each row's position + 1)
            and the longest, as in a decode group) per run of a chunk's rows in one padded length.
    """

    def __init__(self, kv: list[torch.Tensor], slots: torch.Tensor, dec_rows: torch.Tensor | None,
                 dec_groups: list, spans: list, row_spans: list | None = None):
        self.kv, self.slots = kv, slots
        self.dec_rows, self.dec_groups, self._windows = dec_rows, dec_groups, {}
        self.spans, self.row_spans = spans, row_spans or []

    def attend(self, layer, q, k, v, mask=None, obs=None, window: int = 0):
        if obs is not None:
            raise ValueError("the batching engine does not score prompts (obs); use TorchEngine.prefill_scored")
        cache = self.kv[layer]
        cache.index_copy_(2, self.slots, torch.stack((k[0], v[0])))  # [2, kv_heads, N, head_dim] to slots
        _, h, n, hd = q.shape
        if self.dec_rows is not None and not self.spans and not self.row_spans and self.dec_rows.numel() == n:
            return self._decode(cache, q[0].transpose(0, 1), window).transpose(0, 1)[None]  # decode-only step
        o = q.new_empty(1, h, n, hd)
        if self.dec_rows is not None:
            o[0, :, self.dec_rows] = self._decode(cache, q[0, :, self.dec_rows].transpose(0, 1), window).transpose(0, 1)
        for r, e, t, g, m in self.spans:
            kv = cache.index_select(2, g)[:, None]                      # [2, 1, kv_heads, t, head_dim]
            o[:, :, r:e] = gqa_attention(q[:, :, r:e], kv[0], kv[1], with_window(m, e - r, t, window, q.device))
        for si, (r, e, g, *keys) in enumerate(self.row_spans):  # each row as a decode row: one query, padded keys
            kv = cache.index_select(2, g)[:, None].expand(-1, e - r, -1, -1, -1)  # [2, rows, kv_heads, L, head_dim]
            rows = q[0, :, r:e].transpose(0, 1).reshape(e - r, h, 1, hd)
            seen = self._mask(("row", si), *keys, window)
            o[0, :, r:e] = gqa_attention(rows, kv[0], kv[1], seen).view(e - r, h, hd).transpose(0, 1)
        return o

    def _decode(self, cache: torch.Tensor, q: torch.Tensor, window: int = 0) -> torch.Tensor:
        """q [B, n_heads, head_dim] of the single-query tokens -> attention output, same shape;
        `window` > 0: each query sees only its sequence's last `window` keys."""
        b, h, hd = q.shape
        kvh = cache.shape[1]
        out = None if len(self.dec_groups) == 1 else q.new_empty(b, h, hd)
        for gi, (idx, gather, *keys) in enumerate(self.dec_groups):
            length = keys[0]
            n = gather.numel() // length
            kv = cache.index_select(2, gather).view(2, kvh, n, length, hd).transpose(1, 2)
            qg = q if out is None else q[idx]
            o = gqa_attention(qg.reshape(n, h, 1, hd), kv[0], kv[1], self._mask(("dec", gi), *keys, window)).view(n, h, hd)
            if out is None:
                return o
            out[idx] = o
        return out

    def _mask(self, key, length: int, mask: torch.Tensor, lens: torch.Tensor, longest: int, window: int = 0):
        """The key mask of decode group / row span `key` for a layer with `window`: its padding mask
        `mask` when no sequence is longer than the window, else `key_mask` with the window
        (computed once per step, group and window)."""
        if not window or longest <= window:
            return mask
        if (key, window) not in self._windows:
            self._windows[key, window] = key_mask(length, lens, window)
        return self._windows[key, window]


class ModelRunner:
    """Owns the paged KV tensors and executes scheduled batches.

    Args:
        model: a loaded `Llama` (eval mode); its `decoder` and `head` run every step.
        num_blocks, block_size: cache geometry (blocks x tokens per block).
    """

    def __init__(self, model: Llama, num_blocks: int, block_size: int):
        self.model, self.cfg = model, model.cfg
        self.num_blocks, self.block_size = num_blocks, block_size
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        cfg = self.cfg
        shape = (2, cfg.n_kv_heads, num_blocks * block_size, cfg.head_dim)
        self.kv = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(cfg.n_layers)]
        self.k = [t[0] for t in self.kv]  # views: [kv_heads, slots, head_dim]
        self.v = [t[1] for t in self.kv]
        self.row_invariant = runs_on_blocks(model)
        """True for a model on GGUF blocks: prefill rows attend exactly as decode rows do (one query
        over its sequence's keys padded to a multiple of `DECODE_BUCKET`), so a token's K/V and
        output are the same bits whether it was computed alone, in a chunk of any size, after a
        prefix-cache hit or in decode. SDPA's causal kernel picks its blocking by the chunk's
        length (~1e-5 differences in K), which the bf16-rounded matmul inputs of `BlockLinear`
        turned into other tokens when a prefix was cached by a longer prompt. fp32 models keep the
        causal kernel (2.3x faster at 2,048 tokens); those differences stay within fp32 rounding."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv)

    def slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """Cache slots (int64 [end - start]) of token positions [start, end) of a sequence with
        `block_table`."""
        bs = self.block_size
        pos = torch.arange(start, end, device=self.device)
        return torch.tensor(block_table, dtype=torch.long, device=self.device)[pos // bs] * bs + pos % bs

    def _table_slots(self, tables: list[list[int]], length: int) -> torch.Tensor:
        """Slots of positions 0..length-1 of each table ([len(tables), length] int64); a table with
        fewer blocks is padded with block 0 (its slots are masked by the caller)."""
        bs = self.block_size
        nb = -(-length // bs)
        t = torch.tensor([tb[:nb] + [0] * (nb - len(tb[:nb])) for tb in tables], dtype=torch.long, device=self.device)
        return (t[:, :, None] * bs + torch.arange(bs, device=self.device)).view(len(tables), nb * bs)[:, :length]

    @torch.inference_mode()
    def gather_kv(self, slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """P/D export: K/V of `slots` into `out` [n_layers, 2, kv_heads, len(slots), head_dim], one
        `index_select` per layer straight into the buffer (no intermediate copy) when `out` has the
        cache's device and dtype; otherwise (a host buffer for a GPU cache, another dtype) each
        layer's selection is copied and converted into it."""
        same = out.device == self.kv[0].device and out.dtype == self.dtype
        for li in range(self.cfg.n_layers):
            if same:
                torch.index_select(self.kv[li], 2, slots, out=out[li])
            else:
                out[li].copy_(self.kv[li].index_select(2, slots))
        return out

    @torch.inference_mode()
    def export_kv(self, block_table: list[int], start: int, end: int, dtype: torch.dtype = torch.float16):
        """The KV hand-off to a device: K/V of token positions [start, end) of a sequence with
        `block_table` as a numpy array [n_layers, 2, kv_heads, end - start, head_dim] in `dtype`
        (default float16: the device's ONNX past-KV layout per layer, keys after RoPE), one
        `index_select` per layer converted into the buffer."""
        cfg = self.cfg
        out = torch.empty((cfg.n_layers, 2, cfg.n_kv_heads, end - start, cfg.head_dim), dtype=dtype)
        return self.gather_kv(self.slots(block_table, start, end), out).numpy()

    @torch.inference_mode()
    def scatter_kv(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """P/D import: write `kv` [n_layers, 2, kv_heads, len(slots), head_dim] (any device; the
        cache's dtype, or converted to it) into `slots`."""
        kv = kv.to(self.kv[0].device, self.dtype)
        for li in range(self.cfg.n_layers):
            self.kv[li].index_copy_(2, slots, kv[li])

    def prepare(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, PagedKV, list[int]]:
        """Flatten a step: token ids int64 [N], positions int64 [N], the step's `PagedKV`, and the
        rows whose logits are sampled (the last token of each sequence with `.sample`)."""
        bs, dev = self.block_size, self.device
        ids, pos, slot, last_rows = [], [], [], []
        dec_rows, dec_tables, dec_lens, spans, row_spans = [], [], [], [], []
        row = 0
        for s in batch:
            seq, a, b = s.seq, s.start, s.start + s.n
            ids.extend(seq.token_ids[a:b])
            pos.extend(range(a, b))
            table = seq.block_table
            slot.extend(table[q // bs] * bs + q % bs for q in range(a, b))
            if s.n == 1:
                dec_rows.append(row)
                dec_tables.append(table)
                dec_lens.append(b)
            elif self.row_invariant:
                p0 = a
                while p0 < b:  # runs of rows sharing one padded key length
                    length = (p0 // DECODE_BUCKET + 1) * DECODE_BUCKET
                    p1 = min(b, length)
                    lens = torch.arange(p0 + 1, p1 + 1, device=dev)  # row at position p sees keys 0..p
                    row_spans.append((row + p0 - a, row + p1 - a, self._table_slots([table], length)[0], length,
                                      key_mask(length, lens), lens, p1))
                    p0 = p1
            else:
                g = self._table_slots([table], b)[0]
                mask = CAUSAL if a == 0 else \
                    torch.arange(b, device=dev)[None, :] <= torch.arange(a, b, device=dev)[:, None]
                spans.append((row, row + s.n, b, g, mask))  # causal over cached + new keys
            row += s.n
            if s.sample:
                last_rows.append(row - 1)
        groups: dict[int, list[int]] = {}  # padded key length -> indices into dec_rows
        for i, n in enumerate(dec_lens):
            groups.setdefault(-(-n // DECODE_BUCKET) * DECODE_BUCKET, []).append(i)
        dec_groups = []
        for length, idx in sorted(groups.items()):
            lens = torch.tensor([dec_lens[i] for i in idx], device=dev)
            dec_groups.append((torch.tensor(idx, dtype=torch.long, device=dev),
                               self._table_slots([dec_tables[i] for i in idx], length).reshape(-1), length,
                               key_mask(length, lens), lens, max(dec_lens[i] for i in idx)))
        cache = PagedKV(self.kv, torch.tensor(slot, dtype=torch.long, device=dev), spans=spans, row_spans=row_spans,
                        dec_groups=dec_groups,
                        dec_rows=torch.tensor(dec_rows, dtype=torch.long, device=dev) if dec_rows else None)
        return (torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(pos, dtype=torch.long, device=dev),
                cache, last_rows)

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        """Compute the scheduled tokens, write their K/V to the cache, and return float32 logits
        [n_sample, vocab] for the last token of each scheduled sequence that samples (`.sample`),
        in batch order."""
        m = self.model
        ids, pos, cache, last_rows = self.prepare(batch)
        cos, sin = rope(pos, m.inv_freq)                   # [R, N, head_dim]: broadcast over [1, heads, N, hd]
        x = m.decoder(m.embed_tokens(ids[None]), cos, sin, None, cache)
        if not last_rows:
            return torch.empty(0, self.cfg.vocab_size)
        return m.head(x[0, last_rows]).float()
