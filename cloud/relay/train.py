"""Train the HSTU ranker on MovieLens-100K (next-item ranking) and evaluate HR@10 / NDCG@10.

Objective: the serving task itself. Each step samples users, a window of their training history and
`cuts` cut points t in it; for each cut the model scores [true next item] + K sampled negatives as
target-aware candidates after history[:t] at request time ts[t] (the target event's time) (one prefix pass per window serves all its cuts, see
HSTU._rank's cand_lengths), with a softmax cross-entropy over the 1 + K scores.
Negatives are uniform over items, so the sampled softmax keeps the popularity prior (item bias).

Evaluation (leave-last-out, RecBole's full-sort protocol): the history is every event but the last,
all 1,682 items are ranked except those already in the history, HR@10 = hit rate of the held-out item
in the top 10, NDCG@10 = 1/log2(rank+1) when it is. Popularity baseline: items ranked by their count in
the training events, same exclusions.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from relayinfer.cloud.models.hstu import HSTU, HSTUConfig
from relayinfer.cloud.relay.data import ML100K, load_ml100k


def cache_dir() -> Path:
    """$RELAYINFER_CACHE, else $XDG_CACHE_HOME/relayinfer, else ~/.cache/relayinfer (created)."""
    d = os.environ.get("RELAYINFER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "relayinfer")
    Path(d).mkdir(parents=True, exist_ok=True)
    return Path(d)


def checkpoint_path() -> Path:
    """<cache_dir>/relay/hstu_ml100k.pt"""
    return cache_dir() / "relay" / "hstu_ml100k.pt"


@dataclass
class TrainConfig:
    """Training settings (steps, users per step, negatives and cut points per window, window length)."""
    steps: int = 500
    batch: int = 64
    negatives: int = 31         # per cut point
    cuts: int = 8               # next-item targets per user window per step
    max_len: int = 100          # training/eval histories are the last max_len events
    lr: float = 3e-3
    weight_decay: float = 0.0
    seed: int = 0
    users: int | None = None    # train on the first `users` users only (tests)
    attn_norm: int | None = None  # the model's attention normaliser n (HSTUConfig.attn_norm); None = the
                                  # longest trained sequence, max_len history events + the candidate
                                  # position (101), as the reference sizes n to its data (8192 = the
                                  # model's max_len, the shipped checkpoint's)


def pad(seqs: list[np.ndarray], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad the last max_len events of each sequence -> (B, Lmax) int64, lengths (B,)."""
    seqs = [s[-max_len:] for s in seqs]
    L = max(len(s) for s in seqs)
    out = np.zeros((len(seqs), L), dtype=np.int64)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return torch.from_numpy(out), torch.tensor([len(s) for s in seqs])


def popularity(data: ML100K) -> np.ndarray:
    """Item counts over the training events (all but each user's last two), shape (num_items + 1,)."""
    c = np.zeros(data.num_items + 1, dtype=np.int64)
    for u in data.users:
        np.add.at(c, data.items[u][:-2], 1)
    return c


