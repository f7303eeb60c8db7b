"""One check of every request value, where it enters: the rule table of the sampling and request
fields that every door uses (the OpenAI HTTP API, the websocket `Generate`, the SDK's
`Client.generate`, the P/D gateway behind both, the relay's `Rank`/`PreInfer` and the pathology
`TileBatch`). Torch-free.

A value breaking its rule raises `FieldError` (a `ValueError`) whose message has one form,
``<field> must be <what is allowed>, got <value>``; `.field` names the field as its door spells it
(``max_tokens`` over HTTP, ``max_new_tokens`` in `SamplingParams`), so the HTTP API answers 400
with ``param`` = that field and the websocket services an `Error(BAD_REQUEST)` carrying the message.

Types follow JSON Schema: a bool is not a number (Python's True is an int: refused), an integral
float is an integer (2.0 is 2), NaN and infinities are no numbers, a string is never a number.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

__all__ = ["FieldError", "Rule", "RULES", "SEED_MIN", "SEED_MAX", "MAX_TOKENS", "MAX_STOP_IDS",
           "MAX_LOGIT_BIAS", "MAX_TOP_LOGPROBS", "MAX_N", "check", "check_ids", "check_vocab"]

SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1  # OpenAI's seed: a signed 64-bit integer
MAX_TOKENS = 1 << 20  # max_new_tokens / min_tokens / cloud_budget ceiling (tokens; the context bounds it first)
MAX_TOP_K = 1 << 20
MAX_STOP_IDS = 64  # entries of stop_ids / stop_token_ids
MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI's limit)
MAX_TOP_LOGPROBS = 20  # OpenAI's limit of top_logprobs (and of /v1/completions' logprobs)
MAX_N = 16  # choices per prompt (n, best_of)
MAX_TIMESTAMP = 1 << 40  # seconds: time gaps of two timestamps never overflow int64


class FieldError(ValueError):
    """A request value outside its rule. `field`: the field as the door names it (``stop_ids[3]``
    for a list entry); `allowed`: what is allowed, in words; `value`: what was given."""

    def __init__(self, field: str, allowed: str, value: Any):
        self.field, self.allowed, self.value = field, allowed, value
        if isinstance(value, (list, tuple, dict)) and len(value) > 8:
            shown = f"{type(value).__name__} of {len(value)} entries"
        elif isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
            shown = f"an integer of {value.bit_length()} bits"  # repr of 10**5000 would itself raise
        elif isinstance(value, str) and len(value) > 80:
            shown = f"a string of {len(value)} characters"
        else:
            shown = repr(value)
        super().__init__(f"{field} must be {allowed}, got {shown}")


def _fmt(x: float) -> str:
    return {SEED_MIN: "-2**63", SEED_MAX: "2**63-1"}.get(x, str(x)) if isinstance(x, int) else f"{x:g}"


@dataclass(frozen=True)
class Rule:
    """A number's rule: an integer (`integer`) or a finite float in [lo, hi] (`lo_open`: (lo, hi])."""

    integer: bool
    lo: float
    hi: float
    lo_open: bool = False

    def allowed(self, hi: float | None = None) -> str:
        hi = self.hi if hi is None else hi
        return (f"{'an integer' if self.integer else 'a number'} in {'(' if self.lo_open else '['}"
                f"{_fmt(self.lo)}, {_fmt(hi)}]")

    def check(self, field: str, v: Any, hi: float | None = None) -> int | float:
        """`v` as int (integer rules) or float, or raises FieldError naming `field` and the range
        (`hi` overrides the rule's upper bound, e.g. the vocabulary's last id)."""
        top, given = self.hi if hi is None else hi, v
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise FieldError(field, self.allowed(top), v)
        if self.integer:
            if not isinstance(v, numbers.Integral):
                try:
                    f = float(v)
                except OverflowError:
                    raise FieldError(field, self.allowed(top), given) from None
                if not (math.isfinite(f) and f.is_integer()):
                    raise FieldError(field, self.allowed(top), v)
            v = int(v)
        else:
            try:
                v = float(v)
            except OverflowError:  # an integer beyond any float (10**400): no number in range either
                raise FieldError(field, self.allowed(top), given) from None
            if not math.isfinite(v):
                raise FieldError(field, self.allowed(top), v)
        if not (self.lo < v if self.lo_open else self.lo <= v) or not v <= top:
            raise FieldError(field, self.allowed(top), given)
        return v


