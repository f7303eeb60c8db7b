"""Prompt refinement: which prompt tokens the device prefills (torch-free; shared by both sides).

The cloud scores every prompt token while it prefills (`ObservationScores`, SnapKV-style: attention
from the last `window` prompt positions, summed over heads and layers, smoothed by a max-pool of
width `pool` so that neighbours of an important token survive with it, SnapKV sec. 4.2). It keeps
the top `keep_ratio` of the prompt, always including the forced tokens: the chat template's special
tokens, the whole system turn (a prefix the device may prefill before the refined prompt arrives),
and the last `window` tokens (the latest user text and the generation prompt). The device prefills
the kept tokens as a shorter prompt (contiguous positions), like selective-context compression
(Li et al. 2023, "Compressing Context to Enhance Inference Efficiency of LLMs").
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

WINDOW = 16


def system_prefix_len(ids: Sequence[int], im_start: int = 1, im_end: int = 2) -> int:
    """Length of the leading system turn (`<|im_start|>system ... <|im_end|>` plus its newline), 0 if
    the prompt does not start with a turn. Both sides compute it, and the cloud always keeps it."""
    if not ids or ids[0] != im_start:
        return 0
    try:
        end = list(ids).index(im_end)
    except ValueError:
        return 0
    return min(end + 2, len(ids))  # include the newline after <|im_end|>


def refine_indices(scores: np.ndarray, ids: Sequence[int], keep_ratio: float, special_ids: frozenset[int] | set[int],
                   window: int = WINDOW, pool: int = 7, im_start: int = 1, im_end: int = 2) -> list[int]:
    """Sorted prompt positions to keep.

    Args:
        scores: float32 [n] importance of each prompt position.
        ids: the n prompt token ids.
        keep_ratio: fraction of the n tokens to keep, in (0, 1]; forced tokens count towards it
            (when they alone exceed it, exactly the forced tokens are kept).
        special_ids: ids always kept (chat-template markers); the role and newline tokens after
            `im_start` and the newline after `im_end` are kept with them.

    Raises:
        ValueError: keep_ratio outside (0, 1] or scores/ids lengths differ.
    """
    n = len(ids)
    if not 0 < keep_ratio <= 1:
        raise ValueError(f"keep ratio must be in (0, 1], got {keep_ratio}")
    if len(scores) != n:
        raise ValueError(f"{len(scores)} scores for {n} prompt tokens")
    forced = np.zeros(n, dtype=bool)
    forced[: system_prefix_len(ids, im_start, im_end)] = True
    forced[max(0, n - window):] = True
    arr = np.asarray(ids)
    forced |= np.isin(arr, list(special_ids))
    # the template scaffold: role name + newline after <|im_start|>, the newline after <|im_end|>
    for marker, follow in ((im_start, 2), (im_end, 1)):
        for j in range(1, follow + 1):
            at = np.flatnonzero(arr[:-j] == marker) + j if n > j else np.array([], dtype=int)
            forced[at] = True
    s = np.asarray(scores, dtype=np.float64)
    if pool > 1:  # max-pool smoothing, same length
        pad = np.pad(s, pool // 2, mode="edge")
        s = np.lib.stride_tricks.sliding_window_view(pad, pool).max(axis=1)[:n]
    budget = int(np.ceil(keep_ratio * n)) - int(forced.sum())
    keep = forced.copy()
    if budget > 0:
        free = np.flatnonzero(~forced)
        keep[free[np.argsort(-s[free], kind="stable")[:budget]]] = True
    return np.flatnonzero(keep).tolist()
