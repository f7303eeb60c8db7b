"""Structured output: a grammar that every sampled token stays inside, on the cloud and the device.

A request's constraint is a `Grammar` (protocol.messages; kind + text, so it travels in `Generate`
and in `SamplingParams` unchanged): a JSON Schema (`json_schema`, what OpenAI's
`response_format` json_object / json_schema and vLLM's `guided_json` ask for), a regular
expression (`regex`, vLLM's `guided_regex`; `guided_choice` is an alternation of literals) or a
Lark grammar (`lark`, vLLM's `guided_grammar`, llguidance's dialect of Lark).

The grammar engine is llguidance (Microsoft; the one vLLM, SGLang and llama.cpp can use): torch-free
Rust with numpy bindings, so the device enforces the same grammar with the same token masks. A
`Guide` holds one request's matcher state. It is synced to the answer so far before each mask
(`Guide.mask(logits, answer_ids)` consumes the ids it has not seen), so tokens produced elsewhere
(the cloud's tokens on the device after the hand-off, the P/D prefill instance's first token on the
decode instance) are consumed exactly once wherever the guide is built. Masking happens before any
other logit adjustment, so with greedy decoding a constrained answer is the same token for token
whichever side decodes each position.

JSON is generated without free whitespace (llguidance's `whitespace_flexible` off): small models
under a flexible-whitespace grammar can loop on newlines until max_tokens; the compact form is
still valid JSON for any parser.
"""
from __future__ import annotations

import asyncio
import functools
import json
import threading
import weakref
from typing import Sequence

import numpy as np

from relayinfer.protocol.messages import Grammar
from relayinfer.protocol.validate import FieldError

GRAMMAR_KINDS = ("json_schema", "regex", "lark")
MAX_GRAMMAR_CHARS = 256 << 10
"""Longest grammar text (chars) a request may carry: a schema of thousands of fields fits."""

JSON_DEFAULTS = {"whitespace_flexible": False}


class GrammarError(FieldError):
    """A grammar that cannot be compiled, or a token sequence it does not accept (a ValueError
    naming the request field and llguidance's message, kept whole up to 500 characters)."""

    def __init__(self, field: str, allowed: str, value):
        super().__init__(field, allowed, value)
        if isinstance(value, str):
            ValueError.__init__(self, f"{field} must be {allowed}, got {value[:500]}")


def grammar_text(grammar: Grammar, field: str = "grammar") -> str:
    """llguidance's grammar text (a JSON document) for `grammar`, compiled once per distinct
    grammar (the last 128 are kept) and checked on a byte-level probe vocabulary: a grammar that
    llguidance refuses, or that leaves its matcher in an error state before the first token (a
    schema whose `$ref`s only refer to each other), fails here, at every entry point alike.

    Raises:
        GrammarError: unknown kind, text over MAX_GRAMMAR_CHARS, a JSON schema that is not JSON
            (or not an object; `true` means any JSON value, `false` nothing), or any grammar
            llguidance refuses (its message kept).
    """
    if not isinstance(grammar.kind, str) or not isinstance(grammar.spec, str):
        raise GrammarError(field, "a kind and a spec, both strings", grammar)
    try:
        return _compiled(grammar.kind, grammar.spec)
    except GrammarError as e:
        raise GrammarError(field, e.allowed, e.value) from None


@functools.lru_cache(maxsize=128)
def _compiled(kind: str, spec: str) -> str:
    """`grammar_text` of (kind, spec), str both; raises GrammarError naming 'grammar'."""
    import llguidance as llg

    field = "grammar"
    if kind not in GRAMMAR_KINDS:
        raise GrammarError(field, f"a kind among {', '.join(GRAMMAR_KINDS)}", kind)
    if not spec or len(spec) > MAX_GRAMMAR_CHARS:
        raise GrammarError(field, f"a non-empty grammar of at most {MAX_GRAMMAR_CHARS} characters",
                           f"{len(spec)} characters")
    if kind == "json_schema":
        try:
            schema = json.loads(spec)
        except ValueError as e:
            raise GrammarError(field, "a JSON schema (JSON text)", f"{spec[:80]!r}: {e}") from None
        if schema is False:
            raise GrammarError(field, "a JSON schema some value satisfies", "false")
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(field, "a JSON schema (an object or a boolean)", spec[:80])
    try:
        if kind == "json_schema":
            text = llg.LLMatcher.grammar_from_json_schema({} if schema is True else schema, defaults=JSON_DEFAULTS)
        elif kind == "regex":
            text = llg.LLMatcher.grammar_from_regex(spec)
        else:
            text = llg.LLMatcher.grammar_from_lark(spec)
        bad, messages = llg.LLMatcher.validate_grammar_with_warnings(text)
    except Exception as e:  # llguidance's own refusal (a value it cannot serialize, an option it cannot apply)
        raise GrammarError(field, f"a valid {kind} grammar", f"{type(e).__name__}: {e}") from None
    if bad:
        raise GrammarError(field, f"a valid {kind} grammar", "; ".join(m.strip() for m in messages)[:500])
    probe = llg.LLMatcher(_probe_tokenizer(), text)
    probe.compute_bitmask()
    if probe.is_error():
        raise GrammarError(field, f"a {kind} grammar some answer satisfies (a schema of $refs to each other "
                           "has none)", f"llguidance: {probe.get_error().splitlines()[0][:300]}")
    return text