RULES: dict[str, Rule] = {
    # sampling (`decoding.SamplingParams`, HTTP, websocket Generate, SDK)
    "temperature": Rule(False, 0, 2),  # 0 = greedy
    "top_p": Rule(False, 0, 1),  # 1 = off; 0 = the single most likely token
    "top_k": Rule(True, -1, MAX_TOP_K),  # 0 and -1 = off
    "seed": Rule(True, SEED_MIN, SEED_MAX),
    "max_new_tokens": Rule(True, 1, MAX_TOKENS),
    "min_tokens": Rule(True, 0, MAX_TOKENS),
    "presence_penalty": Rule(False, -2, 2),
    "frequency_penalty": Rule(False, -2, 2),
    "repetition_penalty": Rule(False, 0, 2, lo_open=True),  # 1 = off
    "logit_bias": Rule(False, -100, 100),
    "logprobs": Rule(True, 0, MAX_TOP_LOGPROBS),
    "top_logprobs": Rule(True, 0, MAX_TOP_LOGPROBS),
    "n": Rule(True, 1, MAX_N),
    "best_of": Rule(True, 1, MAX_N),
    # split requests
    "cloud_budget": Rule(True, 0, MAX_TOKENS),
    "refine": Rule(False, 0, 1, lo_open=True),
    "kv_from": Rule(True, 0, MAX_TOKENS),
    "kv_rate": Rule(False, 0, 1e12, lo_open=True),  # bytes/s
    "handoff_index": Rule(True, 0, MAX_TOKENS),  # Stop: the first answer position the device generates
    "token_id": Rule(True, 0, (1 << 31) - 1),  # hi: the vocabulary's last id where it is known
    # relay
    "int64": Rule(True, SEED_MIN, SEED_MAX),
    "user_id": Rule(True, SEED_MIN, SEED_MAX),
    "item_id": Rule(True, 1, SEED_MAX),  # hi: the catalogue's last id
    "timestamp": Rule(True, 0, MAX_TIMESTAMP),
    # pathology
    "coord": Rule(True, 0, (1 << 31) - 1),
    "device_score": Rule(False, 0, 1),
}
"""Field name -> its rule. Doors that spell a field otherwise pass their name as `field`."""


def check(name: str, v: Any, field: str | None = None, *, hi: float | None = None, optional: bool = False):
    """`v` checked by `RULES[name]` (None passes when `optional`); raises FieldError naming `field`
    (default `name`)."""
    if v is None and optional:
        return None
    return RULES[name].check(field or name, v, hi)


def check_ids(field: str, ids: Any, hi: int, *, rule: str = "token_id", max_len: int | None = None,
              min_len: int = 0) -> list[int]:
    """A list of ids (each by `RULES[rule]`, at most `hi`) with `min_len`..`max_len` entries, as
    ints; raises FieldError naming `field` (or ``field[i]`` for the first bad entry)."""
    if isinstance(ids, np.ndarray):  # an integer array (in-process callers): checked in one pass
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise FieldError(field, "a list of ids", ids.tolist())
        ids = ids.tolist()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise FieldError(field, "a list of ids", ids)
    if len(ids) < min_len or (max_len is not None and len(ids) > max_len):
        what = f"at least {min_len}" if max_len is None else f"{min_len}..{max_len}"
        raise FieldError(field, f"a list of {what} ids", ids)
    r = RULES[rule]
    if all(type(t) is int and r.lo <= t <= hi for t in ids):  # the common case, without a call per id
        return list(ids)
    return [r.check(f"{field}[{i}]", t, hi) for i, t in enumerate(ids)]


def check_vocab(vocab_size: int, stop_ids: Iterable[int] = (), logit_bias: Iterable[tuple[int, float]] = (),
                stop_field: str = "stop_ids", bias_field: str = "logit_bias") -> None:
    """Token ids of the sampling fields that only the served model can bound: every stop id and
    logit-bias key in [0, vocab_size). Raises FieldError naming the field."""
    check_ids(stop_field, list(stop_ids), vocab_size - 1)
    for t, _ in logit_bias:
        check("token_id", t, f"{bias_field}[{t!r}]", hi=vocab_size - 1)


def check_prompt_text(prompt, field: str = "prompt") -> None:
    """The one rule for empty input, at every entry point: a prompt must hold some text (or
    tokens). Refused: a string that is empty or only whitespace, an empty list, a list of messages
    whose contents are all empty or whitespace, an empty list of token ids.

    Raises:
        ValueError: the prompt is empty by this rule (the message says which form was empty).
    """
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError(f"{field} is empty: give a message with some text")
        return
    if isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
        if len(prompt) == 0:
            raise ValueError(f"{field} is empty: give a message with some text, a list of messages, or token ids")
        if all(isinstance(m, dict) for m in prompt) and not any(_has_text(m.get("content")) for m in prompt):
            raise ValueError(f"{field} has {len(prompt)} message(s) but none with text: give at least one "
                             "message whose content is not empty")
        return
    raise ValueError(f"{field} must be a string, a list of messages or a list of token ids, got "
                     f"{type(prompt).__name__}")


def _has_text(content) -> bool:
    if isinstance(content, str):
        return bool(content.strip())
    if isinstance(content, list):  # OpenAI content parts: [{"type": "text", "text": ...}]
        return any(isinstance(p, dict) and isinstance(p.get("text"), str) and p["text"].strip() for p in content)
    return False
