"""HSTU ranking model in pure PyTorch, with a cacheable user prefix and a request time.

Sources:
- HSTU layer: Zhai et al., "Actions Speak Louder than Words: Trillion-Parameter Sequential
  Transducers for Generative Recommendations", ICML 2024 (Eq. 1-3): U, V, Q, K = Split(SiLU(f1(X)));
  A V = SiLU(Q K^T + rab^{p,t}) V (pointwise, no softmax); Y = f2(Norm(A V) * U). Residual X + Y.
- Reference code, matched equation by equation: meta-recsys/generative-recommenders,
  `generative_recommenders/research/modeling/sequential/hstu.py` (commit 1bfa87ca7c0c, the same
  equations as facebookresearch/generative-recommenders 44b62c6b): `SequentialTransductionUnitJagged`,
  `_hstu_attention_maybe_from_cache`, `RelativeBucketedTimeAndPositionBasedBias` and the bucket
  function `HSTU.__init__` gives it. tests/test_hstu.py re-derives those equations in float64 and
  checks this layer against them (max |delta| < 1e-9).
- Target-aware candidates and the prefix/cached split: generative-recommenders `modules/stu.py`
  (`cached_forward`); RelayGR: the user-history tokens do not depend on the candidates, so
  `prefix_forward(history)` runs once (off the critical path) and `rank(kv, candidates, request_ts)`
  only computes the candidate tokens.

One choice per point where our layer could differ from the reference's older layer:

| point | reference (`research/.../hstu.py`) | here |
|---|---|---|
| attention normalisation | SiLU(QK^T + rab) / n, n = the model's max length (a constant, sized to the data: 200 for ML-1M) | same: / `attn_norm` (default `max_len`; the shipped ML-100K model sets it to its training length 101 while keeping max_len 8192 for long histories; batch-independent; the newer `modules/stu.py` divides by the batch's longest sequence, which makes scores depend on the batch: not copied) |
| QK scaling | none (no 1/sqrt(d)) | same |
| input / output norm | `F.layer_norm` without affine weights, eps 1e-6 | same (`ln_eps`) |
| f1 (uvqk) | one matrix, no bias, N(0, 0.02) init, SiLU | same |
| f2 (output) | Linear with bias, xavier-uniform weight, dropout on its *input* `u * Norm(AV)` | same |
| relative bias | one scalar per layer shared by the heads: position weight w_p[(n-1) + j - i] (2n-1 entries) + time weight w_t[bucket] (129 entries), N(0, 0.02) | same |
| time bucket | floor(ln(max(|dt|, 1)) / 0.301), clamped to 0..128 | same (`time_bucket`) |
| time gap of history row i to key j | ts[i+1] - ts[j] (the next event's time: when the prediction made at row i is used); the last row uses its own timestamp (`ext_timestamps` repeats the last slot) | same for every row but the last; the last *valid* row always uses its own timestamp, also in a right-padded batch (the reference reads the padding slot there) |
| candidates | not in the layer (a retrieval model) | target-aware tokens at position L with timestamp `request_ts`: their time gap to history key j is request_ts - ts[j], to themselves 0; they see the whole valid history and themselves, never each other |

Because no history row reads the request time (the last row uses its own timestamp), the prefix is
the same at every request time: one cached prefix serves a user's rankings at any later time, and
only the candidate rows change with `request_ts`.

Training note (train.py): one prefix pass serves several cut points c of a window. For c < L the
shared prefix's row c-1 uses ts[c] as its time query where a history truncated at c would use its own
ts[c-1]; that one row differs (a small train/serve skew, exact when ts[c] == ts[c-1]).

Sequence layout. History tokens 0..L-1 (item embeddings, causal mask), L < max_len; candidates at
position L. KV cache: per layer K (H x attn_dim) and V (H x hidden_dim) for every history token,
`kv_bytes_per_token(cfg) = layers * H * (attn_dim + hidden_dim) * 4` bytes in float32 (the trained
config: 2 * 2 * (32 + 32) * 4 = 1024 B/token), plus 8 B/token of timestamps. U and the history
outputs are not needed by candidates and are not cached; the last layer's history rows are never run.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class HSTUConfig:
    """Model sizes. Item ids are 1..num_items, 0 is padding.

    max_len: the reference's n, a model constant: the relative position range (2 * max_len - 1
    position weights) and, unless attn_norm is set, the attention normaliser. A history may hold at
    most max_len - 1 events (the candidates sit at position L). time_buckets: the reference's
    num_buckets (129 weights).
    attn_norm: the attention normaliser n (SiLU(QK^T + rab) / n); None = max_len, the reference. The
    reference sizes its one n to the data (200 for ML-1M); a model that must also accept long
    histories (max_len 8192) but trains on short windows sets attn_norm to the training sequence
    length, else its attention output (a sum over <= 100 keys / 8192) falls under LayerNorm's eps and
    is squashed (measured: variance 1.8e-7 < eps 1e-6 in the first layer, bench/RELAY.md).
    Raises ValueError (at model construction) for attn_norm < 1."""
    num_items: int
    dim: int = 64
    heads: int = 2
    attn_dim: int = 32      # per-head Q/K width
    hidden_dim: int = 32    # per-head U/V width
    layers: int = 2
    max_len: int = 8192
    time_buckets: int = 128
    ln_eps: float = 1e-6
    dropout: float = 0.1
    attn_norm: int | None = None
    query_chunk: int = 256   # queries per attention chunk: bounds memory at 8k tokens and is the
                             # preemption point of a pre-inference (see HSTU.prefix_steps)


#: A ranker sized like published HSTU rankers (Zhai et al. 2024, Sec. 4: 8+ layers, d >= 256,
#: histories of thousands of events), used with random weights for the timing study only.
PRODUCTION_SHAPE = dict(dim=256, heads=4, attn_dim=64, hidden_dim=64, layers=8, max_len=8193)


def kv_bytes_per_token(cfg: HSTUConfig, dtype_bytes: int = 4) -> int:
    """Bytes of prefix cache per history token over all layers (K and V; timestamps not included)."""
    return cfg.layers * cfg.heads * (cfg.attn_dim + cfg.hidden_dim) * dtype_bytes


@dataclass
class PrefixKV:
    """Pre-inferred user prefix: per-layer K, V of the history tokens.

    k[l]: (B, L, H, attn_dim) float32; v[l]: (B, L, H, hidden_dim) float32;
    ts: (B, L) int64 seconds; lengths: (B,) int64 valid history lengths (right padding).
    Independent of the request time (see the module docstring).
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