def train(data: ML100K, cfg: TrainConfig, mcfg: HSTUConfig | None = None, log=print,
          losses: list | None = None) -> HSTU:
    """Train and return the model (eval mode). `log` gets a line every ~10% of the steps; the loss of
    every step is appended to `losses` if given."""
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    model = HSTU(mcfg or HSTUConfig(num_items=data.num_items, attn_norm=cfg.attn_norm or cfg.max_len + 1))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - 0.9 * s / max(1, cfg.steps))  # linear decay to 10 %
    users, hist, hts, _ = data.split("train")
    if cfg.users:
        users, hist, hts = users[: cfg.users], hist[: cfg.users], hts[: cfg.users]
    keep = [i for i, h in enumerate(hist) if len(h) >= 2]
    t0 = time.perf_counter()
    K, n = cfg.cuts, cfg.negatives
    for step in range(cfg.steps):
        model.train()
        idx = rng.choice(keep, size=min(cfg.batch, len(keep)), replace=False)
        ends = [int(rng.integers(2, len(hist[i]) + 1)) for i in idx]   # window hist[e-max_len:e]
        wins = [(hist[i][max(0, e - cfg.max_len):e], hts[i][max(0, e - cfg.max_len):e]) for i, e in zip(idx, ends)]
        items, lengths = pad([w[0] for w in wins], cfg.max_len)
        ts, _ = pad([w[1] for w in wins], cfg.max_len)
        cuts = np.stack([rng.integers(1, len(w[0]), size=K) for w in wins])            # (B,K) cut points
        pos = torch.from_numpy(np.take_along_axis(items.numpy(), cuts, 1))[..., None]  # (B,K,1) next items
        neg = torch.from_numpy(rng.integers(1, data.num_items + 1, size=(len(idx), K, n)))
        cands = torch.cat([pos, neg], 2)                                                # (B,K,1+n)
        cl = torch.from_numpy(cuts)[..., None].expand_as(cands)
        rts = torch.from_numpy(np.take_along_axis(ts.numpy(), cuts, 1))[..., None].expand_as(cands)  # target's time
        model.check(items, lengths, cands.flatten(1))
        logits = model._rank(model._prefix(items, ts, lengths), cands.flatten(1), cl.flatten(1),
                             rts.flatten(1)).view(cands.shape)
        dup = cands == pos
        dup[..., 0] = False                               # sampled copies of the positive are not negatives
        logits = logits.masked_fill(dup, -1e9)
        loss = F.cross_entropy(logits.flatten(0, 1), torch.zeros(len(idx) * K, dtype=torch.long))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if losses is not None:
            losses.append(loss.item())
        if step % max(1, cfg.steps // 10) == 0 or step == cfg.steps - 1:
            log(f"step {step:5d}  loss {loss.item():.4f}  {time.perf_counter() - t0:6.1f}s")
    return model.eval()


@torch.no_grad()
def evaluate(model: HSTU, data: ML100K, part: str = "test", max_len: int = 100, k: int = 10,
             users: int | None = None, batch: int = 32) -> dict:
    """Full-sort HR@k / NDCG@k of the model and of popularity on the leave-last-out split.

    Uses the cached path (prefix_forward once per user, then rank all items at the request time: the
    held-out event's timestamp, the time the user was there). Returns
    {"hr": float, "ndcg": float, "pop_hr": float, "pop_ndcg": float, "users": int}.
    """
    model.eval()
    us, hist, hts, ys = data.split(part)
    when = np.array([data.ts[u][-1 if part == "test" else -2] for u in us], dtype=np.int64)  # request time
    if users:
        hist, hts, ys, when = hist[:users], hts[:users], ys[:users], when[:users]
    allc = torch.arange(1, data.num_items + 1)
    pop = torch.from_numpy(popularity(data)[1:]).double()
    ranks, pranks = [], []
    for s in range(0, len(hist), batch):
        h, t, y = hist[s:s + batch], hts[s:s + batch], torch.from_numpy(ys[s:s + batch])
        items, lengths = pad(h, max_len)
        ts, _ = pad(t, max_len)
        kv = model.prefix_forward(items, ts, lengths)
        sc = model.rank(kv, allc.expand(len(h), -1).contiguous(), torch.from_numpy(when[s:s + batch])).double()
        psc = pop.expand(len(h), -1).clone()
        for i, hh in enumerate(h):           # exclude already-seen items (RecBole full sort)
            seen = torch.from_numpy(np.setdiff1d(hh, [y[i].item()])) - 1
            sc[i, seen] = -math.inf
            psc[i, seen] = -math.inf
        for sco, out in ((sc, ranks), (psc, pranks)):
            tgt = sco.gather(1, (y - 1)[:, None])
            out.append((sco > tgt).sum(1) + 1)    # 1-based rank of the held-out item (ties favour it)
    res = {}
    for name, r in (("", torch.cat(ranks)), ("pop_", torch.cat(pranks))):
        hit = r <= k
        res[name + "hr"] = hit.double().mean().item()
        res[name + "ndcg"] = (hit.double() / torch.log2(r.double() + 1)).mean().item()
    res["users"] = len(hist)
    return res


def save(model: HSTU, metrics: dict, path: Path | None = None) -> Path:
    """Write {"config", "state", "metrics"} to the checkpoint path (under the user cache dir)."""
    path = path or checkpoint_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"config": asdict(model.cfg), "state": model.state_dict(), "metrics": metrics}, tmp)
    os.replace(tmp, path)
    return path


