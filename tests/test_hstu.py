"""HSTU: the layer equals a float64 re-derivation of the reference equations; the cached split
(prefix_forward + rank) equals one full forward on real ML-100K histories at any request time."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from relayinfer.cloud.models.hstu import HSTU, HSTUConfig, kv_bytes_per_token
from relayinfer.cloud.relay.train import pad

DAY = 86_400


def randomize(m: HSTU, std: float = 0.5) -> HSTU:
    """Non-trivial weights everywhere (biases included), so every term of the equations matters."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * std)
    return m


@pytest.fixture(scope="module")
def model(data):
    torch.manual_seed(0)
    return randomize(HSTU(HSTUConfig(num_items=data.num_items, max_len=256, query_chunk=64)), 0.3).eval()


def reference_layer(x, ts, W, o_w, o_b, pos_w, ts_w, H, dqk, dv, eps=1e-6, num_buckets=128, n=None):
    """The equations of generative-recommenders research/modeling/sequential/hstu.py (commit 1bfa87ca),
    re-derived densely for padded (B, N, D) input: `SequentialTransductionUnitJagged.forward` with
    normalization="rel_bias", linear_config="uvqk", silu, concat_ua=False, eval mode;
    `_hstu_attention_maybe_from_cache` (n = N = max length); `RelativeBucketedTimeAndPositionBasedBias`
    with bucketization_fn = (log(|x|.clamp(min=1)) / 0.301).long(). Written from the reference, not
    from our layer: the Toeplitz position table and `ext_timestamps` are built as the reference does.
    n: the attention normaliser (the reference's n = max length; None = N, its default)."""
    B, N, D = x.shape
    mm = F.silu(F.layer_norm(x, [D], eps=eps) @ W)                       # torch.mm(normed_x, self._uvqk)
    u, v, q, k = torch.split(mm, [dv * H, dv * H, dqk * H, dqk * H], dim=-1)
    qk = torch.einsum("bnhd,bmhd->bhnm", q.reshape(B, N, H, dqk), k.reshape(B, N, H, dqk))
    t = F.pad(pos_w[: 2 * N - 1], [0, N]).repeat(N)
    t = t[..., :-N].reshape(1, N, 3 * N - 2)
    r = (2 * N - 1) // 2
    ext = torch.cat([ts, ts[:, N - 1:N]], dim=1)
    buckets = torch.clamp((torch.log(torch.abs(ext[:, 1:].unsqueeze(2) - ext[:, :-1].unsqueeze(1)).clamp(min=1))
                           / 0.301).long(), min=0, max=num_buckets)
    rab = t[:, :, r:-r] + torch.index_select(ts_w, 0, buckets.view(-1)).view(B, N, N)
    a = F.silu(qk + rab.unsqueeze(1)) / (n or N)
    a = a * torch.tril(torch.ones(N, N, dtype=x.dtype)).unsqueeze(0).unsqueeze(0)
    attn = torch.einsum("bhnm,bmhd->bnhd", a, v.reshape(B, N, H, dv)).reshape(B, N, H * dv)
    return (u * F.layer_norm(attn, [H * dv], eps=eps)) @ o_w.T + o_b + x