@functools.lru_cache(maxsize=1)
def _probe_tokenizer():
    """A 256-byte vocabulary (byte-level BPE, no merges) plus EOS: enough for llguidance to run a
    grammar's first step without the model's tokenizer (`grammar_text`'s check)."""
    import llguidance as llg
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    eos = vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<eos>", special=True)])
    return llg.LLTokenizer(tok.to_str(), eos_token=eos)


def json_schema_grammar(schema: dict | bool) -> Grammar:
    """The Grammar of a JSON schema (a dict, or True for any JSON value; False, which nothing
    satisfies, is refused when compiled)."""
    return Grammar("json_schema", json.dumps(schema, separators=(",", ":")))


def choice_grammar(choices: Sequence[str], field: str = "guided_choice") -> Grammar:
    """The Grammar that accepts exactly one of `choices` (vLLM's `guided_choice`): a Lark
    alternation of string literals. Raises GrammarError for an empty list or a non-string."""
    if isinstance(choices, (str, bytes)) or not isinstance(choices, Sequence) or not choices \
            or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError(field, "a non-empty list of non-empty strings", choices)
    return Grammar("lark", "start: " + " | ".join(json.dumps(c) for c in choices))


PROTOTYPES_KEPT = 32
"""Compiled matchers kept per tokenizer (the most recently used grammars)."""
_VOCABS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Tokenizer -> (LLTokenizer, {(kind, spec): matcher})
_LOCK = threading.RLock()  # guides are built on worker threads (`new_guide_async`): the caches and copies


def _vocab(tokenizer) -> tuple:
    """(the llguidance `LLTokenizer`, its compiled matchers by grammar) of a `Tokenizer`, built
    once per Tokenizer object (~0.5 s for a 49k vocabulary) and dropped with it."""
    import llguidance as llg

    with _LOCK:
        hit = _VOCABS.get(tokenizer)
        if hit is None:
            hit = _VOCABS[tokenizer] = (llg.LLTokenizer(tokenizer._tok.to_str(), n_vocab=tokenizer.vocab_size,
                                                        eos_token=tokenizer.eos_id), {})
        return hit


def warm(tokenizer) -> None:
    """Build `tokenizer`'s llguidance vocabulary now (~0.5 s for 49k tokens, holding the GIL, so
    no worker thread keeps it off an event loop): a server calls this before it listens, so that
    its first constrained request does not stall the streams of the others. No-op without
    llguidance."""
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return
    _vocab(tokenizer)


def _prototype(grammar: Grammar, tokenizer):
    """A fresh compiled matcher of `grammar` on `tokenizer`'s vocabulary, to copy (the last
    `PROTOTYPES_KEPT` used are kept)."""
    import llguidance as llg

    lltok, matchers = _vocab(tokenizer)
    key = (grammar.kind, grammar.spec)
    with _LOCK:
        m = matchers.pop(key, None)
    if m is None:  # compiled outside the lock (it releases the GIL): other guides are built meanwhile
        m = llg.LLMatcher(lltok, grammar_text(grammar))
    with _LOCK:
        matchers[key] = m  # most recent last
        while len(matchers) > PROTOTYPES_KEPT:
            matchers.pop(next(iter(matchers)))
    return m


