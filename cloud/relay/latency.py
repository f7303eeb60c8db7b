"""Latency model of ranking cost vs history length, fitted on this machine (least squares).

prefix_ms(L)    = b0 + b1*L + b2*L^2            pre-inference of the user prefix
cached_ms(L, N) = c0 + c1*N + c2*N*L            ranking against a cached prefix
full_ms(L, N)   = prefix_ms(L) + cached_ms(L, N) full inference on the critical path: HSTU.score runs
                                                 exactly these two passes back to back, so its cost is
                                                 their sum (direct measurements are kept in `samples`
                                                 as a check; on a shared machine their noise would
                                                 otherwise make "full" cheaper than its own prefix)
Measured by timing the real HSTU (one request, float32, torch threads as set by the caller).
The sequence-aware trigger and the cascade simulator both read it.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from relayinfer.cloud.models.hstu import HSTU


def _feats(kind: str, L, N):
    L, N = np.asarray(L, float), np.asarray(N, float)
    one = np.ones_like(L)
    return {"full": [one, L, L * L, N * L], "prefix": [one, L, L * L], "cached": [one, N, N * L]}[kind]


@dataclass
class LatencyModel:
    """Coefficients per cost kind (ms) plus the raw samples they were fitted on."""
    full: list[float]
    prefix: list[float]
    cached: list[float]
    samples: list[dict] = field(default_factory=list)

    def _eval(self, kind, L, N=0) -> float:
        return float(max(0.01, np.dot(getattr(self, kind), [f for f in _feats(kind, L, N)])))

    def full_ms(self, L: int, N: int) -> float:
        """Predicted full ranking time (ms) for L history events and N candidates."""
        return self.prefix_ms(L) + self.cached_ms(L, N)

    def prefix_ms(self, L: int) -> float:
        """Predicted pre-inference time (ms) of an L-event prefix."""
        return self._eval("prefix", L)

    def cached_ms(self, L: int, N: int) -> float:
        """Predicted ranking time (ms) against a cached L-event prefix."""
        return self._eval("cached", L, N)

    @classmethod
    def fit(cls, samples: list[dict]) -> "LatencyModel":
        """samples: [{"L", "N", "full_ms", "prefix_ms", "cached_ms"}] (per-length minima). Relative-error least
        squares so that short and long lengths weigh alike."""
        L = np.array([s["L"] for s in samples], float)
        N = np.array([s["N"] for s in samples], float)
        coefs = {}
        for kind in ("full", "prefix", "cached"):
            y = np.array([s[f"{kind}_ms"] for s in samples])
            X = np.stack(_feats(kind, L, N), 1) / y[:, None]
            coefs[kind] = np.linalg.lstsq(X, np.ones_like(y), rcond=None)[0].tolist()
        return cls(coefs["full"], coefs["prefix"], coefs["cached"], samples)

    def scaled(self, factor: float) -> "LatencyModel":
        """The same curves times `factor` (e.g. the slowdown of a shared machine)."""
        return LatencyModel([c * factor for c in self.full], [c * factor for c in self.prefix],
                            [c * factor for c in self.cached], self.samples)

    def to_json(self, path: Path) -> None:
        """Write the model to `path` (JSON), creating its directory; atomic (a temporary file in
        the same directory, renamed), so a concurrent reader never sees half a file."""
        import os
        import tempfile

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(asdict(self), indent=1))
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def from_json(cls, path: Path) -> "LatencyModel":
        return cls(**json.loads(path.read_text()))


@torch.no_grad()
def measure(model: HSTU, lengths: list[int], n_cands: list[int], repeats: int = 3, seed: int = 0,
            repeats_short: int | None = None) -> list[dict]:
    """Time the three paths on random histories of each length (ms). The minimum of `repeats` runs:
    on a shared machine interference only ever adds time, so the minimum estimates the cost itself
    (the median is kept as `<kind>_ms_median`: what a loaded machine gives). The repeats are taken in
    rounds over all lengths (round r times every length once), so that a burst of load from other
    jobs hits all lengths alike instead of bending the curve at the lengths timed during it.
    repeats_short: repeats for L <= 2048 (cheap lengths), default `repeats`.
    Returns [{"L", "N", "prefix_ms", "full_ms", "cached_ms", "<kind>_ms_median"...}] per (L, N)."""
    g = torch.Generator().manual_seed(seed)
    n = model.cfg.num_items
    model.score(torch.randint(1, n + 1, (1, 32), generator=g), torch.arange(32)[None] * 60, torch.tensor([32]),
                torch.randint(1, n + 1, (1, 8), generator=g))  # warm-up
    inputs = {}
    for L in lengths:
        items = torch.randint(1, n + 1, (1, L), generator=g)
        ts = torch.cumsum(torch.randint(0, 3600, (1, L), generator=g), 1)
        lens = torch.tensor([L])
        inputs[L] = (items, ts, lens, model.prefix_forward(items, ts, lens),
                     {N: torch.randint(1, n + 1, (1, N), generator=g) for N in n_cands})
    reps = {L: repeats_short if repeats_short and L <= 2048 else repeats for L in lengths}
    times: dict[tuple, list[float]] = {}

    def timed(key, f):
        t0 = time.perf_counter()
        f()
        times.setdefault(key, []).append((time.perf_counter() - t0) * 1e3)

    for r in range(max(reps.values())):
        for L in lengths:
            if r >= reps[L]:
                continue
            items, ts, lens, kv, cs = inputs[L]
            timed((L, "prefix"), lambda: model.prefix_forward(items, ts, lens))
            for N, c in cs.items():
                timed((L, N, "full"), lambda: model.score(items, ts, lens, c))
                timed((L, N, "cached"), lambda: model.rank(kv, c))
    out = []
    for L in lengths:
        p = times[(L, "prefix")]
        for N in n_cands:
            f, c = times[(L, N, "full")], times[(L, N, "cached")]
            out.append({"L": L, "N": N, "prefix_ms": float(np.min(p)), "full_ms": float(np.min(f)),
                        "cached_ms": float(np.min(c)), "prefix_ms_median": float(np.median(p)),
                        "full_ms_median": float(np.median(f)), "cached_ms_median": float(np.median(c))})
    return out