@pytest.mark.parametrize("heads,layers,chunk,norm", [(1, 1, 64, None), (2, 3, 7, None), (3, 2, 16, None), (2, 2, 16, 11)])
def test_layer_equals_reference_float64(data, heads, layers, chunk, norm):
    """Our layers (float64, random weights incl. biases) vs the re-derived reference, layer by layer,
    on real ML-100K item ids and timestamps: full-length rows and a right-padded batch. norm: an
    attention normaliser sized apart from max_len (HSTUConfig.attn_norm; the reference's n)."""
    N = 40
    cfg = HSTUConfig(num_items=data.num_items, dim=24, heads=heads, attn_dim=8, hidden_dim=12, layers=layers,
                     max_len=N, query_chunk=chunk, dropout=0.0, attn_norm=norm)
    m = randomize(HSTU(cfg), 0.4).double().eval()
    users = [u for u in data.users if len(data.items[u]) >= N][:3]
    items, lengths = pad([data.items[u][:N] for u in users], N)
    ts, _ = pad([data.ts[u][:N] for u in users], N)
    lengths[1] = 23                                           # ragged row
    ts_ref = ts.clone()
    ts_ref[1, 23:] = ts[1, 22]  # the reference reads the slot after the last event; ours reuses the last event's time
    x = m.emb(items)
    y = x_ref = x
    worst = 0.0
    with torch.no_grad():
        for layer in m.layers:
            y = layer(y, ts, lengths)
            x_ref = reference_layer(x_ref, ts_ref, layer.uvqk.weight.T, layer.out.weight, layer.out.bias,
                                    layer.pos_w, layer.ts_w, heads, cfg.attn_dim, cfg.hidden_dim, n=norm)
            for b in range(len(users)):                        # valid rows only (padding rows are unspecified)
                n = int(lengths[b])
                worst = max(worst, (y[b, :n] - x_ref[b, :n]).abs().max().item())
            y = torch.where((torch.arange(N)[None, :] < lengths[:, None])[..., None], y, x_ref)  # same padding rows
    assert worst < 1e-9, worst
    assert (y - x).abs().max() > 0.1                          # the layers did change the input


def test_layer_reference_last_row_uses_its_own_timestamp(data):
    """Guard of the one documented difference: with the reference's padding timestamp (0) after a
    ragged row, only that row's last valid position differs."""
    N = 16
    cfg = HSTUConfig(num_items=data.num_items, dim=16, heads=2, attn_dim=8, hidden_dim=8, layers=1, max_len=N, dropout=0.0)
    m = randomize(HSTU(cfg), 0.4).double().eval()
    u = next(u for u in data.users if len(data.items[u]) >= N)
    items, ts = torch.from_numpy(data.items[u][None, :N]), torch.from_numpy(data.ts[u][None, :N]).clone()
    ts[0, 10:] = 0
    lengths = torch.tensor([10])
    layer = m.layers[0]
    with torch.no_grad():
        x = m.emb(items)
        y = layer(x, ts, lengths)
        ref = reference_layer(x, ts, layer.uvqk.weight.T, layer.out.weight, layer.out.bias, layer.pos_w, layer.ts_w,
                              2, 8, 8)
    d = (y[0, :10] - ref[0, :10]).abs().max(-1).values
    assert d[:9].max() < 1e-9 and d[9] > 1e-6


def test_ml100k_loaded(data):
    assert len(data.users) == 943 and data.num_items == 1682
    assert sum(len(v) for v in data.items.values()) == 100_000
    assert all(np.all(np.diff(data.ts[u]) >= 0) for u in data.users)