class Guide:
    """One request's grammar state.

    Args:
        grammar: the request's `Grammar`.
        tokenizer: the model's `Tokenizer` (vocabulary size V).
        vocab_size: the logits' length when it differs from the tokenizer's (padded heads); ids
            past the tokenizer's vocabulary are never allowed.

    Raises:
        GrammarError: the grammar does not compile (see `grammar_text`).
    """

    def __init__(self, grammar: Grammar, tokenizer, vocab_size: int | None = None):
        self.grammar = grammar
        with _LOCK:
            self._m = _prototype(grammar, tokenizer).deep_copy()  # one compile per grammar and vocabulary
        if self._m.is_error():
            raise GrammarError("grammar", f"a valid {grammar.kind} grammar", self._m.get_error()[:500])
        self.vocab_size = vocab_size or tokenizer.vocab_size
        self.eos_id = tokenizer.eos_id
        self.consumed = 0  # answer tokens fed to the matcher

    def sync(self, answer_ids: Sequence[int]) -> None:
        """Feed the matcher the answer tokens it has not seen (`answer_ids[consumed:]`, `advance`)."""
        for t in answer_ids[self.consumed:]:
            self.advance(t)

    def allowed(self, answer_ids: Sequence[int]) -> np.ndarray:
        """bool [vocab_size]: the tokens the grammar allows after `answer_ids` (synced first)."""
        self.sync(answer_ids)
        bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
        if self._m.is_error():  # a limit of the grammar engine reached mid-answer: an error, never an empty "stop"
            raise GrammarError("grammar", "a grammar within the grammar engine's limits",
                               self._m.get_error().split("\n")[0][:300])
        ok = np.zeros(self.vocab_size, dtype=bool)
        n = min(self.vocab_size, bits.size * 8)
        ok[:n] = np.unpackbits(bits, bitorder="little")[:n].astype(bool)
        if 0 <= self.eos_id < n and not self._m.is_accepting():
            ok[self.eos_id] = False  # EOS ends the answer only where the grammar is complete, even if its text matches
        return ok

    def mask(self, logits: np.ndarray, answer_ids: Sequence[int]) -> np.ndarray:
        """`logits` (float [vocab]) with every token the grammar does not allow after `answer_ids`
        set to -inf (a new float64 array).

        Raises:
            GrammarError: the grammar allows no token here (it has ended: `done` should have
                ended the answer) or a token of `answer_ids` broke it (`sync`).
        """
        ok = self.allowed(answer_ids)
        if not ok.any():
            raise GrammarError("grammar", "an answer the grammar can continue",
                               f"no token allowed after {self.consumed} tokens ({self._m.get_error() or 'ended'})")
        if ok.size < logits.size:  # a head wider than the vocabulary: the padding is never allowed
            ok = np.concatenate([ok, np.zeros(logits.size - ok.size, dtype=bool)])
        return np.where(ok[:logits.size], logits.astype(np.float64), -np.inf)

    def advance(self, token_id: int) -> None:
        """Feed one token, the one at answer position `consumed` (the sampler feeds the token it
        just drew, so `done` is current for the finish rule).

        Raises:
            GrammarError: a token the grammar does not allow there (a cloud and device that
                disagree on the grammar, or a caller that skipped the mask).
        """
        if not self._m.consume_token(int(token_id)):
            raise GrammarError("grammar", "tokens the grammar allows",
                               f"token {int(token_id)} at answer position {self.consumed}: {self._m.get_error()[:300]}")
        self.consumed += 1

    @property
    def done(self) -> bool:
        """True when the grammar accepts no further token but EOS (the answer is complete)."""
        return self._m.is_stopped()

    @property
    def accepting(self) -> bool:
        """True when the answer so far is a complete sentence of the grammar."""
        return self._m.is_accepting()


def new_guide(params, tokenizer, vocab_size: int | None = None) -> Guide | None:
    """A fresh `Guide` for a request's `SamplingParams` (None when it has no grammar).
    `tokenizer`: the model's Tokenizer, or a callable returning it (called only for a grammar),
    so an engine loads its tokenizer only when a constrained request comes.

    Raises:
        GrammarError: the grammar does not compile, or no tokenizer is at hand (AttributeError
            or None from `tokenizer`).
    """
    if params.grammar is None:
        return None
    try:
        tok = tokenizer() if callable(tokenizer) else tokenizer
    except AttributeError:
        tok = None
    if tok is None:
        raise GrammarError("grammar", "used with an engine that has the model's tokenizer", "an engine without one")
    return Guide(params.grammar, tok, vocab_size)


async def new_guide_async(params, tokenizer, vocab_size: int | None = None) -> Guide | None:
    """`new_guide` built on a worker thread, for servers: compiling a grammar takes from
    milliseconds to seconds (a schema of hundreds of fields: ~0.1 s), during which the event loop
    keeps streaming the other requests' tokens. Raises what `new_guide` raises."""
    if params.grammar is None:
        return None
    return await asyncio.to_thread(new_guide, params, tokenizer, vocab_size)
