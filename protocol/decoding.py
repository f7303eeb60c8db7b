"""Sampling and the engine-agnostic generation loop, shared by the cloud (torch) and device (ONNX).

Sampling runs on numpy logits on both sides, so a seeded request draws the same token at the same
answer position whichever side computes it: the generator for position `i` is seeded with
`(seed, i)`. That is what makes a seeded split generation continue exactly across the hand-off.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import numpy as np

from .errors import PromptTooLongError


@dataclass(frozen=True)
class SamplingParams:
    """Decoding settings. temperature 0 means greedy (argmax); top_k 0 and top_p 1.0 disable the
    filters; `seed` None draws from fresh entropy. `max_new_tokens` counts generated tokens,
    EOS included."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_new_tokens: int = 128
    stop_ids: tuple[int, ...] = ()

    def __post_init__(self):
        """Raises ValueError naming the first field out of range, its value and the allowed range."""
        if not self.max_new_tokens >= 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be 0 (greedy) or more, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 (off) or more, got {self.top_k}")


def sample(logits: np.ndarray, params: SamplingParams, index: int) -> int:
    """Pick the token at answer position `index` from `logits` (shape [vocab], float32).

    Greedy when temperature is 0; otherwise softmax(logits / T) filtered by top-k then top-p
    (nucleus, Holtzman et al. 2020), drawn with `np.random.default_rng((seed, index))`.
    """
    if params.temperature == 0:
        return int(np.argmax(logits))
    x = logits.astype(np.float64) / params.temperature
    if params.top_k and params.top_k < x.size:
        kth = np.partition(x, -params.top_k)[-params.top_k]
        x = np.where(x < kth, -np.inf, x)
    p = np.exp(x - x.max())
    p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        keep = order[: int(np.searchsorted(cum, params.top_p)) + 1]
        q = np.zeros_like(p)
        q[keep] = p[keep]
        p = q / q.sum()
    rng = np.random.default_rng(None if params.seed is None else (params.seed, index))
    return int(rng.choice(p.size, p=p))


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


def is_stop(token_id: int, eos_id: int, params: SamplingParams) -> str | None:
    """The finish reason if `token_id` ends the answer, else None."""
    if token_id == eos_id:
        return "eos"
    if token_id in params.stop_ids:
        return "stop"
    return None


def generate(engine: Engine, prompt_ids: Sequence[int], params: SamplingParams) -> GenerationOutput:
    """Prefill `prompt_ids`, then decode until EOS, a stop id or `max_new_tokens`.

    Raises:
        PromptTooLongError: prompt + max_new_tokens exceed the engine's context length.
    """
    check_prompt(len(prompt_ids), params.max_new_tokens, engine.context_length)
    out = GenerationOutput()
    t0 = time.perf_counter()
    logits, kv = engine.prefill(prompt_ids)
    out.prefill_ms = (time.perf_counter() - t0) * 1e3
    t1 = time.perf_counter()
    for i in range(params.max_new_tokens):
        tok = sample(logits, params, i)
        out.token_ids.append(tok)
        reason = is_stop(tok, engine.eos_id, params)
        if reason:
            out.finish_reason = reason
            break
        if i + 1 < params.max_new_tokens:
            logits, kv = engine.decode(tok, kv)
    steps = max(len(out.token_ids) - 1, 1)
    out.decode_ms_per_token = (time.perf_counter() - t1) * 1e3 / steps
    return out
