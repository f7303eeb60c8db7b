"""Prompt refinement, the cloud's half: which prompt tokens the device prefills, chosen from the
attention scores the cloud computes while it prefills. The shared half (the chat-template markers,
the turn spans and the keep-ratio policy) is `protocol.model.refine`.

The cloud scores every prompt token while it prefills (`ObservationScores`, SnapKV-style: attention
from the last `window` prompt positions, summed over heads and layers, smoothed by a max-pool of
width `pool` so that neighbours of an important token survive with it, SnapKV sec. 4.2). It keeps
the top `keep_ratio` of the prompt, always including the forced tokens: the whole system turn (a
prefix the device may prefill before the refined prompt arrives), tokens before the first turn
(BOS), and the last `window` tokens (the latest user text and the generation prompt). The chat
template's scaffold (a turn's whole header, e.g. `<|im_start|>assistant\\n` or
`<|start_header_id|>user<|end_header_id|>\\n\\n`, and its end, `<|im_end|>\\n` / `<|eot_id|>`) is
kept only for turns whose content keeps at least one token, and its tokens are charged to the budget
when that turn is opened, so no empty turns remain. The markers are read from the tokenizer's chat
template (`TemplateMarkers.from_tokenizer`), so any template works, not only ChatML.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from relayinfer.protocol.model.refine import TemplateMarkers, system_prefix_len, turn_spans

WINDOW = 16
# The selection the cloud uses (`bench refine` method name): SnapKV observation-window attention.
SELECTION = "attention"


def chunk_mean_scores(scores: np.ndarray, ids: Sequence[int], markers: TemplateMarkers) -> np.ndarray:
    """Chunk-level scores: every token of a turn's content gets the mean score of that content, so
    the selection keeps whole turns (most important first) and cuts only the last one it takes
    (chunk-based selection as in ChunkKV, Liu et al. 2025, arXiv 2502.00299, with a turn as the
    chunk). Tokens outside turns keep their own score. float64 [n] -> float64 [n]."""
    s = np.asarray(scores, dtype=np.float64).copy()
    for _, c0, c1, _ in turn_spans(ids, markers):
        if c1 > c0:
            s[c0:c1] = s[c0:c1].mean()
    return s


def mix_recency(scores: np.ndarray, weight: float = 0.5) -> np.ndarray:
    """Attention ranks mixed with recency: (1 - weight) x rank(score) / n + weight x position / n,
    float64 [n] in [0, 1) (the recency prior that StreamingLLM's window and H2O's recent budget
    keep next to the heavy hitters, Zhang et al. 2023, arXiv 2306.14048, sec. 3)."""
    s = np.asarray(scores, dtype=np.float64)
    n = len(s)
    rank = np.empty(n)
    rank[np.argsort(s, kind="stable")] = np.arange(n)
    return ((1 - weight) * rank + weight * np.arange(n)) / max(n, 1)


def last_user_turn(ids: Sequence[int], markers: TemplateMarkers) -> tuple[int, int] | None:
    """(content start, content end) of the prompt's last turn with content (the latest user
    message before the generation prompt), or None."""
    spans = [(c0, c1) for _, c0, c1, _ in turn_spans(ids, markers) if c1 > c0]
    return spans[-1] if spans else None


def refine_indices(scores: np.ndarray, ids: Sequence[int], keep_ratio: float, markers: TemplateMarkers,
                   window: int = WINDOW, pool: int = 7, keep_last_turn: bool = False) -> list[int]:
    """Sorted prompt positions to keep.

    Args:
        scores: float32 [n] importance of each prompt position (higher = keep first).
        ids: the n prompt token ids.
        keep_ratio: fraction of the n tokens to keep, in (0, 1]; forced tokens and the scaffold of
            each turn with kept content count towards it (when the forced tokens alone exceed it,
            exactly the forced tokens and their turns' scaffold are kept).
        markers: the chat template's scaffold (`TemplateMarkers.from_tokenizer`).
        window: the last `window` tokens are always kept. pool: max-pool width of the scores.
        keep_last_turn: also force the whole last turn with content (the latest user message).

    Raises:
        ValueError: keep_ratio outside (0, 1] or scores/ids lengths differ.
    """
    n = len(ids)
    if not 0 < keep_ratio <= 1:
        raise ValueError(f"keep ratio must be in (0, 1], got {keep_ratio}")
    if len(scores) != n:
        raise ValueError(f"{len(scores)} scores for {n} prompt tokens")
    turn = np.full(n, -1)  # which turn's content a position is (-1: none)
    scaffold = np.zeros(n, dtype=bool)
    spans = turn_spans(ids, markers)
    for t, (h0, c0, c1, e) in enumerate(spans):
        scaffold[h0:c0] = scaffold[c1:e] = True
        turn[c0:c1] = t
    forced = np.zeros(n, dtype=bool)
    forced[: system_prefix_len(ids, markers)] = True
    forced[max(0, n - window):] = True
    last = last_user_turn(ids, markers) if keep_last_turn else None
    if last is not None:
        forced[last[0]:last[1]] = True
    forced |= np.isin(np.asarray(ids), list(markers.special_ids)) & ~scaffold  # BOS and the like
    keep = forced.copy()
    opened = np.zeros(len(spans), dtype=bool)

    def open_turn(t: int) -> int:
        if t < 0 or opened[t]:
            return 0
        opened[t] = True
        h0, c0, c1, e = spans[t]
        new = int((~keep[h0:c0]).sum() + (~keep[c1:e]).sum())
        keep[h0:c0] = keep[c1:e] = True
        return new

    for t in set(turn[forced & ~scaffold].tolist()):
        open_turn(t)
    for t, (h0, c0, c1, _) in enumerate(spans):  # the forced generation prompt (empty content)
        if c0 == c1 and forced[h0:c0].any():
            open_turn(t)
    s = np.asarray(scores, dtype=np.float64)
    if pool > 1:  # max-pool smoothing, same length
        pad = np.pad(s, pool // 2, mode="edge")
        s = np.lib.stride_tricks.sliding_window_view(pad, pool).max(axis=1)[:n]
    budget = int(np.ceil(keep_ratio * n)) - int(keep.sum())
    free = np.flatnonzero(~keep & ~scaffold)
    for i in free[np.argsort(-s[free], kind="stable")]:
        if budget <= 0:
            break
        t = turn[i]
        cost = 1
        if t >= 0 and not opened[t]:
            h0, c0, c1, e = spans[t]
            cost += (c0 - h0) + (e - c1)
        if cost > budget:
            continue
        budget -= 1 + open_turn(t)
        keep[i] = True
    return np.flatnonzero(keep).tolist()


def select(scores: np.ndarray, ids: Sequence[int], keep_ratio: float, markers: TemplateMarkers,
           method: str | None = None, window: int = WINDOW, seed: int = 0) -> list[int]:
    """Sorted prompt positions to keep with a named selection method (`bench refine`'s names):

    * ``attention``: `scores` max-pooled (width 7) (SnapKV, Li et al. 2024, arXiv 2404.14469, sec. 4);
    * ``last``: the same with the last user turn always kept whole;
    * ``turns``: whole turns by their mean score (`chunk_mean_scores`, ChunkKV);
    * ``mix``: score rank mixed with recency (`mix_recency`, H2O's recent budget);
    * ``recency``: the newest tokens; ``random``: uniform random (seeded by `seed`).

    `scores`: float [n] (ignored by recency/random); `method` None = `SELECTION` (the cloud's).

    Raises:
        ValueError: an unknown method, or what `refine_indices` raises.
    """
    method = method or SELECTION
    n = len(ids)
    if method in ("attention", "last"):
        return refine_indices(scores, ids, keep_ratio, markers, window, 7, keep_last_turn=method == "last")
    if method == "turns":
        s = chunk_mean_scores(scores, ids, markers)
    elif method == "mix":
        s = mix_recency(scores)
    elif method == "recency":
        s = np.arange(n, dtype=np.float64)
    elif method == "random":
        s = np.random.default_rng(seed).random(n)
    else:
        raise ValueError(f"unknown selection method {method!r}; choose attention, last, turns, mix, recency or random")
    return refine_indices(s, ids, keep_ratio, markers, window, 1)