def _batch(data, L, N, seed):
    rng = np.random.default_rng(seed)
    users = [u for u in data.users if len(data.items[u]) >= L][:3]
    items, lengths = pad([data.items[u][:L] for u in users], L)
    ts, _ = pad([data.ts[u][:L] for u in users], L)
    lengths[-1] = max(1, L // 2)              # ragged batch: right padding must not leak
    items[-1, lengths[-1]:] = 0
    cands = torch.from_numpy(rng.integers(1, data.num_items + 1, (len(users), N)))
    last = ts.gather(1, (lengths - 1)[:, None])[:, 0]
    return items, ts, lengths, cands, last


@pytest.mark.parametrize("L,N", [(1, 1), (7, 3), (50, 20), (200, 101)])
def test_cached_forward_equals_full(model, data, L, N):
    items, ts, lengths, cands, last = _batch(data, L, N, L)
    kv = model.prefix_forward(items, ts, lengths)
    for rts in (None, last + 3600, last + 30 * DAY):            # one prefix, several request times
        with torch.no_grad():
            full = model(items, ts, lengths, cands, rts)
        torch.testing.assert_close(model.rank(kv, cands, rts), full, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(model.score(items, ts, lengths, cands, rts).detach(), full, rtol=1e-4, atol=1e-4)
        # candidates do not see each other: scoring one alone gives the same number
        torch.testing.assert_close(model.rank(kv, cands[:, :1], rts)[:, 0], full[:, 0], rtol=1e-4, atol=1e-4)
        # padding: the short row equals its own unpadded run (the normaliser is a constant, not the batch's)
        k = int(lengths[-1])
        r1 = None if rts is None else rts[-1:]
        alone = model.rank(model.prefix_forward(items[-1:, :k], ts[-1:, :k], lengths[-1:]), cands[-1:], r1)
        torch.testing.assert_close(alone, full[-1:], rtol=1e-4, atol=1e-4)


def test_cached_forward_equals_full_float64(data):
    """The split is exact, not just close: in float64 prefix + rank == one pass to 1e-12."""
    m = randomize(HSTU(HSTUConfig(num_items=data.num_items, max_len=128, query_chunk=32)), 0.3).double().eval()
    items, ts, lengths, cands, last = _batch(data, 90, 17, 5)
    kv = m.prefix_forward(items, ts, lengths)
    for rts in (last, last + 7 * DAY, last + 400 * DAY):
        with torch.no_grad():
            full = m(items, ts, lengths, cands, rts)
        assert (m.rank(kv, cands, rts) - full).abs().max().item() < 1e-12


def test_request_time_changes_scores_and_prefix_is_reused(model, data):
    """Same history at two request times scores differently; the prefix does not depend on the time."""
    items, ts, lengths, cands, last = _batch(data, 60, 30, 3)
    kv = model.prefix_forward(items, ts, lengths)
    kv_before = kv.clone()
    soon, later = model.rank(kv, cands, last + 60), model.rank(kv, cands, last + 30 * DAY)
    assert (soon - later).abs().max() > 1e-3
    for a, b in zip(kv.k + kv.v, kv_before.k + kv_before.v):
        assert torch.equal(a, b)                                   # ranking never writes the prefix
    with pytest.raises(ValueError, match="request_ts"):
        model.rank(kv, cands, torch.zeros(2, 2, 2, dtype=torch.long))


def test_history_changes_scores(model, data):
    u = data.users[0]
    items, ts = torch.from_numpy(data.items[u][None, :30]), torch.from_numpy(data.ts[u][None, :30])
    c = torch.arange(1, 11)[None]
    a = model.rank(model.prefix_forward(items, ts, torch.tensor([30])), c)
    b = model.rank(model.prefix_forward(items.flip(1), ts, torch.tensor([30])), c)
    assert (a - b).abs().max() > 1e-3


def test_kv_bytes_per_token(data):
    cfg = HSTUConfig(num_items=data.num_items)
    m = HSTU(cfg).eval()
    assert kv_bytes_per_token(cfg) == cfg.layers * cfg.heads * (cfg.attn_dim + cfg.hidden_dim) * 4 == 1024
    L = 37
    kv = m.prefix_forward(torch.randint(1, 100, (1, L)), torch.arange(L)[None], torch.tensor([L]))
    assert kv.nbytes == L * kv_bytes_per_token(cfg) + L * 8 + 8


def test_bad_input(model):
    with pytest.raises(ValueError, match="empty history"):
        model.prefix_forward(torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 0, dtype=torch.long), torch.tensor([0]))
    kv = model.prefix_forward(torch.tensor([[1, 2]]), torch.tensor([[0, 5]]), torch.tensor([2]))
    with pytest.raises(ValueError, match="unknown candidate"):
        model.rank(kv, torch.tensor([[5000]]))
    with pytest.raises(ValueError, match="unknown history"):
        model.prefix_forward(torch.tensor([[0, 9999]]), torch.tensor([[0, 5]]), torch.tensor([2]))
    L = model.cfg.max_len
    with pytest.raises(ValueError, match="max_len"):
        model.prefix_forward(torch.ones(1, L, dtype=torch.long), torch.arange(L)[None], torch.tensor([L]))


def test_cut_point_candidates_equal_shorter_prefix(model, data):
    """Training scores candidates at several cut points from one prefix pass, each at the target
    event's time: this equals ranking against the prefix of the history truncated at that cut,
    exactly where the shared prefix's row c-1 has the same time query (ts[c] == ts[c-1], the
    documented training skew), and differs otherwise."""
    u = next(u for u in data.users if len(data.items[u]) >= 61)
    L = 60
    items = torch.from_numpy(data.items[u][None, :L])
    ts = torch.from_numpy(data.ts[u][None, :L + 1]).clone()
    cuts = [1, 17, 17, 59, 60]
    for c in cuts[:-1]:
        ts[0, c] = ts[0, c - 1]                         # make the skew vanish at these cuts
    ts = torch.cummax(ts, 1).values
    rts = ts[0, cuts][None]                             # (1, 5): the target's time; for cut 60 the event after
    ts = ts[:, :L]
    kv = model._prefix(items, ts, torch.tensor([L]))
    cands = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        got = model._rank(kv, cands, torch.tensor([cuts]), rts)[0]
    for j, t in enumerate(cuts):
        want = model.rank(model.prefix_forward(items[:, :t], ts[:, :t], torch.tensor([t])), cands[:, j:j + 1],
                          rts[:, j])[0, 0]
        torch.testing.assert_close(got[j], want, rtol=1e-4, atol=1e-4)
    # the skew is real where the times differ: a 30-day gap right after the cut at 30
    ts2 = ts.clone()
    ts2[0, 30:] += 30 * DAY
    kv2 = model._prefix(items, ts2, torch.tensor([L]))
    with torch.no_grad():
        shared = model._rank(kv2, cands[:, :1], torch.tensor([[30]]), ts2[:, 30:31])[0, 0]
    alone = model.rank(model.prefix_forward(items[:, :30], ts2[:, :30], torch.tensor([30])), cands[:, :1], ts2[:, 30])[0, 0]
    assert (shared - alone).abs() > 1e-4


def test_production_shape_split_is_exact(data):
    """The production-shaped config (random weights, timing study) is sized like published HSTU rankers
    and its split equals the one-pass forward too."""
    from relayinfer.cloud.models.hstu import PRODUCTION_SHAPE
    cfg = HSTUConfig(num_items=data.num_items, **PRODUCTION_SHAPE)
    assert cfg.layers >= 8 and cfg.dim >= 256 and cfg.max_len - 1 >= 8192
    assert kv_bytes_per_token(cfg) == 8 * 4 * (64 + 64) * 4 == 16384
    torch.manual_seed(0)
    m = HSTU(cfg).eval()
    items, ts, lengths, cands, last = _batch(data, 300, 20, 9)
    kv = m.prefix_forward(items, ts, lengths)
    for rts in (last + 60, last + 90 * DAY):
        with torch.no_grad():
            full = m(items, ts, lengths, cands, rts)
        torch.testing.assert_close(m.rank(kv, cands, rts), full, rtol=1e-4, atol=1e-4)


def test_attention_normaliser_sized_to_the_data(data):
    """attn_norm (the reference's n sized to the data) divides the attention output by n instead of
    max_len and keeps the long position range; the split stays exact; a bad value is refused."""
    cfg = HSTUConfig(num_items=data.num_items, max_len=256, query_chunk=32, attn_norm=101, dropout=0.0)
    m = randomize(HSTU(cfg), 0.3).double().eval()
    ref = randomize(HSTU(HSTUConfig(**{**cfg.__dict__, "attn_norm": None})), 0.3).double().eval()
    items, ts, lengths, cands, last = _batch(data, 120, 9, 3)
    with torch.no_grad():
        full = m(items, ts, lengths, cands, last + DAY)
        x = m.emb(items)
        q, k, v = (torch.randn(1, 5, cfg.heads, d, dtype=torch.float64) for d in (32, 32, 32))
        rab, mask = torch.zeros(1, 5, 5, dtype=torch.float64), torch.ones(1, 5, 5, dtype=torch.bool)
        ratio = ref.layers[0].attend(q, k, v, rab, mask) / m.layers[0].attend(q, k, v, rab, mask)
        assert (m.layers[0](x, ts, lengths) - ref.layers[0](x, ts, lengths)).abs().max() > 0   # the layer uses it
    torch.testing.assert_close(ratio, torch.full_like(ratio, 101 / 256))
    assert (m.rank(m.prefix_forward(items, ts, lengths), cands, last + DAY) - full).abs().max() < 1e-12
    assert m.layers[0].pos_w.shape == (2 * 256 - 1,)
    with pytest.raises(ValueError, match="attn_norm"):
        HSTU(HSTUConfig(num_items=10, attn_norm=0))
