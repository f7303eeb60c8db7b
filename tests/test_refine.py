"""Prompt refinement's scaffold (`protocol.model.refine`): markers read from the chat template, whole
headers, the system role checked, scaffold charged only for turns with kept content; ChatML (the
shipped SmolLM2 template) and a Llama-3-style template on the same vocabulary."""
from __future__ import annotations

import math

import numpy as np
import pytest

from relayinfer.protocol.model.refine import TemplateMarkers, system_prefix_len, turn_spans
from relayinfer.cloud.refine import chunk_mean_scores, last_user_turn, mix_recency, refine_indices
from relayinfer.protocol.model.tokenizer import Tokenizer

# Meta-Llama-3-8B-Instruct's tokenizer_config.json chat_template
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

CONV = [{"role": "user", "content": "What is the tallest mountain in Europe, and is it hard to climb in summer?"},
        {"role": "assistant", "content": "Mont Elbrus in Russia is the tallest; in summer it is a long but "
                                         "non-technical climb if you are fit and acclimatised."},
        {"role": "user", "content": "Okay. And which one would you pick for a first alpine trip?"},
        {"role": "assistant", "content": "Gran Paradiso: glaciated yet gentle, with good huts."},
        {"role": "user", "content": "Thanks! Give me a packing list for it, please."}]


