"""HSTU: the cached split (prefix_forward + rank) equals one full forward on real ML-100K histories."""
import numpy as np
import pytest
import torch

from relayinfer.cloud.models.hstu import HSTU, HSTUConfig, kv_bytes_per_token
from relayinfer.cloud.relay.train import pad


@pytest.fixture(scope="module")
def model(data):
    torch.manual_seed(0)
    m = HSTU(HSTUConfig(num_items=data.num_items, query_chunk=64))
    with torch.no_grad():  # non-zero position/time biases so the bias path is exercised
        for layer in m.layers:
            layer.pos_w.weight.normal_(0, 0.5), layer.time_w.weight.normal_(0, 0.5)
    return m.eval()


def test_ml100k_loaded(data):
    assert len(data.users) == 943 and data.num_items == 1682
    assert sum(len(v) for v in data.items.values()) == 100_000
    assert all(np.all(np.diff(data.ts[u]) >= 0) for u in data.users)


@pytest.mark.parametrize("L,N", [(1, 1), (7, 3), (50, 20), (200, 101)])
def test_cached_forward_equals_full(model, data, L, N):
    rng = np.random.default_rng(L)
    users = [u for u in data.users if len(data.items[u]) >= L][:3]
    items, lengths = pad([data.items[u][:L] for u in users], L)
    ts, _ = pad([data.ts[u][:L] for u in users], L)
    lengths[-1] = max(1, L // 2)              # ragged batch: right padding must not leak
    items[-1, lengths[-1]:] = 0
    cands = torch.from_numpy(rng.integers(1, data.num_items + 1, (len(users), N)))
    with torch.no_grad():
        full = model(items, ts, lengths, cands)
    cached = model.rank(model.prefix_forward(items, ts, lengths), cands)
    torch.testing.assert_close(cached, full, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model.score(items, ts, lengths, cands).detach(), full, rtol=1e-4, atol=1e-4)
    # candidates do not see each other: scoring one alone gives the same number
    one = model.rank(model.prefix_forward(items, ts, lengths), cands[:, :1])
    torch.testing.assert_close(one[:, 0], full[:, 0], rtol=1e-4, atol=1e-4)
    # padding: the short row equals its own unpadded run
    k = int(lengths[-1])
    alone = model.rank(model.prefix_forward(items[-1:, :k], ts[-1:, :k], lengths[-1:]), cands[-1:])
    torch.testing.assert_close(alone, full[-1:], rtol=1e-4, atol=1e-4)


def test_history_changes_scores(model, data):
    u = data.users[0]
    items, ts = torch.from_numpy(data.items[u][None, :30]), torch.from_numpy(data.ts[u][None, :30])
    c = torch.arange(1, 11)[None]
    a = model.rank(model.prefix_forward(items, ts, torch.tensor([30])), c)
    b = model.rank(model.prefix_forward(items.flip(1), ts, torch.tensor([30])), c)
    assert (a - b).abs().max() > 1e-3


def test_kv_bytes_per_token(model):
    cfg = model.cfg
    assert kv_bytes_per_token(cfg) == cfg.layers * cfg.heads * (cfg.attn_dim + cfg.hidden_dim) * 4 == 1024
    L = 37
    kv = model.prefix_forward(torch.randint(1, 100, (1, L)), torch.arange(L)[None], torch.tensor([L]))
    assert kv.nbytes == L * kv_bytes_per_token(cfg) + L * 8 + 8


def test_bad_input(model):
    with pytest.raises(ValueError, match="empty history"):
        model.prefix_forward(torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 0, dtype=torch.long), torch.tensor([0]))
    kv = model.prefix_forward(torch.tensor([[1, 2]]), torch.tensor([[0, 5]]), torch.tensor([2]))
    with pytest.raises(ValueError, match="unknown candidate"):
        model.rank(kv, torch.tensor([[5000]]))
    with pytest.raises(ValueError, match="unknown history"):
        model.prefix_forward(torch.tensor([[0, 9999]]), torch.tensor([[0, 5]]), torch.tensor([2]))


def test_cut_point_candidates_equal_shorter_prefix(model, data):
    """Training scores candidates at several cut points from one prefix pass: each equals ranking
    against the prefix of the history truncated at that cut (causality)."""
    u = next(u for u in data.users if len(data.items[u]) >= 60)
    L = 60
    items, ts = torch.from_numpy(data.items[u][None, :L]), torch.from_numpy(data.ts[u][None, :L])
    kv = model._prefix(items, ts, torch.tensor([L]))
    cuts = torch.tensor([[1, 17, 17, 59, 60]])
    cands = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        got = model._rank(kv, cands, cuts)[0]
    for j, t in enumerate(cuts[0].tolist()):
        want = model.rank(model.prefix_forward(items[:, :t], ts[:, :t], torch.tensor([t])), cands[:, j:j + 1])[0, 0]
        torch.testing.assert_close(got[j], want, rtol=1e-4, atol=1e-4)