def time_bucket(dt: torch.Tensor, n: int) -> torch.Tensor:
    """Time gap in seconds (int64) -> bucket floor(ln(max(|dt|, 1)) / 0.301) clamped to 0..n (int64).
    The reference's bucketization_fn (research/modeling/sequential/hstu.py, HSTU.__init__), evaluated
    like it: the log of an integer tensor in float32."""
    return (torch.log(dt.abs().clamp(min=1).float()) / 0.301).long().clamp(0, n)


def history_query_ts(ts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """(B, L) event timestamps -> (B, L) time of each history row's query: the next event's
    timestamp, the last valid row (and padding) its own. int64 seconds."""
    nxt = torch.cat([ts[:, 1:], ts[:, -1:]], 1)
    ar = torch.arange(ts.shape[1], device=ts.device)
    return torch.where(ar[None, :] < (lengths - 1)[:, None], nxt, ts)


class HSTULayer(nn.Module):
    """One HSTU layer, equal to the reference's `SequentialTransductionUnitJagged` with
    normalization="rel_bias", linear_config="uvqk", linear_activation="silu", concat_ua=False
    (see the module docstring for the table of choices)."""

    def __init__(self, cfg: HSTUConfig):
        super().__init__()
        self.cfg, H = cfg, cfg.heads
        self.n = cfg.attn_norm or cfg.max_len                 # the attention normaliser
        self.split = [H * cfg.hidden_dim, H * cfg.hidden_dim, H * cfg.attn_dim, H * cfg.attn_dim]
        self.uvqk = nn.Linear(cfg.dim, sum(self.split), bias=False)
        nn.init.normal_(self.uvqk.weight, std=0.02)
        self.pos_w = nn.Parameter(torch.empty(2 * cfg.max_len - 1).normal_(0, 0.02))
        self.ts_w = nn.Parameter(torch.empty(cfg.time_buckets + 1).normal_(0, 0.02))
        self.out = nn.Linear(H * cfg.hidden_dim, cfg.dim)
        nn.init.xavier_uniform_(self.out.weight)
        self.drop = nn.Dropout(cfg.dropout)

    def proj(self, x: torch.Tensor):
        """x (B,T,D) -> u (B,T,H*dh), v (B,T,H,dh), q (B,T,H,da), k (B,T,H,da)."""
        B, T, _ = x.shape
        c = self.cfg
        u, v, q, k = F.silu(self.uvqk(F.layer_norm(x, (c.dim,), eps=c.ln_eps))).split(self.split, -1)
        return u, v.view(B, T, c.heads, c.hidden_dim), q.view(B, T, c.heads, c.attn_dim), k.view(B, T, c.heads, c.attn_dim)

    def pos_bias(self, dpos: torch.Tensor) -> torch.Tensor:
        """Key position minus query position (int, <= 0 where visible) -> w_p[(n-1) + dpos]; indices
        of invisible pairs are clamped (their weight is masked anyway)."""
        n = self.cfg.max_len
        return self.pos_w[(dpos + (n - 1)).clamp(0, 2 * n - 2)]

    def attend(self, q, k, v, rab, mask) -> torch.Tensor:
        """SiLU(q k^T + rab) / n (attn_norm, default max_len) on the visible pairs, times v. q (B,Tq,H,da), k (B,Tk,H,da),
        v (B,Tk,H,dh), rab (B,Tq,Tk) or broadcastable, mask (B,Tq,Tk) bool -> (B,Tq,H*dh)."""
        a = F.silu(torch.einsum("bqhd,bkhd->bhqk", q, k) + rab[:, None]) / self.n
        a = a * mask[:, None]
        return torch.einsum("bhqk,bkhd->bqhd", a, v).flatten(2)

    def output(self, x, u, o):
        """o (B,T,H*dh) attention output -> x + f2(dropout(u * Norm(o)))."""
        return x + self.out(self.drop(u * F.layer_norm(o, (o.shape[-1],), eps=self.cfg.ln_eps)))

    def history_steps(self, x, u, v, q, k, tb, valid):
        """Causal pass of the history rows, chunked over queries (yields after each chunk).
        x (B,L,D) and its proj(); tb (B,L,L) uint8 time buckets of the row's query time minus each
        key's time; valid (B,L) bool. Returns the layer output (B,L,D)."""
        B, L, _ = x.shape
        ar = torch.arange(L, device=x.device)
        outs = []
        for s in range(0, L, self.cfg.query_chunk):
            e = min(L, s + self.cfg.query_chunk)
            causal = ar[None, :] <= ar[s:e, None]                                        # (Tq,L)
            mask = (causal[None] & valid[:, None, :]) | (ar[None, :] == ar[s:e, None])[None]
            rab = self.pos_bias(ar[None, :] - ar[s:e, None])[None] + self.ts_w[tb[:, s:e].long()]
            outs.append(self.attend(q[:, s:e], k, v, rab, mask))
            yield
        return self.output(x, u, torch.cat(outs, 1))

    def forward(self, x: torch.Tensor, ts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """One layer over history rows only (causal): x (B,L,D) float, ts (B,L) int64 seconds,
        lengths (B,) int64 -> (B,L,D). Rows past a length are padding (their values are unspecified)."""
        u, v, q, k = self.proj(x)
        valid = torch.arange(x.shape[1], device=x.device)[None, :] < lengths[:, None]
        tb = time_bucket(history_query_ts(ts, lengths)[:, :, None] - ts[:, None, :], self.cfg.time_buckets)
        return _run_to_end(self.history_steps(x, u, v, q, k, tb.to(torch.uint8), valid))


def _run_to_end(gen):
    """Exhaust a step generator and return its return value."""
    while True:
        try:
            next(gen)
        except StopIteration as done:
            return done.value


class HSTU(nn.Module):
    """HSTU ranker: score(history, candidate, request time) from the candidate token's output.

    forward(items, ts, lengths, cands, request_ts) -> (B, N) float32 scores (one pass, target-aware mask).
    prefix_forward(items, ts, lengths) -> PrefixKV; rank(kv, cands, request_ts) -> (B, N); the pair
    equals forward at every request time.
    Inputs: items (B, L) int64 ids in 1..num_items (0 = padding, right-padded), ts (B, L) int64 seconds,
    lengths (B,) int64 in 1..max_len-1, cands (B, N) int64 ids in 1..num_items, request_ts (B,) int64
    seconds, the time the candidates are ranked (None: the last history event's time).
    Raises ValueError on empty or too long histories, ids out of range or a bad request_ts shape.
    """

    def __init__(self, cfg: HSTUConfig):
        super().__init__()
        if cfg.attn_norm is not None and cfg.attn_norm < 1:
            raise ValueError(f"attn_norm must be >= 1 (or None for max_len), got {cfg.attn_norm}")
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
        """Raise ValueError on empty or too long histories, bad lengths or item ids outside 1..num_items."""
        if items.ndim != 2 or items.shape[1] == 0 or bool((lengths < 1).any()):
            raise ValueError("empty history: every request needs at least one history event")
        if bool((lengths > items.shape[1]).any()):
            raise ValueError("lengths exceed the history tensor")
        if int(lengths.max()) >= self.cfg.max_len:
            raise ValueError(f"history longer than the model's max_len - 1 = {self.cfg.max_len - 1} events")
        n = self.cfg.num_items
        for name, t in (("history", items), ("candidate", cands)):
            if t is None:
                continue
            valid = t if name == "candidate" else t[torch.arange(t.shape[1]) < lengths[:, None]]
            if valid.numel() and (int(valid.min()) < 1 or int(valid.max()) > n):
                raise ValueError(f"unknown {name} item id (valid ids are 1..{n})")

    @staticmethod
    def _request_ts(ts, lengths, request_ts, N) -> torch.Tensor:
        """request_ts None | (B,) | (B,N) -> (B,N) int64; None means the last history event's time."""
        B = ts.shape[0]
        if request_ts is None:
            return ts.gather(1, (lengths - 1)[:, None]).expand(B, N)
        r = torch.as_tensor(request_ts, dtype=torch.long)
        if r.ndim == 1 and r.shape[0] == B:
            return r[:, None].expand(B, N)
        if r.shape == (B, N):
            return r
        raise ValueError(f"request_ts must be (B,) or (B, N), got {tuple(r.shape)}")

    def _score(self, h: torch.Tensor, cands: torch.Tensor) -> torch.Tensor:
        return (self.norm(h) * self.emb(cands)).sum(-1) + self.item_bias(cands)[..., 0]

    # ---- one pass over history + candidates (the reference) -----------------------------------
    def forward(self, items, ts, lengths, cands, request_ts=None):
        """One pass over [history; candidates] with the target-aware mask (the reference). (B, N)."""
        self.check(items, lengths, cands)
        B, L = items.shape
        N = cands.shape[1]
        c = self.cfg
        rts = self._request_ts(ts, lengths, request_ts, N)
        ar = torch.arange(L, device=items.device)
        valid_h = ar[None, :] < lengths[:, None]                                   # (B,L)
        pos = torch.cat([ar.expand(B, L), lengths[:, None].expand(B, N)], 1)       # (B,T)
        t_key = torch.cat([ts, rts], 1)                                            # key timestamps
        t_query = torch.cat([history_query_ts(ts, lengths), rts], 1)               # query timestamps
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
            for s in range(first, T, c.query_chunk):  # chunk queries to bound memory at 8k tokens
                e = min(T, s + c.query_chunk)
                rab = layer.pos_bias(pos[:, None, :] - pos[:, s:e, None])
                rab = rab + layer.ts_w[time_bucket(t_query[:, s:e, None] - t_key[:, None, :], c.time_buckets)]
                outs.append(layer.attend(q[:, s:e], k, v, rab, m[:, s:e]))
            x = layer.output(x[:, first:], u[:, first:], torch.cat(outs, 1))
        return self._score(x[:, -N:], cands)

    # ---- cached path ---------------------------------------------------------------------------
    def _prefix(self, items, ts, lengths) -> PrefixKV:
        """Differentiable prefix pass (history only, causal) -> PrefixKV."""
        return _run_to_end(self.prefix_steps(items, ts, lengths))

    def prefix_steps(self, items, ts, lengths):
        """The prefix pass as a generator: yields after each query chunk of each layer (a point where
        a serving loop may run a ranking request first: chunked pre-inference), returns the PrefixKV.
        Time buckets are computed once for all layers as uint8 (B,L,L) (64 MiB at 8k tokens)."""
        B, L = items.shape
        c = self.cfg
        valid = torch.arange(L, device=items.device)[None, :] < lengths[:, None]
        tq = history_query_ts(ts, lengths)
        tb = torch.empty(B, L, L, dtype=torch.uint8)
        for s in range(0, L, c.query_chunk):
            e = min(L, s + c.query_chunk)
            tb[:, s:e] = time_bucket(tq[:, s:e, None] - ts[:, None, :], c.time_buckets)
        x = self.drop(self.emb(items))
        ks, vs = [], []
        for li, layer in enumerate(self.layers):
            u, v, q, k = layer.proj(x)
            ks.append(k), vs.append(v)
            if li == len(self.layers) - 1:
                break  # the last layer's history outputs are never read by candidates
            x = yield from layer.history_steps(x, u, v, q, k, tb, valid)
        return PrefixKV(ks, vs, ts, lengths)

    def _rank(self, kv: PrefixKV, cands: torch.Tensor, cand_lengths: torch.Tensor | None = None,
              request_ts=None) -> torch.Tensor:
        """Differentiable candidate pass. Candidates of a request share position L and the request
        time, so their bias to history keys is one (B,1,L) row broadcast over N.
        cand_lengths (B,N), training only: candidate n sees just the first cand_lengths[b,n] history
        events (a cut point; see the module docstring's training note), so one prefix pass serves many
        next-item targets; request_ts may then be (B,N) (the target event's time per cut)."""
        B, N = cands.shape
        L = kv.ts.shape[1]
        c = self.cfg
        ar = torch.arange(L)
        cl = kv.lengths[:, None] if cand_lengths is None else cand_lengths                 # (B,1) or (B,N)
        rts = self._request_ts(kv.ts, kv.lengths, request_ts, N)                           # (B,N)
        if cand_lengths is None and bool((rts == rts[:, :1]).all()):
            rts = rts[:, :1]                                                               # one row for all
        valid_h = ar < cl[..., None]                                                      # (B,1|N,L)
        dpos = ar - cl[..., None]                                                         # (B,1|N,L)
        tb = time_bucket(rts[..., None] - kv.ts[:, None, :], c.time_buckets)             # (B,1|N,L)
        x = self.drop(self.emb(cands))
        for li, layer in enumerate(self.layers):
            u, v, q, k = layer.proj(x)
            rab = layer.pos_bias(dpos) + layer.ts_w[tb]                                   # (B,1|N,L)
            a_h = F.silu(torch.einsum("bqhd,bkhd->bhqk", q, kv.k[li]) + rab[:, None]) * valid_h[:, None]
            a_s = F.silu((q * k).sum(-1) + layer.pos_w[c.max_len - 1] + layer.ts_w[0])   # (B,N,H) self, distance 0
            o = torch.einsum("bhqk,bkhd->bqhd", a_h, kv.v[li]) + a_s[..., None] * v
            x = layer.output(x, u, (o / layer.n).flatten(2))
        return self._score(x, cands)

    def score(self, items, ts, lengths, cands, request_ts=None) -> torch.Tensor:
        """Full inference through the split path (prefix then candidates) in one call: (B, N) float32.
        This is what the baseline runs on the critical path."""
        self.check(items, lengths, cands)
        return self._rank(self._prefix(items, ts, lengths), cands, request_ts=request_ts)

    @torch.no_grad()
    def prefix_forward(self, items, ts, lengths) -> PrefixKV:
        """History only (causal) -> per-layer K, V. Cost O(L^2) per layer; run once per user history."""
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
    def rank(self, kv: PrefixKV, cands: torch.Tensor, request_ts=None) -> torch.Tensor:
        """Candidates only, against the cached prefix, at request time request_ts ((B,) int64 s; None:
        the last history event's time). Cost O(N * L) per layer. Returns (B, N) float32.
        Raises ValueError on unknown candidate ids, a batch-size mismatch or a bad request_ts shape."""
        n = self.cfg.num_items
        if cands.ndim != 2 or cands.shape[0] != kv.ts.shape[0]:
            raise ValueError("candidates must be (B, N) with the prefix's batch size")
        if cands.numel() and (int(cands.min()) < 1 or int(cands.max()) > n):
            raise ValueError(f"unknown candidate item id (valid ids are 1..{n})")
        return self._rank(kv, cands, request_ts=request_ts)

    def describe(self) -> dict:
        """Config, KV bytes per token and parameter count."""
        return {**asdict(self.cfg), "kv_bytes_per_token": kv_bytes_per_token(self.cfg),
                "params": sum(p.numel() for p in self.parameters())}