@pytest.fixture(scope="module")
def llama3(tokenizer):
    """Our vocabulary plus Llama 3's control tokens and its chat template (ids 1/2 are not its markers)."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    backend = HFTokenizer.from_str(tokenizer._tok.to_str())
    names = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in names])
    return Tokenizer(backend, LLAMA3_TEMPLATE, backend.token_to_id(names[0]), backend.token_to_id(names[3]))


def _check_scaffold(ids, kept, markers):
    """Every turn is kept whole-scaffolded (header and end) iff some of its content is kept."""
    k = set(kept)
    for h0, c0, c1, e in turn_spans(ids, markers):
        scaffold = set(range(h0, c0)) | set(range(c1, e))
        content = set(range(c0, c1))
        if c0 == c1 or content & k:
            assert scaffold <= k, (h0, c0, c1, e)
        else:
            assert not scaffold & k, (h0, c0, c1, e)  # no empty turns left


def test_chatml_markers_and_whole_headers(tokenizer):
    m = TemplateMarkers.from_tokenizer(tokenizer)
    im_start, im_end, nl = 1, 2, tokenizer.encode("\n")[0]
    assistant = tokenizer.encode("assistant")
    assert len(assistant) == 2  # 'ass' 'istant': the old 2-token rule dropped the newline
    assert (im_start, *assistant, nl) in m.headers and m.system_header == (im_start, *tokenizer.encode("system"), nl)
    assert m.turn_end == (im_end, nl)
    ids = tokenizer.encode_chat(CONV)
    spans = turn_spans(ids, m)
    assert len(spans) == 7  # SmolLM2's default system turn, 5 messages, the generation prompt
    assert system_prefix_len(ids, m) == spans[0][3] == ids.index(im_end) + 2
    for keep in (0.25, 0.5, 0.75):
        for scores in (np.arange(len(ids), dtype=float), np.random.default_rng(0).random(len(ids))):
            kept = refine_indices(scores, ids, keep, m, pool=1)
            _check_scaffold(ids, kept, m)
            least = refine_indices(scores, ids, 1e-9, m, pool=1)  # the forced tokens and their scaffold
            assert len(kept) <= max(math.ceil(keep * len(ids)), len(least)) and set(least) <= set(kept)
            assert kept[-4:] == list(range(len(ids) - 4, len(ids)))  # '<|im_start|>' 'ass' 'istant' '\n'
    # recency at 0.25 keeps the system turn, the last user turn and the generation prompt only
    kept = refine_indices(np.arange(len(ids), dtype=float), ids, 0.25, m, pool=1)
    opened = [s for s in spans if s[1] < s[2] and set(range(s[1], s[2])) & set(kept)]
    assert [s[0] for s in opened] == [spans[0][0], spans[5][0]]


def test_llama3_template_markers_system_role_and_scaffold(tokenizer, llama3):
    m = TemplateMarkers.from_tokenizer(llama3)
    bos, sh, eh, eot = (llama3.encode(t)[0] for t in
                        ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"))
    nl = tokenizer.encode("\n")[0]
    assert m.turn_end == (eot,) and m.system_header == (sh, *tokenizer.encode("system"), eh, nl, nl)
    assert all(h[0] == sh for h in m.headers) and not {1, 2} & {t for h in m.headers for t in h}
    ids = llama3.encode_chat(CONV)  # no system turn: the first user turn must not be forced
    assert ids[0] == bos and 1 not in ids and 2 not in ids
    assert system_prefix_len(ids, m) == 0
    assert system_prefix_len([1, 5, 6, 2, 7], m) == 0  # ChatML's ids mean nothing here
    with_sys = llama3.encode_chat([{"role": "system", "content": "Be brief."}, *CONV])
    first_end = with_sys.index(eot) + 1
    assert system_prefix_len(with_sys, m) == first_end
    spans = turn_spans(ids, m)
    assert len(spans) == 6 and spans[0][0] == 1  # after BOS
    assert all(ids[h0] == sh and eh in ids[h0:c0] and ids[c0 - 1] != eh for h0, c0, _, _ in spans)  # whole headers
    for keep in (0.25, 0.5):
        kept = refine_indices(np.arange(len(ids), dtype=float), ids, keep, m, pool=1)
        _check_scaffold(ids, kept, m)
        least = refine_indices(np.arange(len(ids), dtype=float), ids, 1e-9, m, pool=1)
        assert kept[0] == 0 and len(kept) <= max(math.ceil(keep * len(ids)), len(least))  # BOS always kept
    kept = refine_indices(np.arange(len(ids), dtype=float), ids, 0.25, m, pool=1)
    heads = [i for i in kept if ids[i] == sh]  # recency: the newest turns, the first user turn dropped whole
    assert len(heads) >= 2 and heads == [s[0] for s in spans][-len(heads):] and not set(range(*spans[0][:2])) & set(kept)


def test_selection_variants(tokenizer):
    """Chunk-level scores keep whole turns, the recency mix is a rank blend, the last user turn
    can be forced whole."""
    m = TemplateMarkers.from_tokenizer(tokenizer)
    ids = tokenizer.encode_chat(CONV)
    rng = np.random.default_rng(1)
    s = rng.random(len(ids))
    spans = turn_spans(ids, m)
    c = chunk_mean_scores(s, ids, m)
    for _, c0, c1, _ in spans:
        if c1 > c0:
            assert np.allclose(c[c0:c1], s[c0:c1].mean())
    kept = set(refine_indices(c, ids, 0.5, m, pool=1))
    partial = [(c0, c1) for _, c0, c1, _ in spans if c1 > c0 and 0 < len(kept & set(range(c0, c1))) < c1 - c0]
    assert len(partial) <= 2  # whole turns, but for the last one taken (and the forced last window)
    mix = mix_recency(s, 1.0)
    assert np.allclose(mix, np.arange(len(ids)) / len(ids))  # all recency
    assert np.argsort(mix_recency(s, 0.0)).tolist() == np.argsort(s).tolist()  # all attention
    c0, c1 = last_user_turn(ids, m)
    assert tokenizer.decode(ids[c0:c1]).strip() == CONV[-1]["content"]
    old = -np.arange(len(ids), dtype=float)  # scores that prefer the oldest tokens
    assert not set(range(c0, c1)) <= set(refine_indices(old, ids, 0.3, m, window=4, pool=1))
    assert set(range(c0, c1)) <= set(refine_indices(old, ids, 0.3, m, window=4, pool=1, keep_last_turn=True))
