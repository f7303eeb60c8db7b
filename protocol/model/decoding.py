"""Sampling and the engine-agnostic generation loop, shared by the cloud (torch) and device (ONNX).

Sampling runs on numpy logits on both sides, so a seeded request draws the same token at the same
answer position whichever side computes it: the generator for position `i` is seeded with
`(seed_key(seed), i)` (`seed_key`: the signed 64-bit seed as its unsigned bits). That is what
makes a seeded split generation continue exactly across the hand-off.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import numpy as np

from relayinfer.protocol.model.errors import PromptTooLongError
from relayinfer.protocol.validate import MAX_LOGIT_BIAS, MAX_STOP_IDS, FieldError, check, check_ids
from relayinfer.protocol.messages import Generate, Grammar


@dataclass(frozen=True)
class SamplingParams:
    """Decoding settings, each in the range of `protocol.validate.RULES`. temperature in [0, 2], 0
    means greedy (argmax); top_k 0 (or -1) and top_p 1.0 disable the filters (top_p 0 keeps the
    most likely token); `seed` an integer in [-2**63, 2**63 - 1] (OpenAI's signed 64-bit seed,
    mapped by `seed_key`), None draws from fresh entropy. `max_new_tokens` counts generated tokens,
    EOS included. `stop_ids`: token ids that end the answer (finish reason 'stop').

    Logit adjustments (applied in this order, before temperature and the filters; the neutral
    defaults change nothing):
      * `logit_bias`: (token id, bias) pairs added to the logits (OpenAI's `logit_bias`, bias in
        [-100, 100]);
      * `min_tokens`: EOS and `stop_ids` are masked (-inf) until `min_tokens` tokens were
        generated (vLLM's `min_tokens`);
      * `repetition_penalty` r in (0, 2] over every token of the prompt and the answer so far: a
        positive logit is divided by r, a negative one multiplied (CTRL, Keskar et al. 2019; HF's
        `RepetitionPenaltyLogitsProcessor`, vLLM's definition);
      * `frequency_penalty` f and `presence_penalty` p in [-2, 2] over the answer so far only
        (OpenAI's definition): logit[t] -= f * count(t) + p * (count(t) > 0).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_new_tokens: int = 128
    stop_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # None: off; k >= 0: the sampled token's logprob and the top k (engine only)
    grammar: Grammar | None = None  # structured output: every token stays inside it (protocol.model.grammar)

    def __post_init__(self):
        """Checks and normalises every field by the shared rule table (`protocol.validate.RULES`):
        integral floats become ints, top_k -1 becomes 0 (off), stop_ids a tuple. Token ids are
        only bounded here by 0..2**31-1; `protocol.validate.check_vocab` bounds them by the model.

        Raises:
            protocol.validate.FieldError (a ValueError) naming the first bad field, its value and
            the allowed range; also min_tokens > max_new_tokens (vLLM's rule), more than
            MAX_STOP_IDS stop ids or MAX_LOGIT_BIAS logit-bias entries, a token id twice in
            logit_bias.
        """
        put = lambda name, v: object.__setattr__(self, name, v)  # noqa: E731 (frozen)
        for name in ("temperature", "top_p", "top_k", "max_new_tokens", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "min_tokens"):
            put(name, check(name, getattr(self, name)))
        put("top_k", max(0, self.top_k))
        put("seed", check("seed", self.seed, optional=True))
        put("logprobs", check("logprobs", self.logprobs, optional=True))
        if self.min_tokens > self.max_new_tokens:
            raise FieldError("min_tokens", f"at most max_new_tokens ({self.max_new_tokens})", self.min_tokens)
        put("stop_ids", tuple(check_ids("stop_ids", self.stop_ids, (1 << 31) - 1, max_len=MAX_STOP_IDS)))
        bias = self.logit_bias
        if isinstance(bias, (str, bytes)) or not isinstance(bias, Sequence) or len(bias) > MAX_LOGIT_BIAS or \
                not all(isinstance(e, Sequence) and len(e) == 2 for e in bias):
            raise FieldError("logit_bias", f"at most {MAX_LOGIT_BIAS} (token id, bias) pairs", bias)
        put("logit_bias", tuple((check("token_id", t, f"logit_bias[{t!r}]"), check("logit_bias", b, f"logit_bias[{t!r}]"))
                                for t, b in bias))
        seen: set[int] = set()
        for t, _ in self.logit_bias:  # one bias per token: repeats would add up past [-100, 100]
            if t in seen:
                raise FieldError(f"logit_bias[{t}]", "given once per token id", t)
            seen.add(t)
        if self.grammar is not None:
            if not isinstance(self.grammar, Grammar):
                raise FieldError("grammar", "a Grammar (kind, spec) or None", self.grammar)
            from relayinfer.protocol.model.grammar import grammar_text

            grammar_text(self.grammar)  # GrammarError (a FieldError) naming what does not compile

    @property
    def adjusts_logits(self) -> bool:
        """True when `adjust_logits` changes anything (else sampling skips it)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.min_tokens or self.logit_bias)

    @property
    def needs_context(self) -> bool:
        """True when sampling reads the prompt and answer ids (`adjust_logits`, or a grammar's mask):
        callers pass them only then, and only then is a greedy row more than an argmax."""
        return self.adjusts_logits or self.grammar is not None


def adjust_logits(logits: np.ndarray, params: SamplingParams, context: Sequence[int] = (), n_prompt: int = 0,
                  eos_id: int | None = None) -> np.ndarray:
    """`logits` (float [vocab]) after `params`' logit bias, min_tokens mask and penalties (see
    `SamplingParams`), as a new float64 array. `context` holds the prompt ids (its first
    `n_prompt`) then the answer ids generated so far; `min_tokens` masks `eos_id` and `stop_ids`."""
    x = logits.astype(np.float64)
    if not params.adjusts_logits:
        return x
    v = x.size
    for t, b in params.logit_bias:
        if 0 <= t < v:
            x[t] += b
    out = np.asarray(context[n_prompt:], dtype=np.int64)
    out = out[(out >= 0) & (out < v)]
    if params.min_tokens and len(context) - n_prompt < params.min_tokens:
        for t in ((eos_id,) if eos_id is not None else ()) + tuple(params.stop_ids):
            if 0 <= t < v:
                x[t] = -np.inf
    if params.repetition_penalty != 1.0 and len(context):
        seen = np.unique(np.asarray(context, dtype=np.int64))
        seen = seen[(seen >= 0) & (seen < v)]
        r = params.repetition_penalty
        with np.errstate(over="ignore"):  # r near 0 sends a seen positive logit to +inf (see `sample`)
            x[seen] = np.where(x[seen] > 0, x[seen] / r, x[seen] * r)
    if (params.frequency_penalty or params.presence_penalty) and out.size:
        counts = np.bincount(out, minlength=v)[:v]
        x -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return x


def token_logprobs(logits: np.ndarray, token_id: int, top: int = 0) -> tuple[float, list[tuple[int, float]]]:
    """Log-probability of `token_id` and the `top` most likely (id, logprob) pairs, best first
    (ties by id).

    Values are the log-softmax of the model's full-vocabulary `logits` (float [vocab]) as the
    model gives them: temperature, top-p/top-k, penalties and logit bias do not change them (the
    same choice as vLLM's default `logprobs_mode="raw_logprobs"`).
    """
    x = logits.astype(np.float64)
    m = x.max()
    lp = x - (m + np.log(np.exp(x - m).sum()))
    best: list[tuple[int, float]] = []
    if top:
        k = min(top, x.size)
        idx = np.argpartition(-lp, k - 1)[:k]
        idx = idx[np.lexsort((idx, -lp[idx]))]
        best = [(int(i), float(lp[i])) for i in idx]
    return float(lp[token_id]), best


TOP_P_CANDIDATES = 64  # nucleus filtering sorts this many most likely tokens first (all ties included)
SAMPLING_EPS = 1e-5  # a temperature below this is greedy (vLLM's _SAMPLING_EPS): logits / 1e-310 overflow to inf


def top_p_keep(p: np.ndarray, top_p: float) -> np.ndarray:
    """Token ids kept by nucleus filtering (Holtzman et al. 2020, "The Curious Case of Neural Text
    Degeneration", sec. 3.1) of probabilities `p` (float64 [vocab]): the shortest prefix of the
    tokens in decreasing probability (ties: lower id first) whose cumulative mass reaches `top_p`,
    in that order.

    Exactly the set (and cumulative sums) of a stable argsort of the whole vocabulary, without it:
    the `TOP_P_CANDIDATES` most likely tokens, plus every token tied with the last of them, are
    the head of that order (all others are strictly less likely), so only they are sorted; when
    their mass stays below `top_p` the candidate count grows 8x, up to the whole vocabulary.
    """
    v, k = p.size, min(TOP_P_CANDIDATES, p.size)
    while True:
        cand = np.flatnonzero(p >= np.partition(p, v - k)[v - k]) if k < v else np.arange(v)
        order = cand[np.lexsort((cand, -p[cand]))]
        cum = np.cumsum(p[order])
        n = int(np.searchsorted(cum, top_p))
        if n < cum.size or k >= v:
            return order[: n + 1]
        k = min(v, 8 * k)


def draw(p: np.ndarray, rng: np.random.Generator) -> int:
    """One token id drawn from probabilities `p` (float64 [vocab], summing to 1) with one
    `rng.random()` and the inverse CDF: the draw of `rng.choice(p.size, p=p)` (numpy's
    `Generator.choice`: cumsum, divide by the last entry, `searchsorted(side="right")`) without its
    O(vocab) validation passes."""
    cdf = np.cumsum(p)
    cdf /= cdf[-1]
    return int(np.searchsorted(cdf, rng.random(), side="right"))


def sample(logits: np.ndarray, params: SamplingParams, index: int, context: Sequence[int] = (),
           n_prompt: int = 0, eos_id: int | None = None, guide=None) -> int:
    """Pick the token at answer position `index` from `logits` (shape [vocab], float32).

    With `guide` (the request's `protocol.model.grammar.Guide`, None without a grammar) the logits
    of tokens the grammar does not allow after the answer so far (`context[n_prompt:]`) are -inf
    first, and the token drawn is fed to the guide (so its `done` is current for `finish_reason`).

    The logits are first adjusted by `adjust_logits` (penalties over `context`: the prompt's
    `n_prompt` ids then the `index` answer ids so far; `min_tokens` masks `eos_id` and stop ids).
    Greedy when temperature is below `SAMPLING_EPS` (0 included); otherwise softmax(logits / T)
    (a logit that overflowed to +inf takes all the mass, shared with any other +inf one) filtered
    by top-k then top-p
    (nucleus, `top_p_keep`), drawn with `np.random.default_rng((seed_key(seed), index))` (`draw`). Every
    side (cloud engine, split service, device) calls this with the same arguments at the same
    position, so a seeded answer is the same whichever side draws each token. No step sorts the
    whole vocabulary (top-k: one partition; top-p: see `top_p_keep`).

    Raises:
        FloatingPointError: the logits hold NaN, or every logit is -inf (a model fault; the
            engines end this request alone with the error).
    """
    if guide is not None:
        logits = guide.mask(logits, context[n_prompt:])
        tok = _pick(logits, params, index, context, n_prompt, eos_id)
        guide.advance(tok)
        return tok
    return _pick(logits, params, index, context, n_prompt, eos_id)


def _pick(logits: np.ndarray, params: SamplingParams, index: int, context: Sequence[int], n_prompt: int,
          eos_id: int | None) -> int:
    if params.adjusts_logits:
        logits = adjust_logits(logits, params, context, n_prompt, eos_id)
    if np.isnan(logits).any():  # a model fault, not a choice: this request fails (the engine serves on)
        raise FloatingPointError(f"the logits hold {int(np.isnan(logits).sum())} NaN values")
    if params.temperature < SAMPLING_EPS:
        return int(np.argmax(logits))
    with np.errstate(over="ignore"):
        x = logits.astype(np.float64) / params.temperature
    if params.top_k and params.top_k < x.size:
        kth = np.partition(x, -params.top_k)[-params.top_k]
        x = np.where(x < kth, -np.inf, x)
    top = x.max()
    if top == np.inf:  # a logit pushed past any float (repetition_penalty 1e-310): the limit of softmax,
        p = (x == np.inf).astype(np.float64)  # uniform over the infinite ones
    elif top == -np.inf:
        raise FloatingPointError("every token's logit is -inf: nothing to sample")
    else:
        p = np.exp(x - top)
    p /= p.sum()
    if params.top_p < 1.0:
        keep = top_p_keep(p, params.top_p)
        q = np.zeros_like(p)
        q[keep] = p[keep]
        p = q / q.sum()
    return draw(p, np.random.default_rng(None if params.seed is None else (seed_key(params.seed), index)))


def seed_key(seed: int) -> int:
    """The generator key of a request seed: OpenAI's seed is a signed 64-bit integer, in
    [-2**63, 2**63 - 1] (`protocol.validate.SEED_MIN`..`SEED_MAX`), and numpy's generators take
    non-negative integers, so the seed is read as the unsigned 64-bit integer of the same bits,
    `seed % 2**64` (0..2**63-1 are unchanged, -1 is 2**64-1). Every side that samples (cloud
    engine, split service, device) maps it here, so a seeded answer continues exactly across the
    hand-off."""
    return seed % (1 << 64)


class Engine(Protocol):
    """What the generation loop needs from a runtime (torch on the cloud, ONNX on the device).

    `prefill(ids, kv)` runs `ids` after the cached tokens in `kv` (None = empty cache) and returns
    the logits of the last position (np.float32 [vocab]) and the grown cache. `decode` is
    prefill of one token. `context_length` bounds cached + new tokens.
    """

    context_length: int
    eos_id: int

    def prefill(self, ids: Sequence[int], kv: Any = None) -> tuple[np.ndarray, Any]: ...

    def decode(self, token_id: int, kv: Any) -> tuple[np.ndarray, Any]: ...


@dataclass
class GenerationOutput:
    """token_ids: generated ids (EOS included if produced); finish_reason: 'eos', 'stop' or
    'length'; prefill_ms: wall ms of the prompt prefill (to the first token's logits);
    decode_ms_per_token: mean wall ms per decode step after the first token."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    prefill_ms: float = 0.0
    decode_ms_per_token: float = 0.0


# The sampling fields a Generate carries, by the same names as SamplingParams.
WIRE_SAMPLING = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop_ids", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "min_tokens", "logit_bias", "grammar")


def params_of(msg: Generate) -> SamplingParams:
    """The SamplingParams of a Generate (the cloud's side of the conversion; `generate_message` is
    the device's). Raises FieldError (a ValueError naming the field) for a value outside the rules."""
    kw = {k: getattr(msg, k) for k in WIRE_SAMPLING}
    kw["stop_ids"], kw["logit_bias"] = tuple(msg.stop_ids), tuple((t, b) for t, b in msg.logit_bias)
    return SamplingParams(**kw)


def generate_message(request_id: str, prompt_ids: Sequence[int], params: SamplingParams, *,
                     cloud_budget: int | None = None, refine: float | None = None,
                     kv_from: int | None = None, kv_rate: float | None = None,
                     kv_wire: str = "float16") -> Generate:
    """The Generate that asks a cloud for `params` on `prompt_ids` (every sampling field travels, so
    both sides sample the same answer); `kv_from` / `kv_rate` (bytes/s) / `kv_wire` (its format,
    'float16' or 'int8') ask for the KV hand-off.

    Raises:
        ValueError: `params.logprobs` is set; the split protocol carries no logprobs (the OpenAI
            HTTP API does).
    """
    if params.logprobs is not None:
        raise FieldError("logprobs", "left out for a split request (the OpenAI HTTP API returns logprobs)",
                         params.logprobs)
    kw = {k: getattr(params, k) for k in WIRE_SAMPLING}
    kw["stop_ids"], kw["logit_bias"] = list(params.stop_ids), list(params.logit_bias)
    return Generate(request_id, list(prompt_ids), cloud_budget=cloud_budget, refine=refine, kv_from=kv_from,
                    kv_rate=kv_rate if kv_from is not None else None,
                    kv_wire=kv_wire if kv_from is not None else "float16", **kw)


def check_prompt(n_prompt: int, max_new_tokens: int, context_length: int) -> None:
    """Raises PromptTooLongError when prompt + answer cannot fit the context window (tokens)."""
    if n_prompt == 0:
        raise ValueError("empty prompt: at least one token is needed")
    if n_prompt >= context_length:
        raise PromptTooLongError(
            f"prompt too long: {n_prompt} prompt tokens, and the model's context length of {context_length} "
            f"tokens must hold the prompt and at least one new token")
    if n_prompt + max_new_tokens > context_length:
        raise PromptTooLongError(
            f"max_new_tokens {max_new_tokens} is too large for this prompt: {n_prompt} prompt tokens + "
            f"{max_new_tokens} new tokens exceed the context length of {context_length} tokens; at most "
            f"{context_length - n_prompt} new tokens fit")


def finish_reason(token_id: int, n_generated: int, params: SamplingParams, eos_id: int,
                  budget: int | None = None, guide=None) -> str | None:
    """The one finish rule: why the answer ends at `token_id`, or None when it goes on.

    `n_generated`: answer tokens so far, `token_id` included (1 for the first token); `eos_id`:
    the model's EOS id (-1 when EOS is ignored); `budget`: the cloud's token budget for a split
    request (None: no budget); `guide`: the request's grammar state after `token_id` (None: no
    grammar). In order: 'eos' (token_id is EOS), 'stop' (a `params.stop_ids` id, or the grammar
    is complete and allows nothing but EOS: the answer ends there, without it), 'length' (`n_generated` reached `params.max_new_tokens`), 'budget' (`n_generated` reached
    `budget`: the cloud's share ends, the answer itself does not). Stop *strings* are a property
    of the text and are cut where the text is rendered (the OpenAI server), after this rule.
    """
    if token_id == eos_id:
        return "eos"
    if token_id in params.stop_ids or (guide is not None and guide.done):
        return "stop"
    if n_generated >= params.max_new_tokens:
        return "length"
    if budget is not None and n_generated >= budget:
        return "budget"
    return None


def generate(engine: Engine, prompt_ids: Sequence[int], params: SamplingParams) -> GenerationOutput:
    """Prefill `prompt_ids`, then decode until EOS, a stop id, the grammar's end or `max_new_tokens`
    (a grammar needs the engine's `tokenizer`).

    Raises:
        PromptTooLongError: prompt + max_new_tokens exceed the engine's context length.
        GrammarError: `params.grammar` is set and the engine has no tokenizer.
    """
    from relayinfer.protocol.model.grammar import new_guide

    check_prompt(len(prompt_ids), params.max_new_tokens, engine.context_length)
    guide = new_guide(params, lambda: engine.tokenizer)
    out = GenerationOutput()
    t0 = time.perf_counter()
    logits, kv = engine.prefill(prompt_ids)
    out.prefill_ms = (time.perf_counter() - t0) * 1e3
    t1 = time.perf_counter()
    prompt = list(prompt_ids)
    for i in range(params.max_new_tokens):
        tok = sample(logits, params, i, prompt + out.token_ids if params.needs_context else (), len(prompt),
                     engine.eos_id, guide)
        out.token_ids.append(tok)
        reason = finish_reason(tok, i + 1, params, engine.eos_id, guide=guide)
        if reason:
            out.finish_reason = reason
            break
        logits, kv = engine.decode(tok, kv)
    steps = max(len(out.token_ids) - 1, 1)
    out.decode_ms_per_token = (time.perf_counter() - t1) * 1e3 / steps
    return out
