"""Prompt refinement, the half both ends share (torch-free): the chat template's scaffold as token
ids (`TemplateMarkers`, read from the tokenizer's own template, so any template works), the turn
spans and system prefix of a prompt, and the keep-ratio policy (`choose_refine`). The cloud's half,
which tokens to keep from its attention scores, is `cloud.refine`.

The device prefills the kept tokens as a shorter prompt, like selective-context compression (Li et
al. 2023, "Compressing Context to Enhance Inference Efficiency of LLMs"), at their original RoPE
positions when its engine takes `positions` (`device.split.prefill_at`); it may prefill the system
turn (`system_prefix_len`) before the refined prompt arrives. Prompts below `MIN_REFINE_TOKENS`
tokens are never refined (as SnapKV compresses nothing below its capacity); `refine='auto'` takes
the keep ratio by prompt length from `REFINE_BY_LENGTH` (`choose_refine`). Table:
docs/BENCHMARKS.md "Prompt refinement", `bench/results/refine.md`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

# Below this many prompt tokens the whole prompt is kept (bench refine: short prompts lost most and
# the attention selection did not beat recency there; see `choose_refine`).
MIN_REFINE_TOKENS = 512
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
        role name. Cached on the tokenizer object. A model file without a chat template (its prompts
        are `PLAIN_CHAT_TEMPLATE` text) has no scaffold: no headers, so a refinement selects its
        tokens by score alone (control tokens and the last window still kept).

        Raises:
            ValueError: the template does not write the role names (the scaffold cannot be found).
        """
        cached = getattr(tok, "_template_markers", None)
        if cached is not None:
            return cached
        special = frozenset(tok.special_ids)
        if getattr(tok, "chat_template", "") is None:  # the plain-text default: no control token opens a turn
            return cls((), (), (), special)
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
