"""HSTU ranking model in pure PyTorch, with a cacheable user prefix.

Sources:
- HSTU layer: Zhai et al., "Actions Speak Louder than Words: Trillion-Parameter Sequential
  Transducers for Generative Recommendations", ICML 2024 (Eq. 1-3): U, V, Q, K = Split(SiLU(f1(X)));
  A V = SiLU(Q K^T + rab^{p,t}) V (pointwise, no softmax); Y = f2(Norm(A V) * U). Residual X + Y.
- Target-aware mask and the prefix/cached split follow meta-recsys/generative-recommenders
  (`modules/stu.py`, `STULayer.forward` / `cached_forward`, its `test_cached_forward`).
- RelayGR (pre-inferred user prefixes for long-sequence GR ranking): the user-history tokens do not
  depend on the candidates, so `prefix_forward(history)` runs once (off the critical path) and
  `rank(kv, candidates)` only computes the candidate tokens.

Sequence layout. History tokens 0..L-1 (item embeddings, causal, relative position and time bias);
candidates are appended at position L with the timestamp of the last history event. Each candidate
sees the whole (valid) history and itself, never the other candidates, so its score depends only on
(history, candidate) and the cached path is exact.

Attention is normalised by the number of keys a query may see (i+1 for history token i, L+1 for a
candidate): independent of the candidate count, so the split equals the full forward.

KV cache. Per layer the cache holds K (H x attn_dim) and V (H x hidden_dim) for every history token:
`kv_bytes_per_token(cfg) = layers * H * (attn_dim + hidden_dim) * 4` bytes in float32
(default config: 2 * 2 * (32 + 32) * 4 = 1024 B/token, 512 B per layer per token), plus 8 B/token
of timestamps. U and the outputs of history tokens are not needed by candidates and are not cached.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class HSTUConfig:
    """Model sizes. Item ids are 1..num_items, 0 is padding."""
    num_items: int
    dim: int = 64
    heads: int = 2
    attn_dim: int = 32      # per-head Q/K width
    hidden_dim: int = 32    # per-head U/V width
    layers: int = 2
    pos_buckets: int = 48
    time_buckets: int = 40
    dropout: float = 0.1
    query_chunk: int = 256   # queries per attention chunk: bounds memory at 8k tokens and is the
                             # preemption point of a pre-inference (see HSTU.prefix_steps)


def kv_bytes_per_token(cfg: HSTUConfig, dtype_bytes: int = 4) -> int:
    """Bytes of prefix cache per history token over all layers (K and V; timestamps not included)."""
    return cfg.layers * cfg.heads * (cfg.attn_dim + cfg.hidden_dim) * dtype_bytes


@dataclass
class PrefixKV:
    """Pre-inferred user prefix: per-layer K, V of the history tokens.

    k[l]: (B, L, H, attn_dim) float32; v[l]: (B, L, H, hidden_dim) float32;
    ts: (B, L) int64 seconds; lengths: (B,) int64 valid history lengths (right padding).
    """
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    ts: torch.Tensor
    lengths: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.k, *self.v, self.ts, self.lengths])

    def clone(self) -> "PrefixKV":
        """Deep copy (stands for a DRAM -> accelerator reload)."""
        return PrefixKV([t.clone() for t in self.k], [t.clone() for t in self.v], self.ts.clone(), self.lengths.clone())


def pos_bucket(d: torch.Tensor, n: int) -> torch.Tensor:
    """Relative distance (int, >= 0) -> bucket: exact below 8, then 4 log2 buckets per octave."""
    d = d.clamp(min=0)
    log = 8 + (torch.log2(d.clamp(min=8).float() / 8) * 4).long()
    return torch.where(d < 8, d, log).clamp(max=n - 1)


def time_bucket(dt: torch.Tensor, n: int) -> torch.Tensor:
    """Time gap in seconds (int) -> bucket floor(2 * ln(1 + |dt|)) (1 s .. years)."""
    return (torch.log1p(dt.abs().float()) * 2).long().clamp(max=n - 1)


class HSTULayer(nn.Module):
    """One HSTU layer (Zhai et al. 2024, Eq. 1-3), relative position + time bias per head."""

    def __init__(self, cfg: HSTUConfig):
        super().__init__()
        self.cfg, H = cfg, cfg.heads
        self.split = [H * cfg.hidden_dim, H * cfg.hidden_dim, H * cfg.attn_dim, H * cfg.attn_dim]
        self.norm_in = nn.LayerNorm(cfg.dim)
        self.uvqk = nn.Linear(cfg.dim, sum(self.split))
        self.pos_w = nn.Embedding(cfg.pos_buckets, H)
        self.time_w = nn.Embedding(cfg.time_buckets, H)
        nn.init.zeros_(self.pos_w.weight), nn.init.zeros_(self.time_w.weight)
        self.norm_out = nn.LayerNorm(H * cfg.hidden_dim)
        self.out = nn.Linear(H * cfg.hidden_dim, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)
        self.alpha = 1.0 / math.sqrt(cfg.attn_dim)

    def proj(self, x: torch.Tensor):
        """x (B,T,D) -> u (B,T,H*dh), v (B,T,H,dh), q (B,T,H,da), k (B,T,H,da)."""
        B, T, _ = x.shape
        u, v, q, k = F.silu(self.uvqk(self.norm_in(x))).split(self.split, -1)
        c = self.cfg
        return u, v.view(B, T, c.heads, c.hidden_dim), q.view(B, T, c.heads, c.attn_dim), k.view(B, T, c.heads, c.attn_dim)

    def bias(self, pos_q, pos_k, ts_q, ts_k):
        """(B,Tq), (B,Tk) positions / timestamps -> rab (B,H,Tq,Tk): one gather from a joint table."""
        c = self.cfg
        table = (self.pos_w.weight[:, None, :] + self.time_w.weight[None, :, :]).flatten(0, 1)  # (P*T, H)
        idx = pos_bucket(pos_q[:, :, None] - pos_k[:, None, :], c.pos_buckets) * c.time_buckets
        idx += time_bucket(ts_q[:, :, None] - ts_k[:, None, :], c.time_buckets)
        return F.embedding(idx, table).permute(0, 3, 1, 2)

    def scores(self, q, k, rab):
        """Pointwise attention weights SiLU(alpha * q k^T + rab): (B,H,Tq,Tk)."""
        return F.silu(torch.einsum("bqhd,bkhd->bhqk", q, k) * self.alpha + rab)

    def output(self, x, u, o):
        """o (B,T,H*dh) attention output -> x + f2(Norm(o) * u)."""
        return x + self.drop(self.out(self.norm_out(o) * u))


def _run_to_end(gen):
    """Exhaust a step generator and return its return value."""
    while True:
        try:
            next(gen)
        except StopIteration as done:
            return done.value


class HSTU(nn.Module):
    """HSTU ranker: score(history, candidate) from the candidate token's output.

    forward(items, ts, lengths, cands) -> (B, N) float32 scores (one pass, target-aware mask).
    prefix_forward(items, ts, lengths) -> PrefixKV; rank(kv, cands) -> (B, N); the pair equals forward.
    Inputs: items (B, L) int64 ids in 1..num_items (0 = padding, right-padded), ts (B, L) int64 seconds,
    lengths (B,) int64 >= 1, cands (B, N) int64 ids in 1..num_items.
    Raises ValueError on empty histories or ids out of range.
    """

    def __init__(self, cfg: HSTUConfig):
        super().__init__()
        self.cfg = cfg
        self.emb = nn.Embedding(cfg.num_items + 1, cfg.dim, padding_idx=0)
        nn.init.normal_(self.emb.weight, std=0.1)
        self.layers = nn.ModuleList(HSTULayer(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.item_bias = nn.Embedding(cfg.num_items + 1, 1)   # per-item prior (popularity) added to scores
        nn.init.zeros_(self.item_bias.weight)
        self.drop = nn.Dropout(cfg.dropout)

    # ---- helpers -------------------------------------------------------------------------------
    def check(self, items: torch.Tensor, lengths: torch.Tensor, cands: torch.Tensor | None = None):
        """Raise ValueError on empty histories, bad lengths or item ids outside 1..num_items."""
        if items.ndim != 2 or items.shape[1] == 0 or bool((lengths < 1).any()):
            raise ValueError("empty history: every request needs at least one history event")
        if bool((lengths > items.shape[1]).any()):
            raise ValueError("lengths exceed the history tensor")
        n = self.cfg.num_items
        for name, t in (("history", items), ("candidate", cands)):
            if t is None:
                continue
            valid = t if name == "candidate" else t[torch.arange(t.shape[1]) < lengths[:, None]]
            if valid.numel() and (int(valid.min()) < 1 or int(valid.max()) > n):
                raise ValueError(f"unknown {name} item id (valid ids are 1..{n})")

    def _score(self, h: torch.Tensor, cands: torch.Tensor) -> torch.Tensor:
        return (self.norm(h) * self.emb(cands)).sum(-1) + self.item_bias(cands)[..., 0]

    # ---- one pass over history + candidates (the reference) -----------------------------------
    def forward(self, items, ts, lengths, cands):
        """One pass over [history; candidates] with the target-aware mask (the reference). (B, N)."""
        self.check(items, lengths, cands)
        B, L = items.shape
        N = cands.shape[1]
        ar = torch.arange(L, device=items.device)
        valid_h = ar[None, :] < lengths[:, None]                                   # (B,L)
        last_ts = ts.gather(1, (lengths - 1)[:, None])                             # (B,1)
        pos = torch.cat([ar.expand(B, L), lengths[:, None].expand(B, N)], 1)       # (B,T)
        tss = torch.cat([ts, last_ts.expand(B, N)], 1)
        T = L + N
        i = torch.arange(T, device=items.device)
        is_c = i >= L
        # target-aware mask (B,T,T): history query i sees valid history keys j <= i;
        # candidate query sees all valid history keys and itself.
        m = (i[None, :, None] >= i[None, None, :]) & ~is_c[None, None, :]
        m = m | (is_c[None, :, None] & ~is_c[None, None, :])
        m = (m & torch.cat([valid_h, torch.zeros(B, N, dtype=torch.bool)], 1)[:, None, :]) | torch.eye(T, dtype=torch.bool)[None]
        m = m.expand(B, T, T)
        x = self.drop(self.emb(torch.cat([items, cands], 1)))
        for li, layer in enumerate(self.layers):
            u, v, q, k = layer.proj(x)
            # the last layer only needs candidate queries (history outputs are never read after it)
            first = L if li == len(self.layers) - 1 else 0
            outs = []
            for s in range(first, T, self.cfg.query_chunk):  # chunk queries to bound memory at 8k tokens
                e = min(T, s + self.cfg.query_chunk)
                a = layer.scores(q[:, s:e], k, layer.bias(pos[:, s:e], pos, tss[:, s:e], tss))
                mm = m[:, s:e]
                a = a * mm[:, None] / mm.sum(-1)[:, None, :, None]
                outs.append(torch.einsum("bhqk,bkhd->bqhd", a, v).flatten(2))
            x = layer.output(x[:, first:], u[:, first:], torch.cat(outs, 1))
        return self._score(x[:, -N:], cands)

    # ---- cached path ---------------------------------------------------------------------------
    def _prefix(self, items, ts, lengths) -> PrefixKV:
        """Differentiable prefix pass (history only, causal) -> PrefixKV."""
        return _run_to_end(self.prefix_steps(items, ts, lengths))

    def prefix_steps(self, items, ts, lengths):
        """The prefix pass as a generator: yields after each query chunk of each layer (a point where
        a serving loop may run a ranking request first: chunked pre-inference), returns the PrefixKV.
        Bias buckets are computed once for all layers: positions (L,L) and time gaps (B,L,L) as uint8
        (64 MiB at 8k tokens)."""
        B, L = items.shape
        c = self.cfg
        ar = torch.arange(L, device=items.device)
        valid_h = ar[None, :] < lengths[:, None]
        pb = pos_bucket(ar[:, None] - ar[None, :], c.pos_buckets).to(torch.uint8)                # (L,L)
        tb = torch.empty(B, L, L, dtype=torch.uint8)
        for s in range(0, L, c.query_chunk):
            e = min(L, s + c.query_chunk)
            tb[:, s:e] = time_bucket(ts[:, s:e, None] - ts[:, None, :], c.time_buckets)
        x = self.drop(self.emb(items))
        ks, vs = [], []
        for li, layer in enumerate(self.layers):
            u, v, q, k = layer.proj(x)
            ks.append(k), vs.append(v)
            if li == len(self.layers) - 1:
                break  # the last layer's history outputs are never read by candidates
            outs = []
            for s in range(0, L, c.query_chunk):
                e = min(L, s + c.query_chunk)
                mm = ((ar[s:e, None] >= ar[None, :])[None] & valid_h[:, None, :]) | (ar[s:e, None] == ar[None, :])[None]
                rab = layer.pos_w(pb[s:e].long()).permute(2, 0, 1)[None] + layer.time_w(tb[:, s:e].long()).permute(0, 3, 1, 2)
                a = layer.scores(q[:, s:e], k, rab)
                a = a * mm[:, None] / mm.sum(-1)[:, None, :, None]
                outs.append(torch.einsum("bhqk,bkhd->bqhd", a, v).flatten(2))
                yield
            x = layer.output(x, u, torch.cat(outs, 1))
        return PrefixKV(ks, vs, ts, lengths)

    def _rank(self, kv: PrefixKV, cands: torch.Tensor, cand_lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Differentiable candidate pass. All candidates of a request share position L and the last
        timestamp, so their bias to history keys is one (B,H,1,L) row broadcast over N.
        cand_lengths (B,N), training only: candidate n sees just the first cand_lengths[b,n] history
        events (a cut point; by causality the prefix of a prefix is the prefix), so one prefix pass
        serves many next-item targets."""
        B, N = cands.shape
        L = kv.ts.shape[1]
        c = self.cfg
        ar = torch.arange(L)
        cl = kv.lengths[:, None] if cand_lengths is None else cand_lengths                 # (B,1) or (B,N)
        valid_h = (ar < cl[..., None])[:, None]                                           # (B,1,1|N,L)
        pb = pos_bucket(cl[..., None] - ar, c.pos_buckets)                                # (B,1|N,L)
        tb = time_bucket(kv.ts.gather(1, cl - 1)[..., None] - kv.ts[:, None, :], c.time_buckets)
        zero = torch.zeros((), dtype=torch.long)
        denom = (cl + 1).to(kv.k[0].dtype)[..., None, None]                               # (B,1|N,1,1)
        x = self.drop(self.emb(cands))
        for li, layer in enumerate(self.layers):
            u, v, q, k = layer.proj(x)
            rab = (layer.pos_w(pb) + layer.time_w(tb)).permute(0, 3, 1, 2)                # (B,H,1|N,L)
            a_h = layer.scores(q, kv.k[li], rab) * valid_h
            self_rab = layer.pos_w(zero) + layer.time_w(zero)                           # (H,) distance 0
            a_s = F.silu((q * k).sum(-1) * layer.alpha + self_rab)                      # (B,N,H)
            o = torch.einsum("bhqk,bkhd->bqhd", a_h, kv.v[li]) + a_s[..., None] * v
            x = layer.output(x, u, (o / denom).flatten(2))
        return self._score(x, cands)

    def score(self, items, ts, lengths, cands) -> torch.Tensor:
        """Full inference through the split path (prefix then candidates) in one call: (B, N) float32.
        This is what the baseline runs on the critical path and what training differentiates."""
        self.check(items, lengths, cands)
        return self._rank(self._prefix(items, ts, lengths), cands)

    @torch.no_grad()
    def prefix_forward(self, items, ts, lengths) -> PrefixKV:
        """History only (causal) -> per-layer K, V. Cost O(L^2) per layer; run once per user request."""
        return _run_to_end(self.prefix_forward_steps(items, ts, lengths))

    def prefix_forward_steps(self, items, ts, lengths):
        """prefix_forward as a generator (no grad): yields between attention chunks, returns the PrefixKV.
        Raises ValueError (at the first next()) on bad input."""
        self.check(items, lengths)
        steps = self.prefix_steps(items, ts, lengths)
        while True:
            with torch.no_grad():         # grad mode only around the compute, not across the yield
                try:
                    next(steps)
                except StopIteration as done:
                    kv = done.value
                    break
            yield
        return PrefixKV([t.contiguous() for t in kv.k], [t.contiguous() for t in kv.v], ts.clone(), lengths.clone())

    @torch.no_grad()
    def rank(self, kv: PrefixKV, cands: torch.Tensor) -> torch.Tensor:
        """Candidates only, against the cached prefix. Cost O(N * L) per layer. Returns (B, N) float32.
        Raises ValueError on unknown candidate ids or a batch-size mismatch."""
        n = self.cfg.num_items
        if cands.ndim != 2 or cands.shape[0] != kv.ts.shape[0]:
            raise ValueError("candidates must be (B, N) with the prefix's batch size")
        if cands.numel() and (int(cands.min()) < 1 or int(cands.max()) > n):
            raise ValueError(f"unknown candidate item id (valid ids are 1..{n})")
        return self._rank(kv, cands)

    def describe(self) -> dict:
        """Config, KV bytes per token and parameter count."""
        return {**asdict(self.cfg), "kv_bytes_per_token": kv_bytes_per_token(self.cfg),
                "params": sum(p.numel() for p in self.parameters())}
