"""Prompt refinement: which prompt tokens the device prefills (torch-free; shared by both sides).

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

The device prefills the kept tokens as a shorter prompt, like selective-context compression (Li et
al. 2023, "Compressing Context to Enhance Inference Efficiency of LLMs"), at their original RoPE
positions when its engine takes `positions` (`device.split.prefill_at`). Prompts below
`MIN_REFINE_TOKENS` tokens are never refined (as SnapKV compresses nothing below its capacity);
`refine='auto'` takes the keep ratio by prompt length from
`REFINE_BY_LENGTH` (`choose_refine`). Table: docs/BENCHMARKS.md "Prompt refinement",
`bench/results/refine.md`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

WINDOW = 16
# Below this many prompt tokens the whole prompt is kept (bench refine: short prompts lost most and
# the attention selection did not beat recency there; see `choose_refine`).
MIN_REFINE_TOKENS = 512
# The selection the cloud uses (`bench refine` method name): SnapKV observation-window attention.
SELECTION = "attention"
# The keep ratio `refine='auto'` asks for, by prompt length: (lower bound in tokens, keep ratio or
# None = off), ascending; derived by `bench/refine.py` `refine_table` from bench/results/refine*.json
# (`python bench/refine.py --merge`, table in bench/results/refine.md): a bucket gets the smallest
# keep ratio at which SELECTION beat the recency baseline by more than its standard error (paired per
# prompt) with a loss <= 0.05 nats/token. Measured (SmolLM2-135M, original positions): 512-1199
# tokens at keep 0.25, attention -0.017 +- 0.011 vs recency -0.039 +- 0.019 nats/token (3 prompts);
# at keep 0.5 and 0.75 and on the 2,018-token multi-conversation context (keep 0.5 only) attention did
# not beat recency; below 512 tokens one prompt (265 tokens) was measured, so short prompts stay off.
REFINE_BY_LENGTH: tuple[tuple[int, float | None], ...] = ((0, None), (MIN_REFINE_TOKENS, 0.25), (1200, None))


@dataclass(frozen=True)
class TemplateMarkers:
    """Token ids of a chat template's scaffold, read from the template itself.

    Attributes:
        headers: each role's whole turn header as token ids (ChatML: `<|im_start|>`, `user`, `\\n`;
            Llama 3: `<|start_header_id|>`, `user`, `<|end_header_id|>`, `\\n\\n`), the generation
            prompt's header included.
        system_header: the system role's header (empty when the template has no system role).
        turn_end: ids that close a turn (`<|im_end|>`, `\\n`; `<|eot_id|>`).
        special_ids: control-token ids; those outside a turn's scaffold (BOS) are always kept.
    """
    headers: tuple[tuple[int, ...], ...]
    system_header: tuple[int, ...]
    turn_end: tuple[int, ...]
    special_ids: frozenset[int]

    @classmethod
    def from_tokenizer(cls, tok) -> "TemplateMarkers":
        """Render a probe conversation (system, user, assistant, user + generation prompt) with the
        tokenizer's chat template (`Tokenizer.render_chat`) and cut the template text between the
        contents into turn end and header: a header starts at the last control token before its
        role name. Cached on the tokenizer object.

        Raises:
            ValueError: the tokenizer has no chat template, or its template does not write the
                role names (the scaffold cannot be found).
        """
        cached = getattr(tok, "_template_markers", None)
        if cached is not None:
            return cached
        special = frozenset(tok.special_ids)
        roles = ["system", "user", "assistant", "user"]
        sent = [f"\ue000{i}\ue001" for i in range(len(roles))]
        msgs = [{"role": r, "content": s} for r, s in zip(roles, sent)]
        try:
            text = tok.render_chat(msgs, add_generation_prompt=True)
            bare = tok.render_chat(msgs, add_generation_prompt=False)
        except Exception as e:  # noqa: BLE001 - a template may refuse a system turn
            raise ValueError(f"cannot render the chat template: {e}") from e
        pieces, rest = [], text
        for s in sent:
            a, rest = rest.split(s, 1)
            pieces.append(a)
        gen = text[len(bare):] if text.startswith(bare) else ""
        headers, turn_end, system_header = [], (), ()
        for k, (role, piece) in enumerate(zip(roles, pieces)):
            ids = _in_context(tok, piece)
            start = _header_start(ids, tok.encode(role), special)
            if start is None:
                raise ValueError(f"the chat template does not write the role name {role!r}")
            headers.append(tuple(ids[start:]))
            if k == 0:
                system_header = tuple(ids[start:]) if role in tok.decode(ids[start:]) else ()
            elif k == 1:
                turn_end = tuple(ids[:start])
        if gen:
            headers.append(tuple(tok.encode(gen)))
        out = cls(tuple(dict.fromkeys(h for h in headers if h)), system_header, turn_end, special)
        try:
            tok._template_markers = out
        except AttributeError:
            pass
        return out


def _in_context(tok, text: str, word: str = "Hello") -> list[int]:
    """Ids of template text as it tokenizes between two message contents (BPE may merge a header's
    trailing newlines differently when content follows): `word` + text + `word`, the words cut off."""
    w = tok.encode(word)
    ids = tok.encode(word + text + word)
    if ids[:len(w)] == w and ids[-len(w):] == w:
        return ids[len(w):len(ids) - len(w)]
    return tok.encode(text)


def _header_start(ids: list[int], role: list[int], special: frozenset[int]) -> int | None:
    """Index of the control token that opens the header holding `role` (last occurrence) in `ids`."""
    for at in range(len(ids) - len(role), -1, -1):
        if ids[at:at + len(role)] == role:
            for j in range(at - 1, -1, -1):
                if ids[j] in special:
                    return j
            return 0
    return None


def _match(ids: Sequence[int], i: int, seq: tuple[int, ...], special: frozenset[int]) -> int:
    """Length of `seq` matched at ids[i]: all of it, else its prefix up to its last control token
    (a trailing newline that BPE merged into the content), else 0."""
    if not seq:
        return 0
    if tuple(ids[i:i + len(seq)]) == seq:
        return len(seq)
    cut = max((j + 1 for j, t in enumerate(seq) if t in special), default=0)
    if 0 < cut < len(seq) and tuple(ids[i:i + cut]) == seq[:cut]:
        return cut
    return 0


def turn_spans(ids: Sequence[int], markers: TemplateMarkers) -> list[tuple[int, int, int, int]]:
    """The prompt's turns as (header start, content start, content end, turn end) positions; the
    scaffold of a turn is [header start, content start) + [content end, turn end). The generation
    prompt is a turn with empty content."""
    n, sp, out = len(ids), markers.special_ids, []
    i, cur = 0, None
    while i < n:
        h = 0
        if ids[i] in sp:  # every header starts with a control token
            h = max((_match(ids, i, hd, sp) for hd in markers.headers), default=0)
        if h:
            if cur is not None:
                out.append((cur[0], cur[1], i, i))
            cur = (i, i + h)
            i += h
            continue
        e = _match(ids, i, markers.turn_end, sp) if cur is not None and ids[i] in sp else 0
        if e:
            out.append((cur[0], cur[1], i, i + e))
            cur = None
            i += e
            continue
        i += 1
    if cur is not None:
        out.append((cur[0], cur[1], n, n))
    return out


def system_prefix_len(ids: Sequence[int], markers: TemplateMarkers) -> int:
    """Length of the prompt's leading system turn (BOS or other control tokens before it included,
    its turn end included); 0 when the first turn is not the system role's. Both sides compute it,
    and the cloud always keeps it."""
    if not markers.system_header:
        return 0
    lead = 0
    while lead < len(ids) and ids[lead] in markers.special_ids and \
            not _match(ids, lead, markers.system_header, markers.special_ids):
        lead += 1
    if not _match(ids, lead, markers.system_header, markers.special_ids):
        return 0
    for h0, _, _, end in turn_spans(ids, markers):
        if h0 == lead:
            return end
    return 0


def check_refine(refine) -> None:
    """Check a `refine` setting: None (off), 'auto' (`choose_refine` picks from `REFINE_BY_LENGTH`) or
    a keep ratio in (0, 1].

    Raises:
        ValueError: anything else, naming the value and what is allowed.
    """
    if refine is None or refine == "auto":
        return
    if isinstance(refine, bool) or not isinstance(refine, (int, float)) or not 0 < refine <= 1:
        raise ValueError(f"refine must be None, 'auto' or a keep ratio in (0, 1], got {refine!r}")


def choose_refine(n: int, refine) -> float | None:
    """The keep ratio to ask the cloud for on an `n`-token prompt, or None (the device prefills the
    whole prompt).

    `refine`: None -> None; 'auto' -> the measured table `REFINE_BY_LENGTH` (the ratio of the longest
    bucket whose lower bound is <= n; None where no selection method beat recency beyond its
    standard error, see `bench/results/refine.json`); a float keep ratio -> that ratio on prompts of
    at least `MIN_REFINE_TOKENS` tokens (1.0 and shorter prompts -> None: short prompts lost most and
    are never refined, as SnapKV compresses nothing below its capacity, Li et al. 2024, arXiv
    2404.14469, sec. 4).

    Raises:
        ValueError: `refine` is not None, 'auto' or a ratio in (0, 1] (`check_refine`).
    """
    check_refine(refine)
    if refine is None:
        return None
    if refine == "auto":
        keep = None
        for lo, k in REFINE_BY_LENGTH:
            if n >= lo:
                keep = k
        return keep
    return float(refine) if refine < 1 and n >= MIN_REFINE_TOKENS else None


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
