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

The device prefills the kept tokens as a shorter prompt (contiguous positions), like
selective-context compression (Li et al. 2023, "Compressing Context to Enhance Inference Efficiency
of LLMs"). The device asks for refinement only where it paid in `bench refine` (`refine_pays`:
prompts of at least `MIN_REFINE_TOKENS` tokens at keep ratios near 0.5; elsewhere the attention
selection did not beat keeping the newest tokens, so the device prefills the whole prompt, as SnapKV
compresses nothing below its capacity). Table: README "Settings, refinement, profiles",
`bench/results/refine.json`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

WINDOW = 16
# Below this many prompt tokens the whole prompt is kept (bench refine: the attention method does
# not beat the recency baseline beyond its standard error there; see `refine_pays`).
MIN_REFINE_TOKENS = 512
# `relayinfer bench refine --lengths 128,192,256,384,512,640,768,1024 --workers 3`
# (bench/results/refine.json, SmolLM2-135M, 8 chitchat prompts of 118-929 tokens): log-likelihood of
# the full-prompt greedy answer under the attention selection minus under the recency selection,
# nats/token, mean and standard error over the prompts of each bucket (paired per prompt), by
# (prompt-length bucket: 0 = below MIN_REFINE_TOKENS, else MIN_REFINE_TOKENS and longer; keep ratio).
ATTENTION_MINUS_RECENCY = {(0, 0.25): (-0.166, 0.234), (0, 0.5): (-0.101, 0.124), (0, 0.75): (-0.084, 0.038),
                           (1, 0.25): (-0.012, 0.046), (1, 0.5): (0.027, 0.010), (1, 0.75): (-0.012, 0.008)}


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


def refine_pays(n: int, keep_ratio: float | None) -> bool:
    """Whether refining an `n`-token prompt at `keep_ratio` is worth it: only where the attention
    selection beat the recency baseline by more than its standard error in `ATTENTION_MINUS_RECENCY`
    (the nearest measured keep ratio, the prompt's length bucket). Measured: prompts of at least
    `MIN_REFINE_TOKENS` tokens at keep 0.5 (+0.027 ± 0.010 nats/token); everywhere else attention did
    not beat recency, so the device prefills the whole prompt (as SnapKV compresses nothing below its
    capacity, Li et al. 2024, arXiv 2404.14469, sec. 4)."""
    if keep_ratio is None or not 0 < keep_ratio < 1:
        return False
    ratio = min((r for _, r in ATTENTION_MINUS_RECENCY), key=lambda r: abs(r - keep_ratio))
    mean, se = ATTENTION_MINUS_RECENCY[(int(n >= MIN_REFINE_TOKENS), ratio)]
    return mean > se


def refine_indices(scores: np.ndarray, ids: Sequence[int], keep_ratio: float, markers: TemplateMarkers,
                   window: int = WINDOW, pool: int = 7) -> list[int]:
    """Sorted prompt positions to keep.

    Args:
        scores: float32 [n] importance of each prompt position (higher = keep first).
        ids: the n prompt token ids.
        keep_ratio: fraction of the n tokens to keep, in (0, 1]; forced tokens and the scaffold of
            each turn with kept content count towards it (when the forced tokens alone exceed it,
            exactly the forced tokens and their turns' scaffold are kept).
        markers: the chat template's scaffold (`TemplateMarkers.from_tokenizer`).
        window: the last `window` tokens are always kept. pool: max-pool width of the scores.

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