def load(path: Path | None = None) -> tuple[HSTU, dict]:
    """Load the checkpoint -> (model in eval mode, metrics). Raises FileNotFoundError if absent and
    ValueError for a checkpoint of the older layer (per-head bucketed biases, no request time)."""
    path = path or checkpoint_path()
    ck = torch.load(path, map_location="cpu", weights_only=True)
    ck["config"].pop("query_chunk", None)   # an execution setting, not part of the model
    if "pos_buckets" in ck["config"]:
        raise ValueError(f"{path} holds the older HSTU layer; retrain it (relayinfer relay train) or use the "
                         "shipped default checkpoint")
    model = HSTU(HSTUConfig(**ck["config"]))
    model.load_state_dict(ck["state"])
    return model.eval(), ck["metrics"]


#: The default checkpoint, shipped in the package (d=64, 2 layers, ~0.8 MB) so that serving and the
#: benchmark never train a weaker model on the fly. Made by `relayinfer relay train --out <this path>`
#: (TrainConfig() defaults, seed 0); its sha256, metrics and command are in DEFAULT_CHECKPOINT_INFO.
DEFAULT_CHECKPOINT = Path(__file__).with_name("hstu_ml100k.pt")
DEFAULT_CHECKPOINT_INFO = Path(__file__).with_name("hstu_ml100k.json")


def default_checkpoint() -> Path:
    """The shipped checkpoint after checking its sha256 against DEFAULT_CHECKPOINT_INFO.
    Raises FileNotFoundError if it is missing, ValueError if its hash does not match."""
    from relayinfer.protocol.model.model_file import file_sha256
    info = json.loads(DEFAULT_CHECKPOINT_INFO.read_text())
    got = file_sha256(DEFAULT_CHECKPOINT)
    if got != info["sha256"]:
        raise ValueError(f"{DEFAULT_CHECKPOINT} has sha256 {got}, expected {info['sha256']}")
    return DEFAULT_CHECKPOINT


def ensure_checkpoint(quick: bool = True, log=print) -> Path:
    """The checkpoint serving and the benchmark use by default: the shipped one (never trained on the
    fly; `quick` is kept for callers and ignored). A model you trained with `relayinfer relay train`
    is used where you pass its path (`relayinfer relay serve --checkpoint PATH`, `RelayClient.launch`)."""
    return default_checkpoint()


def train_and_save(cfg: TrainConfig | None = None, log=print, path: Path | None = None) -> dict:
    """Train on ML-100K, evaluate on the test split, save to `path` (default: the user cache
    checkpoint_path(), not the shipped default); returns the metrics dict."""
    torch.set_num_threads(1)
    data = load_ml100k()
    cfg = cfg or TrainConfig()
    t0 = time.perf_counter()
    model = train(data, cfg, log=log)
    metrics = {**evaluate(model, data, "test", cfg.max_len), "train_s": time.perf_counter() - t0,
               "train": {**asdict(cfg), "attn_norm": model.cfg.attn_norm}}   # the normaliser actually used
    out = save(model, metrics, path)
    metrics["path"] = str(out)
    if out.resolve() == DEFAULT_CHECKPOINT.resolve():
        write_default_info(metrics)
    return metrics


def write_default_info(metrics: dict) -> None:
    """Record the shipped checkpoint's sha256, test metrics and the command that made it."""
    from relayinfer.protocol.model.model_file import file_sha256
    t = metrics.get("train") or {}
    cmd = "relayinfer relay train" + (f" --steps {t['steps']}" if t.get("steps", 500) != 500 else "") + \
        (f" --attn-norm {t['attn_norm']}" if t.get("attn_norm") not in (None, t.get("max_len", 100) + 1) else "") + \
        " --out cloud/relay/hstu_ml100k.pt"
    info = {"sha256": file_sha256(DEFAULT_CHECKPOINT), "command": cmd,
            "metrics": {k: metrics[k] for k in ("hr", "ndcg", "pop_hr", "pop_ndcg", "users")},
            "train": metrics.get("train"), "torch": torch.__version__}
    DEFAULT_CHECKPOINT_INFO.write_text(json.dumps(info, indent=1) + "\n")
