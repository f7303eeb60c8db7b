"""Hostile-input run against the four servers: every request field at and beyond its boundaries.

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python -m bench.hostile                 # ~10,000 inputs, <= 15 min of sending
    .venv/bin/python -m bench.hostile --quick --servers cloud relay                # ~300 inputs (the test)
    .venv/bin/python -m bench.hostile --servers relay --replay 123                 # input 123 of relay's sequence again

Servers (each a subprocess on 127.0.0.1, free ports, a random token where the CLI takes one,
``--threads 1``, small budgets; started one after the other so that only one loads a model at a
time): ``cloud`` (``relayinfer cloud serve``: OpenAI HTTP routes + the websocket token stream),
``pd`` (``relayinfer pd serve``, a local Ray with one prefill and one decode instance: the same
HTTP + websocket doors in front of the P/D gateway), ``relay`` (``relayinfer relay serve``:
websocket ``Rank`` / ``PreInfer``), ``patho`` (``relayinfer patho serve --arch vit-tiny-test``:
websocket ``TileBatch``).

Inputs: a deterministic generator (``random.Random(seed)`` per server; input ``i`` of a server is
the same on every run with the same seed) takes one valid, cheap request (max_tokens 2, a one-word
prompt, one history / tile) and changes one field to a hostile value: int64 extremes (+-2**63,
2**64), -1, 0, NaN, +-inf, bools, strings, null, nested objects, 10^5-item lists, 1 MiB strings,
lone surrogates, wrong types, the field removed, an unknown field added; plus whole-body / whole-frame
faults: malformed JSON, deep nesting, truncated MessagePack, wrong or unknown message type, text
websocket messages, frames over the limit, bad handshakes. The field-by-value grid comes first (so
that a short run still covers each field), then random picks.

What is checked, per input: HTTP: no 5xx, no dropped connection, no hang (``--request-timeout-s``);
a 4xx has an OpenAI JSON error whose message or ``param`` names the field; a value that is
certainly invalid (NaN for ``temperature``, a string for ``max_tokens``, ...) is not answered 200;
a 200 stream ends with ``data: [DONE]``. Websocket: the answer to a well-framed message is an
``Error`` with a known code (naming the field when a field was wrong) or a valid result (``Done``,
``Scores``, ``Embeddings``), never a close without an ``Error`` and never silence past the timeout; a
malformed frame gets ``BAD_FRAME`` / ``UNKNOWN_MESSAGE`` / ``FRAME_TOO_LARGE`` before the close.
After every ``--batch`` inputs and at the end: the process is alive, ``/healthz`` answers 200 with
the token (cloud, pd), a valid probe request still gets its answer (all four). At the end: the
servers' gauges (``/metrics`` gauges of sessions, requests, KV blocks, running / waiting / queues;
relay ``/stats``) are back to 0 within ``--settle-s``, RSS (``VmRSS``) before (after the first batch,
model warm) and after, and tracebacks in the server's log.

Each finding holds the server, the input's index (``--replay``), what was sent (large values
abbreviated as ``<'A' * 1048576>``) and what came back. Writes ``bench/results/hostile.json`` (with
the command line, git commit and date) and ``bench/results/hostile.md``. Exit status 0 (findings
are results, not failures of the driver); 2 when a server could not be started at all.
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import datetime
import json
import math
import os
import platform
import random
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parents[1]
SERVERS = ("cloud", "pd", "relay", "patho")
SHARE = {"cloud": 0.4, "pd": 0.2, "relay": 0.2, "patho": 0.2}  # of --inputs and --max-wall-s
SURROGATE = "\ud800"
_SURR_MARK = "\x00SURROGATE\x00"  # msgpack cannot carry a lone surrogate: the frame gets its CESU bytes
BIG_STR = "A" * (1 << 20)
WS_CODES = {"bad_frame", "frame_too_large", "unknown_message", "version_mismatch", "fingerprint_mismatch",
            "unauthorized", "handshake_required", "prompt_too_long", "bad_request", "overloaded",
            "unknown_request", "internal"}
HANDSHAKE_WS_LIMIT = 4096 + 64 * 1024  # protocol.transport.ws.ws_max_size(HANDSHAKE_MAX_BYTES)
SEVERITY = {  # finding kind -> high (a crash, a hang, a leak, a lost answer), medium (a wrong answer), low (a vague error)
    **dict.fromkeys(("http_5xx", "server_died", "server_unhealthy", "unhealthy_at_end", "server_failed_to_start",
                     "ws_internal_error", "ws_no_answer", "ws_no_result", "http_timeout", "http_connection_dropped",
                     "gauges_not_zero_at_end", "ws_closed_without_error", "ws_handshake_limit_after_welcome",
                     "hello_no_answer", "hello_closed_without_error", "driver_error"), "high"),
    **dict.fromkeys(("http_invalid_accepted", "ws_invalid_accepted", "hello_invalid_accepted", "http_stream_not_terminated",
                     "ws_malformed_frame_not_refused", "http_200_without_choices", "http_200_not_json",
                     "ws_unknown_error_code"), "medium"),
    **dict.fromkeys(("http_4xx_not_naming_field", "ws_error_not_naming_field", "http_4xx_not_json"), "low"),
}
ZERO_GAUGE = re.compile(r"session|request|kv_blocks_used|running|waiting|queue|in_flight|pending|inflight", re.I)


# --- hostile values ---------------------------------------------------------------------------------

class _Missing:
    """The field is removed from the request."""

    def __repr__(self) -> str:
        return "<missing>"


MISSING = _Missing()


def _nest(depth: int) -> Any:
    v: Any = 1
    for _ in range(depth):
        v = [v]
    return v


def generic_values(wire: str) -> list[tuple[str, Any]]:
    """(label, value) of the hostile values every field gets. `wire`: "json" or "msgpack" (msgpack
    has no integer above 2**64 - 1 and no lone surrogate: those become their nearest encodable kin)."""
    vals: list[tuple[str, Any]] = [
        ("int:0", 0), ("int:-1", -1), ("int:1", 1), ("int:2**31", 2**31), ("int:2**53+1", 2**53 + 1),
        ("int:2**63-1", 2**63 - 1), ("int:2**63", 2**63), ("int:-2**63", -2**63), ("int:2**64-1", 2**64 - 1),
        ("float:0.5", 0.5), ("float:-0.0", -0.0), ("float:1e-310", 1e-310), ("float:1e308", 1e308),
        ("float:nan", math.nan), ("float:inf", math.inf), ("float:-inf", -math.inf),
        ("bool:true", True), ("bool:false", False), ("null", None),
        ("str:empty", ""), ("str:x", "x"), ("str:1", "1"), ("str:nan", "NaN"),
        ("str:1MiB", BIG_STR), ("str:surrogate", SURROGATE if wire == "json" else _SURR_MARK),
        ("list:empty", []), ("list:[1,2,3]", [1, 2, 3]), ("list:1e5 ints", [7] * 100_000),
        ("list:1e5 strs", ["a"] * 100_000), ("list:nested100", _nest(100)),
        ("obj:empty", {}), ("obj:{a:1}", {"a": 1}), ("obj:nested", {"a": {"b": {"c": [None, {"d": math.nan}]}}}),
        ("missing", MISSING),
    ]
    if wire == "json":
        vals += [("int:-2**63-1", -2**63 - 1), ("int:2**64", 2**64), ("int:10**400", 10**400),
                 ("str:1MiB-minus", "B" * 900_000)]
    return vals


def _limit_1009(closed: str) -> int | None:
    """The limit (bytes) in websockets' 1009 close ("1009 frame [with N bytes ]exceeds limit of M
    bytes", by version), or None for any other close."""
    m = re.match(r"1009 frame (?:with \d+ bytes )?exceeds limit of (\d+) bytes", closed)
    return int(m.group(1)) if m else None


def _ws_invalid(name: str, value: Any, invalid: bool | None) -> bool | None:
    """Whether a websocket frame with `value` in field `name` is invalid: a lone surrogate (bytes
    that are not UTF-8) makes any known field's frame invalid; an unknown key's value is skipped
    unread (docs/PROTOCOL.md: unknown keys are ignored), so its bytes are not checked."""
    return True if value == _SURR_MARK and name != "unknown_field" else invalid


def abbreviate(v: Any, depth: int = 0) -> Any:
    """A JSON-able, short description of `v` (the repro in the report): long strings and lists
    are written as <'A' * N> / <[x] * N>, floats that JSON lacks as "NaN"/"Infinity"."""
    if isinstance(v, _Missing):
        return "<missing>"
    if isinstance(v, float) and not math.isfinite(v):
        return f"<float {v}>"
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) > 2**70:
        return f"<int with {len(str(abs(v)))} digits>"
    if isinstance(v, str):
        if v == _SURR_MARK:
            return "<lone surrogate \\ud800 as CESU-8 bytes ed a0 80>"
        if len(v) > 120:
            return f"<{v[:1]!r} * {len(v)}>" if v == v[:1] * len(v) else f"<str of {len(v)} chars: {v[:60]!r}...>"
        return v if v.encode("utf-8", "surrogatepass") == v.encode("utf-8", "surrogatepass") and SURROGATE not in v \
            else f"<str with lone surrogate: {v.encode('utf-8', 'surrogatepass')!r}>"
    if isinstance(v, (bytes, bytearray)):
        b = bytes(v)
        return f"<{len(b)} bytes: {b[:48].hex()}{'...' if len(b) > 48 else ''}>"
    if isinstance(v, list):
        if depth > 6:
            return "<nested deeper>"
        if len(v) > 8:
            if all(x == v[0] for x in v[:64]) and all(x == v[0] for x in v[-64:]):
                return f"<[{json.dumps(abbreviate(v[0], depth + 1))}] * {len(v)}>"
            return [abbreviate(x, depth + 1) for x in v[:4]] + [f"<... {len(v)} items>"]
        return [abbreviate(x, depth + 1) for x in v]
    if isinstance(v, dict):
        if depth > 6:
            return "<nested deeper>"
        items = list(v.items())
        out = {str(k)[:80]: abbreviate(x, depth + 1) for k, x in items[:12]}
        if len(items) > 12:
            out["<...>"] = f"{len(items)} keys"
        return out
    return v


# --- cases ------------------------------------------------------------------------------------------

@dataclass
class Case:
    """One input. `door`: "http" (POST `path` with `body` JSON or `raw` bytes), "ws" (one frame
    `frame` after the handshake, or `raw` bytes / a text message), "hello" (a handshake frame).
    `field`/`label`: what is hostile; `invalid`: True when the value is certainly wrong (a 200 /
    a result is then a finding), None when either answer is fine. `pre`: a valid Generate sent first
    (Stop / Cancel / ExtendBudget cases act on it)."""

    index: int
    door: str
    target: str
    field: str
    label: str
    body: Any = None
    raw: bytes | str | None = None
    headers: dict = field(default_factory=dict)
    invalid: bool | None = None
    pre: dict | None = None
    expect: str = ""  # ws: the message type of the valid answer ("done", "scores", "embeddings", "")

    def repro(self) -> dict:
        out: dict = {"index": self.index, "door": self.door, "target": self.target, "field": self.field,
                     "value": self.label}
        if self.body is not None:
            out["body"] = abbreviate(self.body)
        if self.raw is not None:
            out["raw"] = abbreviate(self.raw)
        if self.headers:
            out["headers"] = self.headers
        if self.pre is not None:
            out["sent_first"] = abbreviate(self.pre)
        return out


def _set(base: dict, path: list, value: Any) -> dict:
    """Deep copy of `base` with the item at `path` (keys / list indices) set to `value` (removed for MISSING)."""
    out = copy.deepcopy(base)
    if not path:
        return value
    cur = out
    for k in path[:-1]:
        cur = cur[k]
    if value is MISSING:
        if isinstance(cur, dict):
            cur.pop(path[-1], None)
        else:
            del cur[path[-1]]
    else:
        cur[path[-1]] = value
    return out


def _num_invalid(v: Any, lo: float | None = None, hi: float | None = None, integer: bool = False,
                 nullable: bool = True) -> bool | None:
    """True when `v` is certainly not a valid value of a numeric field in [lo, hi]."""
    if v is MISSING or (v is None and nullable):
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return True
    if isinstance(v, float) and not math.isfinite(v):
        return True
    if integer and isinstance(v, float) and not v.is_integer():
        return True
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        return True
    return None


def _bool_invalid(v: Any) -> bool | None:
    if v is MISSING or v is None or isinstance(v, bool):
        return None
    return True


def _str_invalid(v: Any) -> bool | None:
    if v is MISSING or v is None:
        return None
    return True if not isinstance(v, str) or v in (SURROGATE,) else None


def _surrogates(v: Any) -> bool:
    return json.dumps(v, default=str).find("\\ud800") >= 0 if not isinstance(v, float) else False


# OpenAI fields: name -> (path, invalid(value), specials). Ranges from OpenAI's API reference.
def openai_fields(chat: bool, vocab: int, max_len: int) -> dict:
    """The fields of /v1/chat/completions (`chat`) or /v1/completions and their boundary values."""
    f = {
        "model": (["model"], _str_invalid, [("str:other", "gpt-4"), ("str:../../etc/passwd", "../../etc/passwd")]),
        "max_tokens": (["max_tokens"], lambda v: _num_invalid(v, 1, None, True),
                       [("int:max_len", max_len), ("int:max_len+1", max_len + 1), ("int:64", 64), ("float:2.0", 2.0),
                        ("float:2.5", 2.5)]),
        "temperature": (["temperature"], lambda v: _num_invalid(v, 0, 2),
                        [("float:2.0", 2.0), ("float:2.0001", 2.0001), ("float:-0.001", -0.001), ("float:1e-30", 1e-30)]),
        "top_p": (["top_p"], lambda v: _num_invalid(v, 0, 1),
                  [("float:1.0001", 1.0001), ("float:1e-30", 1e-30), ("float:0.0", 0.0)]),
        "top_k": (["top_k"], lambda v: _num_invalid(v, -1, None, True), [("int:-2", -2), ("int:vocab", vocab),
                                                                           ("int:vocab+1", vocab + 1)]),
        "seed": (["seed"], lambda v: _num_invalid(v, -2**63, 2**64 - 1, True), [("float:1.5", 1.5)]),
        "n": (["n"], lambda v: _num_invalid(v, 1, 128, True), [("int:2", 2), ("int:16", 16), ("int:17", 17),
                                                                ("int:128", 128), ("int:129", 129)]),
        "stop": (["stop"], lambda v: None if v is MISSING or v is None or isinstance(v, str) or (
            isinstance(v, list) and len(v) <= 4 and all(isinstance(s, str) for s in v)) else True,
                 [("list:4", ["a", "b", "c", "d"]), ("list:5", ["a", "b", "c", "d", "e"]), ("list:['']", [""]),
                  ("list:[1MiB]", [BIG_STR]), ("list:[null]", [None])]),
        "logit_bias": (["logit_bias"], lambda v: None if v is MISSING or v is None else True if not isinstance(v, dict)
                       else None,
                       [("obj:{0:100}", {"0": 100}), ("obj:{0:101}", {"0": 101}), ("obj:{0:-100}", {"0": -100}),
                        ("obj:{-1:1}", {"-1": 1}), ("obj:{vocab:1}", {str(vocab): 1}), ("obj:{2**63:1}", {str(2**63): 1}),
                        ("obj:{abc:1}", {"abc": 1}), ("obj:{1.5:1}", {"1.5": 1}), ("obj:{' 1':1}", {" 1": 1}),
                        ("obj:{0:NaN}", {"0": math.nan}), ("obj:{0:'x'}", {"0": "x"}), ("obj:{0:null}", {"0": None}),
                        ("obj:{0:inf}", {"0": math.inf}), ("obj:1e5 keys", {str(i): 1 for i in range(100_000)}),
                        ("obj:{arabic-digit:1}", {"\u0661": 1}), ("obj:{'+5':1}", {"+5": 1}),
                        ("obj:{'1_000':1}", {"1_000": 1}), ("obj:{5:1,'05':1}", {"5": 1, "05": 1})]),
        "presence_penalty": (["presence_penalty"], lambda v: _num_invalid(v, -2, 2), [("float:2.01", 2.01)]),
        "frequency_penalty": (["frequency_penalty"], lambda v: _num_invalid(v, -2, 2), [("float:-2.01", -2.01)]),
        "repetition_penalty": (["repetition_penalty"], lambda v: _num_invalid(v, 0, None) or (
            True if isinstance(v, (int, float)) and not isinstance(v, bool) and v <= 0 else None), []),
        "min_tokens": (["min_tokens"], lambda v: _num_invalid(v, 0, None, True), [("int:3", 3)]),
        "stream": (["stream"], _bool_invalid, [("str:true", "true"), ("int:1", 1)]),
        "stream_options": (["stream_options"], lambda v: None if v is MISSING or v is None or isinstance(v, dict) else True,
                           [("obj:include_usage", {"include_usage": True}), ("obj:include_usage:'yes'",
                                                                              {"include_usage": "yes"}),
                            ("obj:unknown", {"bogus": 1}),
                            ("obj:continuous_usage_stats", {"include_usage": True, "continuous_usage_stats": True})]),
        "response_format": (["response_format"], lambda v: None if v is MISSING or v is None or isinstance(v, dict) else True,
                            [("obj:text", {"type": "text"}), ("obj:json_object", {"type": "json_object"}),
                             ("obj:json_schema", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
                             ("obj:foo", {"type": "foo"}), ("obj:no type", {"x": 1})]),
        "tools": (["tools"], lambda v: None, [("list:function", [{"type": "function", "function": {"name": "f"}}]),
                                              ("list:[{}]", [{}])]),
        "tool_choice": (["tool_choice"], lambda v: None, [("str:none", "none"), ("str:auto", "auto"),
                                                          ("str:required", "required")]),
        # completions: [0, 20] as documented in docs/SERVING.md (vLLM's max_logprobs; OpenAI allows 5)
        "logprobs": (["logprobs"], _bool_invalid if chat else (lambda v: _num_invalid(v, 0, 20, True)),
                     [("int:5", 5), ("int:20", 20), ("int:21", 21)] if not chat else []),
        "stop_token_ids": (["stop_token_ids"], lambda v: None, [("list:[-1]", [-1]), ("list:[vocab]", [vocab]),
                                                                ("list:65", list(range(65)))]),
        "ignore_eos": (["ignore_eos"], _bool_invalid, []),
        "best_of": (["best_of"], lambda v: _num_invalid(v, 1, None, True), [("int:2", 2)]),
        "user": (["user"], lambda v: None, []),
        "unknown_field": (["bogus_field"], lambda v: True if v is not MISSING else None, []),
    }
    if chat:
        f.update({
            "messages": (["messages"], lambda v: True if v is MISSING or not isinstance(v, list) or not v else None,
                         [("list:1e5 msgs", [{"role": "user", "content": "hi"}] * 100_000),
                          ("list:[{role:tool}]", [{"role": "tool", "content": "x", "tool_call_id": "1"}]),
                          ("list:[{role:bogus}]", [{"role": "bogus", "content": "x"}]),
                          ("list:[{content:null}]", [{"role": "user", "content": None}]),
                          ("list:[{role only}]", [{"role": "user"}]),
                          ("list:[image part]", [{"role": "user", "content": [{"type": "image_url",
                                                                                "image_url": {"url": "http://x"}}]}]),
                          ("list:[text part]", [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]),
                          ("list:[text part 1e5]", [{"role": "user", "content": [{"type": "text", "text": "a"}] * 100_000}]),
                          ("list:[assistant last]", [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]),
                          ("list:[system only]", [{"role": "system", "content": "hi"}]),
                          ("list:[content 1MiB]", [{"role": "user", "content": BIG_STR}]),
                          ("list:[content blank]", [{"role": "user", "content": "   "}])]),
            "messages[0].role": (["messages", 0, "role"], _str_invalid, []),
            "messages[0].content": (["messages", 0, "content"], lambda v: True if v is MISSING or v is None or not isinstance(v, (str, list)) else None, []),
            "messages[0].name": (["messages", 0, "name"], lambda v: None, []),
            "max_completion_tokens": (["max_completion_tokens"], lambda v: _num_invalid(v, 1, None, True), []),
            "top_logprobs": (["top_logprobs"], lambda v: _num_invalid(v, 0, 20, True),
                             [("int:20", 20), ("int:21", 21)]),
        })
    else:
        f.update({
            "prompt": (["prompt"], lambda v: True if v is MISSING or v in ("", [], None) else None,
                       [("list:token ids", [1, 2, 3]), ("list:[-1]", [-1]), ("list:[vocab]", [vocab]),
                        ("list:[2**63]", [2**63]), ("list:[[1],[2]]", [[1], [2]]), ("list:65 prompts", ["a"] * 65),
                        ("list:[[]]", [[]]), ("list:['a', 1]", ["a", 1]), ("list:[true]", [True]),
                        ("list:[1.5]", [1.5]), ("list:1e5 ids", [1] * 100_000)]),
            "echo": (["echo"], _bool_invalid, []),
            "suffix": (["suffix"], lambda v: None, []),
        })
    return f


def ws_generate_fields(vocab: int, max_len: int) -> dict:
    """Generate's fields (protocol/messages.py) and the values certainly invalid for each."""
    def ids_invalid(v):
        if v is MISSING or not isinstance(v, list) or not v:
            return True
        return True if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in v) else None
    return {
        "request_id": (_str_invalid_required, [("str:256", "r" * 256), ("str:257", "r" * 257)]),
        "prompt_ids": (ids_invalid, [("list:[vocab]", [vocab]), ("list:[-1]", [-1]), ("list:[2**63]", [2**63]),
                                     ("list:max_len", [1] * max_len), ("list:[1.5]", [1.5])]),
        "max_new_tokens": (lambda v: True if v is MISSING else _num_invalid(v, 1, None, True, nullable=False),
                           [("int:max_len", max_len)]),
        "temperature": (lambda v: _num_invalid(v, 0, None), [("float:2.0", 2.0), ("float:5e-324", 5e-324)]),
        "top_p": (lambda v: _num_invalid(v, 0, 1), [("float:1.0001", 1.0001)]),
        "top_k": (lambda v: _num_invalid(v, -1, None, True), [("int:vocab+1", vocab + 1)]),  # -1 and 0: off
        "seed": (lambda v: _num_invalid(v, -2**63, 2**64 - 1, True), []),
        "cloud_budget": (lambda v: _num_invalid(v, 0, None, True), []),
        "refine": (lambda v: _num_invalid(v, 1e-12, 1), [("float:1.0", 1.0), ("float:1e-9", 1e-9)]),
        "stop_ids": (lambda v: None if v is MISSING else True if not isinstance(v, list) else None,
                     [("list:[vocab]", [vocab]), ("list:[-1]", [-1])]),
        "presence_penalty": (lambda v: _num_invalid(v), []),
        "frequency_penalty": (lambda v: _num_invalid(v), []),
        "repetition_penalty": (lambda v: _num_invalid(v, 0, 2) or (True if v == 0 else None), []),  # (0, 2]
        "min_tokens": (lambda v: _num_invalid(v, 0, None, True), [("int:3", 3)]),
        "kv_from": (lambda v: _num_invalid(v, 0, 1, True), [("int:1", 1), ("int:2", 2)]),
        # the base frame has no kv_from: kv_rate and a non-default kv_wire are refused without one
        "kv_wire": (lambda v: None if v is MISSING or v == "float16" else True,
                    [("str:float16", "float16"), ("str:int8", "int8"), ("str:int4", "int4")]),
        "kv_rate": (lambda v: None if v is MISSING or v is None else True, [("float:1e6", 1e6)]),
        "logit_bias": (lambda v: _bias_pairs_invalid(v, vocab),
                       [("pairs:[[5,100]]", [[5, 100.0]]), ("pairs:repeated id", [[5, 100.0], [5, 100.0]]),
                        ("pairs:[[vocab,1]]", [[vocab, 1.0]]), ("pairs:[[0,101]]", [[0, 101.0]]),
                        ("pairs:[[0,nan]]", [[0, math.nan]]), ("pairs:[[-1,1]]", [[-1, 1.0]]),
                        ("pairs:301", [[i, 1.0] for i in range(301)])]),
        "unknown_field": (lambda v: None, []),
    }


def _bias_pairs_invalid(v: Any, vocab: int) -> bool | None:
    """Generate.logit_bias: [token id, bias] pairs, ids in [0, vocab) each once, biases in [-100, 100]."""
    if v is MISSING:
        return None
    if not isinstance(v, list) or len(v) > 300 or not all(isinstance(e, list) and len(e) == 2 for e in v):
        return True
    ids = [e[0] for e in v]
    if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in ids) or len(set(ids)) < len(ids):
        return True
    return True if any(_num_invalid(b, -100, 100) for _, b in v) else None


def _str_invalid_required(v: Any) -> bool | None:
    return True if v is MISSING or not isinstance(v, str) else None


def _int_list_invalid(lo: int | None, hi: int | None, nonempty: bool = True):
    def f(v):
        if v is MISSING or not isinstance(v, list) or (nonempty and not v):
            return True
        if any(not isinstance(t, int) or isinstance(t, bool) for t in v):
            return True
        if any((lo is not None and t < lo) or (hi is not None and t > hi) for t in v):
            return True
        return None
    return f


def _int_required(lo=None, hi=None):
    return lambda v: True if v is MISSING or v is None else _num_invalid(v, lo, hi, True, nullable=False)


# --- servers ----------------------------------------------------------------------------------------

def rss_mib(pid: int) -> float | None:
    """VmRSS of process `pid` in MiB (None if gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024.0, 1)
    except (OSError, ValueError, IndexError):
        return None
    return None


def tree_rss_mib(pid: int) -> float | None:
    """RSS of `pid` plus its descendants (MiB): a P/D server's Ray workers are its children."""
    total, seen, todo = 0.0, set(), [pid]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        r = rss_mib(p)
        if r is not None:
            total += r
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in Path(f"/proc/{p}/task/{t}/children").read_text().split()]
        except OSError:
            pass
    return round(total, 1) if seen else None


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


class Server:
    """One server subprocess on 127.0.0.1 (own process group; stderr + stdout in a temp file).
    `start()` waits at most `start_timeout_s` for its ready line and fills `ws_url`, `http_url`,
    `fingerprint`, `token`."""

    def __init__(self, kind: str, start_timeout_s: float = 300.0, duration_s: float = 3600.0) -> None:
        self.kind, self.start_timeout_s = kind, start_timeout_s
        self.token = secrets.token_hex(16) if kind != "relay" else None
        exe = Path(sys.executable).with_name("relayinfer")
        base = [str(exe)] if exe.is_file() else [sys.executable, "-m", "relayinfer.sdk.cli"]
        dur = ["--duration-s", str(int(duration_s))]
        if kind == "cloud":
            self.argv = base + ["cloud", "serve", "--host", "127.0.0.1", "--port", "0", "--http-port", "0",
                                "--threads", "1", "--kv-cache-mb", "16", "--max-sessions", "32",
                                "--max-queued-tokens", "4096", *dur]
        elif kind == "pd":
            self.argv = base + ["pd", "serve", "--host", "127.0.0.1", "--port", "0", "--http-port", "0",
                                "--threads", "1", "--kv-cache-mb", "16", "--actor-cpus", "0", "--no-export", *dur]
        elif kind == "relay":
            self.argv = base + ["relay", "serve", "--port", "0"]
            # when the CLI cannot start (see run_server): the same server, its latency model in a temp file
            self.fallback_argv = [sys.executable, "-m", "relayinfer.cloud.relay.server", "--port", "0", "--threads", "1",
                                  "--lifetime-s", str(int(duration_s)), "--latency",
                                  os.path.join(tempfile.mkdtemp(prefix="hostile-relay-"), "latency.json")]
        elif kind == "patho":
            self.argv = base + ["patho", "serve", "--host", "127.0.0.1", "--port", "0", "--arch", "vit-tiny-test",
                                "--threads", "1", "--batch-size", "4", "--max-tiles-per-slide", "64", *dur]
        else:
            raise ValueError(f"unknown server {kind!r}; choose from {', '.join(SERVERS)}")
        self.proc: subprocess.Popen | None = None
        self.ws_url = self.http_url = None
        self.fingerprint = ""
        self.log = tempfile.NamedTemporaryFile("w+b", prefix=f"hostile-{kind}-", suffix=".log", delete=False)
        self.raytmp = tempfile.mkdtemp(prefix="rh-", dir="/tmp") if kind == "pd" else None

    @property
    def command(self) -> str:
        if "-m" in self.argv:
            return "python " + " ".join(self.argv[1:])
        i = self.argv.index(self.kind) if self.kind in self.argv else 0
        return "relayinfer " + " ".join(self.argv[i:])

    def output(self) -> str:
        try:
            return Path(self.log.name).read_text(errors="replace")
        except OSError:
            return ""

    def start(self) -> None:
        """Start and wait for the ready line. Raises RuntimeError (exited) / TimeoutError."""
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        if self.token:
            env["RELAYINFER_TOKEN"] = self.token
        if self.raytmp:
            env["RAY_TMPDIR"] = self.raytmp
            env.pop("RAY_ADDRESS", None)
        self.log.flush()
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=self.log, env=env, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        t_end = time.monotonic() + self.start_timeout_s
        offset = len(self.output())  # a restart: only this process's ready line counts
        while time.monotonic() < t_end:
            out = self.output()[offset:]
            if self._ready(out):
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.command} exited with {self.proc.returncode}: {out[-2000:]}")
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"{self.command} not ready within {self.start_timeout_s} s: {self.output()[-2000:]}")

    def _ready(self, out: str) -> bool:
        if self.kind in ("cloud", "pd"):
            m = re.search(r"(?:cloud|P/D) service: (ws://\S+)\s+(http://\S+)", out)
            if m:
                self.ws_url, self.http_url = m.group(1), m.group(2)
                return True
        elif self.kind == "relay":
            m = re.search(r"^READY (\d+) ([0-9a-f]+)", out, re.M)
            if m:
                self.ws_url, self.http_url = f"ws://127.0.0.1:{m.group(1)}", f"http://127.0.0.1:{m.group(1)}"
                self.fingerprint = m.group(2)
                return True
        else:
            m = re.search(r"patho service: (ws://\S+)", out)
            if m:
                from relayinfer.protocol.patho import patho_fingerprint

                self.ws_url, self.fingerprint = m.group(1), patho_fingerprint()
                return True
        return False

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGINT to the process, SIGKILL to its group after `timeout_s`. The exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:  # Ray workers and anything else the server left in its group
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        return self.proc.returncode

    def cleanup(self) -> None:
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)
        if self.raytmp:
            subprocess.run(["rm", "-rf", self.raytmp], check=False)


def tracebacks(text: str) -> list[str]:
    """The last line of each traceback (and ERROR records) in a server log, grouped with counts."""
    lines = text.splitlines()
    found = []
    for i, line in enumerate(lines):
        if line.startswith("Traceback"):
            j = i + 1
            while j < len(lines) and (lines[j].startswith((" ", "Traceback")) or not lines[j].strip()):
                j += 1
            found.append(lines[j][:300] if j < len(lines) else line)
        elif " ERROR " in line or line.startswith(("ERROR", "error:", "critical:")):
            found.append(re.sub(r"\b[0-9a-f]{8,}\b|\d+", "N", line)[:300])
    return [f"{n} x {t}" for t, n in Counter(found).most_common(30)]


# --- generator --------------------------------------------------------------------------------------

class Generator:
    """The deterministic input sequence of one server: the field-by-value grid, then seeded random
    picks. `case(i)` is input i."""

    def __init__(self, kind: str, seed: int, vocab: int = 49152, max_len: int = 256) -> None:
        self.kind, self.seed, self.vocab, self.max_len = kind, seed, vocab, max_len
        self.makers: list = []  # (field, label, make(index) -> Case)
        if kind in ("cloud", "pd"):
            self._openai(True)
            self._openai(False)
            self._http_bodies()
            self._generate()
            self._cloud_others()
        elif kind == "relay":
            self._relay()
        else:
            self._patho()
        self._frames()
        self._hellos()
        rng = random.Random(f"{kind}:{seed}")
        rng.shuffle(self.makers)  # the grid in a seeded order: a short run still reaches every door
        self.grid = len(self.makers)

    def case(self, i: int) -> Case:
        if i < self.grid:
            make = self.makers[i][2]
        else:
            make = random.Random(f"{self.kind}:{self.seed}:{i}").choice(self.makers)[2]
        return make(i)

    # HTTP
    def _openai(self, chat: bool) -> None:
        path = "/v1/chat/completions" if chat else "/v1/completions"
        base = ({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
                if chat else {"prompt": "Hi", "max_tokens": 2, "temperature": 0})
        for name, (fpath, invalid, specials) in openai_fields(chat, self.vocab, self.max_len).items():
            for label, value in generic_values("json") + specials:
                if name == "unknown_field" and value is MISSING:
                    continue

                def make(i, fpath=fpath, value=value, label=label, name=name, invalid=invalid):
                    try:
                        body = _set(base, fpath, value)
                    except (KeyError, IndexError, TypeError):
                        body = dict(base)
                    inv = invalid(value)
                    if isinstance(value, str) and SURROGATE in value:
                        inv = True
                    return Case(i, "http", path, name, label, body=body, invalid=inv)
                self.makers.append((name, label, make))

    def _http_bodies(self) -> None:
        for path in ("/v1/chat/completions", "/v1/completions"):
            raws = [("json:truncated", b'{"messages": [{"role": "user", "content": "Hi"'), ("json:empty", b""),
                    ("json:array", b"[1, 2]"), ("json:string", b'"hi"'), ("json:null", b"null"),
                    ("json:number", b"1e999"), ("json:deep 1e5", b"[" * 100_000 + b"]" * 100_000),
                    ("json:deep obj 1e4", b'{"a":' * 10_000 + b"1" + b"}" * 10_000),
                    ("json:not utf8", b'{"prompt": "\xff\xfe", "max_tokens": 2}'),
                    ("json:dup keys", b'{"max_tokens": 2, "max_tokens": -5, "prompt": "Hi", '
                                      b'"messages": [{"role": "user", "content": "Hi"}]}'),
                    ("json:2 MiB", b'{"prompt": "' + b"A" * (2 << 20) + b'", "max_tokens": 2}'),
                    ("json:bom", b'\xef\xbb\xbf{"prompt": "Hi", "max_tokens": 2}'),
                    ("json:trailing garbage", b'{"prompt": "Hi", "max_tokens": 2} xyz')]
            for label, raw in raws:
                self.makers.append(("<body>", label, lambda i, p=path, r=raw, lab=label: Case(
                    i, "http", p, "<body>", lab, raw=r, invalid=True)))
            for label, hdr in [("content-type:text/plain", {"Content-Type": "text/plain"}),
                               ("content-type:form", {"Content-Type": "application/x-www-form-urlencoded"}),
                               ("auth:none", {"Authorization": None}), ("auth:wrong", {"Authorization": "Bearer x"}),
                               ("auth:1MiB", {"Authorization": "Bearer " + "x" * 60_000})]:
                body = {"prompt": "Hi", "max_tokens": 2} if path.endswith("/completions") and "chat" not in path \
                    else {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
                self.makers.append(("<headers>", label, lambda i, p=path, h=hdr, b=body, lab=label: Case(
                    i, "http", p, "<headers>", lab, body=b, headers=h,
                    invalid=True if lab.startswith("auth") else None)))

    # websocket: Generate / Stop / Cancel / ExtendBudget / KVTransfer / others to the cloud
    def _generate(self) -> None:
        def base(rid):
            return {"type": "generate", "request_id": rid, "prompt_ids": [1, 2, 3], "max_new_tokens": 2}
        for name, (invalid, specials) in ws_generate_fields(self.vocab, self.max_len).items():
            for label, value in generic_values("msgpack") + specials:
                if name == "unknown_field" and value is MISSING:
                    continue

                def make(i, name=name, value=value, label=label, invalid=invalid):
                    rid = f"g{i}"
                    key = "bogus_field" if name == "unknown_field" else name
                    frame = _set(base(rid), [key], value)
                    inv = _ws_invalid(name, value, invalid(value))
                    return Case(i, "ws", "generate", name, label, body=frame, invalid=inv, expect="done")
                self.makers.append((f"generate.{name}", label, make))

    def _cloud_others(self) -> None:
        short = [("int:-1", -1), ("int:0", 0), ("int:2**63-1", 2**63 - 1), ("int:2**64-1", 2**64 - 1),
                 ("int:-2**63", -2**63), ("float:nan", math.nan), ("str:x", "x"), ("null", None), ("missing", MISSING),
                 ("list:empty", []), ("bool:true", True), ("str:1MiB", BIG_STR)]
        specs = {"stop": {"handoff_index": 1}, "cancel": {}, "extend_budget": {"cloud_budget": 1}}
        for typ, extra in specs.items():
            for fname in ["request_id", *extra]:
                for label, value in short + [("str:other id", "other")]:
                    def make(i, typ=typ, fname=fname, value=value, label=label, extra=extra):
                        rid = f"s{i}"
                        pre = {"type": "generate", "request_id": rid, "prompt_ids": [1, 2, 3], "max_new_tokens": 6}
                        frame = _set({"type": typ, "request_id": rid, **extra}, [fname], value)
                        inv = None
                        if fname != "request_id" and value is not MISSING and (
                                isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1 << 20):
                            inv = True
                        return Case(i, "ws", typ, f"{typ}.{fname}", label, body=frame, pre=pre, invalid=inv,
                                    expect="done")
                    self.makers.append((f"{typ}.{fname}", label, make))
        kv = {"type": "kv_transfer", "request_id": "k", "layer_start": 0, "num_tokens": 1,
              "kv": {"dtype": "float16", "shape": [1, 2, 1, 1, 2], "data": b"\x00" * 8}}
        for fname in ("request_id", "layer_start", "num_tokens", "kv", "block_index", "num_blocks", "token_start"):
            for label, value in short + [("tensor:bad dtype", {"dtype": "complex", "shape": [1], "data": b"\x00"}),
                                         ("tensor:shape 2**63", {"dtype": "uint8", "shape": [2**63 - 1], "data": b""})]:
                self.makers.append((f"kv_transfer.{fname}", label, lambda i, f=fname, v=value, lab=label: Case(
                    i, "ws", "kv_transfer", f"kv_transfer.{f}", lab, body=_set(kv, [f], v), invalid=True)))
        for typ, frame in [("token", {"type": "token", "request_id": "t", "token_id": 1, "index": 0, "t_cloud_ms": 0.0}),
                           ("done", {"type": "done", "request_id": "t", "reason": "eos", "cloud_tokens": 0,
                                     "prefill_ms": 0.0}),
                           ("welcome", {"type": "welcome", "protocol_version": 1, "model_fingerprint": "x"}),
                           ("hello", {"type": "hello", "protocol_version": 1, "model_fingerprint": "x"}),
                           ("error", {"type": "error", "code": "internal", "message": "x", "request_id": "t"}),
                           ("error-conn", {"type": "error", "code": "bogus", "message": "x"}),
                           ("ping", {"type": "ping", "nonce": 2**64 - 1, "t_ms": math.nan}),
                           ("pong", {"type": "pong", "nonce": -1, "t_ms": math.inf}),
                           ("rank", {"type": "rank", "request_id": "t", "user_id": 1, "item_ids": [1], "timestamps": [1],
                                     "candidate_ids": [1]})]:
            self.makers.append((f"{typ}", "wrong message for this server", lambda i, t=typ, fr=frame: Case(
                i, "ws", t, f"{t}", "wrong message for this server", body=fr, invalid=True)))

    def _relay(self) -> None:
        base = {"type": "rank", "request_id": "r", "user_id": 1, "item_ids": [1, 2, 3, 4, 5],
                "timestamps": [1000, 2000, 3000, 4000, 5000], "candidate_ids": [10, 11, 12]}
        n = 1682  # ML-100K items
        checks = {"request_id": _str_invalid_required, "user_id": _int_required(-2**63, 2**63 - 1),
                  "item_ids": _int_list_invalid(1, n), "timestamps": _int_list_invalid(-2**63, 2**63 - 1),
                  "candidate_ids": _int_list_invalid(1, n), "request_ts": lambda v: _num_invalid(v, -2**63, 2**63 - 1, True),
                  "unknown_field": lambda v: None}
        specials = {"item_ids": [("list:[n+1]*5", [n + 1] * 5), ("list:[0]*5", [0] * 5), ("list:16385", [1] * 16385),
                                 ("list:4 of 5", [1, 2, 3, 4])],
                    "timestamps": [("list:decreasing", [5, 4, 3, 2, 1]), ("list:[2**63-1]*5", [2**63 - 1] * 5),
                                   ("list:[-2**63]*5", [-2**63] * 5), ("list:6 of 5", [1, 2, 3, 4, 5, 6])],
                    "candidate_ids": [("list:4097", [1] * 4097), ("list:[n]", [n]), ("list:[n+1]", [n + 1])],
                    "request_ts": [("int:0", 0), ("int:-1", -1)]}
        for msg_type in ("rank", "pre_infer"):
            for name, invalid in checks.items():
                if msg_type == "pre_infer" and name in ("candidate_ids", "request_ts"):
                    continue
                for label, value in generic_values("msgpack") + specials.get(name, []):
                    if name == "unknown_field" and value is MISSING:
                        continue

                    def make(i, name=name, value=value, label=label, invalid=invalid, t=msg_type):
                        frame = dict(base, request_id=f"r{i}", type=t)
                        if t == "pre_infer":
                            frame.pop("candidate_ids")
                        frame = _set(frame, ["bogus_field" if name == "unknown_field" else name], value)
                        inv = _ws_invalid(name, value, invalid(value))
                        return Case(i, "ws", t, f"{t}.{name}", label, body=frame, invalid=inv,
                                    expect="scores" if t == "rank" else "")
                    self.makers.append((f"{msg_type}.{name}", label, make))
        for typ, frame in [("generate", {"type": "generate", "request_id": "g", "prompt_ids": [1], "max_new_tokens": 1}),
                           ("tile_batch", {"type": "tile_batch", "request_id": "t", "slide_id": "s", "coords": [],
                                           "tiles": {"dtype": "uint8", "shape": [0], "data": b""}}),
                           ("cancel-no-id", {"type": "ping", "nonce": 1, "t_ms": 0.0}),
                           ("error-conn", {"type": "error", "code": "bogus", "message": "x"})]:
            self.makers.append((typ, "wrong message for this server", lambda i, t=typ, fr=frame: Case(
                i, "ws", t, t, "wrong message for this server", body=fr, invalid=None if t == "cancel-no-id" else True)))

    def _patho(self) -> None:
        feats = {"dtype": "float32", "shape": [1, 1280], "data": b"\x00\x00\x80\x3f" * 1280}
        empty = {"dtype": "uint8", "shape": [0, 224, 224, 3], "data": b""}
        base = {"type": "tile_batch", "request_id": "p", "slide_id": "s", "coords": [[0, 0]], "tiles": empty,
                "features": feats, "last": True}
        pix = dict(base, tiles={"dtype": "uint8", "shape": [1, 224, 224, 3], "data": b"\x80" * (224 * 224 * 3)})
        pix.pop("features")
        tensor_vals = [
            ("tensor:dtype complex", {"dtype": "complex64", "shape": [1], "data": b"\x00" * 8}),
            ("tensor:shape [-1]", {"dtype": "uint8", "shape": [-1], "data": b""}),
            ("tensor:shape [2**63-1]", {"dtype": "uint8", "shape": [2**63 - 1], "data": b""}),
            ("tensor:shape [2**64-1]", {"dtype": "uint8", "shape": [2**64 - 1], "data": b""}),
            ("tensor:shape [0, 2**63-1]", {"dtype": "uint8", "shape": [0, 2**63 - 1], "data": b""}),
            ("tensor:33 dims", {"dtype": "uint8", "shape": [1] * 33, "data": b"\x00"}),
            ("tensor:data short", {"dtype": "float32", "shape": [1, 1280], "data": b"\x00" * 10}),
            ("tensor:float16 feats", {"dtype": "float16", "shape": [1, 1280], "data": b"\x00\x3c" * 1280}),
            ("tensor:nan feats", {"dtype": "float32", "shape": [1, 1280], "data": b"\x00\x00\xc0\x7f" * 1280}),
            ("tensor:inf feats", {"dtype": "float32", "shape": [1, 1280], "data": b"\x00\x00\x80\x7f" * 1280}),
            ("tensor:int64 feats", {"dtype": "int64", "shape": [1, 1280], "data": b"\x00" * 8 * 1280}),
            ("tensor:[2,1280] for 1 coord", {"dtype": "float32", "shape": [2, 1280], "data": b"\x00" * 8 * 1280}),
            ("tensor:bool bad bytes", {"dtype": "bool", "shape": [2], "data": b"\x02\x03"}),
            ("tensor:data as str", {"dtype": "uint8", "shape": [1], "data": "x"}),
            ("tensor:missing data", {"dtype": "uint8", "shape": [1]}),
            ("tensor:pixels 1x8x8x3", {"dtype": "uint8", "shape": [1, 8, 8, 3], "data": b"\x00" * 192}),
            ("tensor:pixels float32", {"dtype": "float32", "shape": [1, 224, 224, 3], "data": b"\x00" * (4 * 150528)}),
        ]
        checks = {"request_id": _str_invalid_required, "slide_id": _str_invalid_required,
                  "coords": lambda v: True if v is MISSING or not isinstance(v, list) or (
                      isinstance(v, list) and v and not all(isinstance(c, list) and len(c) == 2 for c in v)) else None,
                  "tiles": lambda v: True if v is MISSING or not isinstance(v, dict) else None,
                  "jpeg": lambda v: True if v is not MISSING and v != [] else None,
                  "features": lambda v: None if v is MISSING or v is None else True if not isinstance(v, dict) else None,
                  "device_scores": lambda v: None if v is MISSING or v == [] else True if not isinstance(v, list) else None,
                  "last": _bool_invalid, "unknown_field": lambda v: None}
        specials = {"coords": [("list:[[0,0]]*2", [[0, 0]] * 2), ("list:[[0]]", [[0]]), ("list:[[0,0,0]]", [[0, 0, 0]]),
                               ("list:[[2**63,-2**63]]", [[2**63 - 1, -2**63]]), ("list:[[1.5,0]]", [[1.5, 0]]),
                               ("list:1e5 coords", [[0, 0]] * 100_000)],
                    "jpeg": [("list:[b'']", [b""]), ("list:[garbage]", [b"\xff\xd8\xff" + b"\x00" * 100]),
                             ("list:[1MiB]", [b"\xff" * (1 << 20)]), ("list:[str]", ["x"])],
                    "device_scores": [("list:[nan]", [math.nan]), ("list:1e5", [0.5] * 100_000)],
                    "features": tensor_vals, "tiles": tensor_vals}
        for name, invalid in checks.items():
            for label, value in generic_values("msgpack") + specials.get(name, []):
                if name == "unknown_field" and value is MISSING:
                    continue
                use = pix if name == "tiles" else base

                def make(i, name=name, value=value, label=label, invalid=invalid, use=use):
                    frame = dict(use, request_id=f"p{i}")
                    frame = _set(frame, ["bogus_field" if name == "unknown_field" else name], value) if not isinstance(
                        value, (bytes,)) else frame
                    inv = _ws_invalid(name, value, invalid(value))
                    return Case(i, "ws", "tile_batch", f"tile_batch.{name}", label, body=frame, invalid=inv,
                                expect="embeddings")
                self.makers.append((f"tile_batch.{name}", label, make))
        for typ, frame in [("generate", {"type": "generate", "request_id": "g", "prompt_ids": [1], "max_new_tokens": 1}),
                           ("rank", {"type": "rank", "request_id": "t", "user_id": 1, "item_ids": [1], "timestamps": [1],
                                     "candidate_ids": [1]}),
                           ("error-conn", {"type": "error", "code": "bogus", "message": "x"})]:
            self.makers.append((typ, "wrong message for this server", lambda i, t=typ, fr=frame: Case(
                i, "ws", t, t, "wrong message for this server", body=fr, invalid=True)))

    # malformed frames and handshakes (every websocket server)
    def _frames(self) -> None:
        good = _frame({"type": "cancel", "request_id": "x"})
        big = 64 << 20 if self.kind == "patho" else 4 << 20
        raws = [("frame:empty", b""), ("frame:truncated", good[:-3]), ("frame:trailing bytes", good + b"\xc0"),
                ("frame:not a map", b"\x93\x01\x02\x03"), ("frame:no type", _frame({"request_id": "x"})),
                ("frame:type int", _frame({"type": 7, "request_id": "x"})),
                ("frame:unknown type", _frame({"type": "bogus", "request_id": "x"})),
                ("frame:type 1MiB", _frame({"type": BIG_STR})),
                ("frame:invalid utf8 key", b"\x82\xa4type\xa6cancel\xa3\xed\xa0\x80\xa1x"),
                ("frame:deep nesting", b"\x82\xa4type\xa6cancel\xaarequest_id" + b"\x91" * 5000 + b"\xc0"),
                ("frame:str32 len 4GiB", b"\x82\xa4type\xa6cancel\xaarequest_id\xdb\xff\xff\xff\xff"),
                ("frame:array32 len 4G", b"\x82\xa4type\xa6cancel\xaarequest_id\xdd\xff\xff\xff\xff"),
                ("frame:random 1KiB", random.Random(f"{self.kind}:garbage").randbytes(1024)),
                ("frame:text message", "hello"), ("frame:text json", '{"type": "cancel", "request_id": "x"}'),
                ("frame:over limit", b"\xc4" + b"\x00" * 16)]  # the payload is sized at send time
        for label, raw in raws:
            self.makers.append(("<frame>", label, lambda i, r=raw, lab=label: Case(
                i, "ws", "<frame>", "<frame>", lab, raw=r if lab != "frame:over limit" else b"\x00" * (big + 1024),
                invalid=True)))

    def _hellos(self) -> None:
        vals = [("protocol_version:0", {"protocol_version": 0}), ("protocol_version:2**64-1", {"protocol_version": 2**64 - 1}),
                ("protocol_version:-2**63", {"protocol_version": -2**63}), ("protocol_version:str", {"protocol_version": "1"}),
                ("model_fingerprint:wrong", {"model_fingerprint": "0" * 64}),
                ("model_fingerprint:3KiB", {"model_fingerprint": "f" * 3000}),
                ("model_fingerprint:int", {"model_fingerprint": 1}), ("token:wrong", {"token": "nope"}),
                ("token:int", {"token": 5}), ("token:missing", {"token": MISSING}),
                ("token:3KiB", {"token": "t" * 3000}), ("client:list", {"client": [1, 2]}),
                ("hello:5KiB", {"client": "c" * 5000}), ("hello:unknown field", {"bogus": 1}),
                ("first frame:generate", {"type": "generate"}), ("hello:missing fingerprint", {"model_fingerprint": MISSING})]
        for label, change in vals:
            self.makers.append(("<hello>", label, lambda i, ch=change, lab=label: Case(
                i, "hello", "hello", "hello." + lab.split(":")[0], lab, body=ch,
                invalid=None if lab in ("hello:unknown field",) or (self.kind == "relay" and lab.startswith("token")) else True)))


def _frame(d: dict) -> bytes:
    """MessagePack of `d`; a value equal to the surrogate marker becomes a str with CESU-8 surrogate bytes."""
    data = msgspec.msgpack.encode(d)
    mark = msgspec.msgpack.encode(_SURR_MARK)
    return data.replace(mark, b"\xa3\xed\xa0\x80")


def _clean(d: Any) -> Any:
    """`d` without MISSING (used by _set already) -- kept for frames built by hand."""
    return d


# --- the run ----------------------------------------------------------------------------------------

@dataclass
class Tally:
    sent: int = 0
    statuses: Counter = field(default_factory=Counter)
    findings: list = field(default_factory=list)
    kinds: Counter = field(default_factory=Counter)
    seen: set = field(default_factory=set)
    fields: Counter = field(default_factory=Counter)

    def find(self, kind: str, case: Case | None, got: Any, note: str = "", max_per_key: int = 3) -> None:
        """Record a finding; at most `max_per_key` examples per (kind, field, door target) are kept (all are counted)."""
        key = (kind, case.target if case else "", case.field if case else "")
        self.kinds[kind] += 1
        n = sum(1 for f in self.findings if f["key"] == list(key))
        if n >= max_per_key:
            for f in self.findings:
                if f["key"] == list(key):
                    f["count"] += 1
                    break
            return
        self.findings.append({"key": list(key), "kind": kind, "severity": SEVERITY.get(kind, "medium"), "count": 1,
                              "note": note,
                              "input": case.repro() if case else None, "got": got})


class Runner:
    """Sends a server's cases and checks the answers (see the module docstring)."""

    def __init__(self, server: Server, gen: Generator, args) -> None:
        self.server, self.gen, self.args = server, gen, args
        self.tally = Tally()
        self.probe_failures = 0
        self.restarts = 0

    # -- HTTP --
    def _auth(self) -> dict:
        return {"Authorization": f"Bearer {self.server.token}"} if self.server.token else {}

    async def http_case(self, session, case: Case) -> None:
        import aiohttp

        headers = {"Content-Type": "application/json", **self._auth()}
        for k, v in case.headers.items():
            if v is None:
                headers.pop(k, None)
            else:
                headers[k] = v
        data = case.raw if case.raw is not None else json.dumps(case.body, allow_nan=True).encode("utf-8", "surrogatepass")
        t0 = time.monotonic()
        try:
            async with session.post(self.server.http_url + case.target, data=data, headers=headers,
                                    timeout=aiohttp.ClientTimeout(total=self.args.request_timeout_s)) as resp:
                status = resp.status
                text = await resp.text(errors="replace")
        except asyncio.TimeoutError:
            self.tally.statuses["timeout"] += 1
            self.tally.find("http_timeout", case, f"no complete answer within {self.args.request_timeout_s} s")
            return
        except aiohttp.ClientError as e:
            self.tally.statuses["connection_error"] += 1
            self.tally.find("http_connection_dropped", case, f"{type(e).__name__}: {e}")
            return
        self.tally.statuses[str(status)] += 1
        ms = round((time.monotonic() - t0) * 1e3)
        if status >= 500:
            self.tally.find("http_5xx", case, {"status": status, "body": text[:600], "ms": ms})
            return
        if 400 <= status < 500:
            try:
                err = json.loads(text).get("error") or {}
                msg = f"{err.get('message', '')} {err.get('param', '')}"
            except (ValueError, AttributeError):
                self.tally.find("http_4xx_not_json", case, {"status": status, "body": text[:300]})
                return
            fname = case.field.split(".")[-1].split("[")[0]
            if case.field not in ("<body>", "<headers>", "unknown_field") and fname not in msg \
                    and case.field.split("[")[0] not in msg and status != 413:
                self.tally.find("http_4xx_not_naming_field", case, {"status": status, "error": err})
            return
        if status == 200:
            if case.invalid:
                self.tally.find("http_invalid_accepted", case, {"status": status, "body": text[:400]})
            stream = isinstance(case.body, dict) and case.body.get("stream") is True
            if stream:
                if not text.rstrip().endswith("data: [DONE]"):
                    self.tally.find("http_stream_not_terminated", case, {"tail": text[-400:]})
            else:
                try:
                    out = json.loads(text)
                    if not out.get("choices"):
                        self.tally.find("http_200_without_choices", case, {"body": text[:400]})
                except ValueError:
                    self.tally.find("http_200_not_json", case, {"body": text[:400]})

    # -- websocket --
    async def open(self, token: str | None | _Missing = MISSING, hello: dict | None = None):
        from relayinfer.protocol.transport import ws as pws

        return await pws.open_channel(self.server.ws_url, self.server.fingerprint,
                                      self.server.token if token is MISSING else token,
                                      client="hostile", open_timeout=30.0)

    async def ws_case(self, holder: dict, case: Case) -> None:
        from websockets.exceptions import ConnectionClosed

        from relayinfer.protocol.errors import RelayInferError
        from relayinfer.protocol.messages import decode

        if case.door == "hello":
            return await self.hello_case(case)
        ch = holder.get("ch")
        if ch is None or ch.session.closed:
            try:
                ch = holder["ch"] = await self.open()
            except (RelayInferError, OSError, TimeoutError) as e:
                self.tally.statuses["ws_connect_failed"] += 1
                self.tally.find("ws_connect_failed", case, f"{type(e).__name__}: {e}")
                holder.pop("ch", None)
                return
        ws = ch.ws
        rid = case.body.get("request_id") if isinstance(case.body, dict) else None
        rid = rid if isinstance(rid, str) else None
        pre_rid = case.pre["request_id"] if case.pre else None
        nonce = random.getrandbits(62)
        payload = case.raw if case.raw is not None else _frame(case.body)
        try:
            if case.pre:
                await ws.send(_frame(case.pre))
            await ws.send(payload)
            await ws.send(_frame({"type": "ping", "nonce": nonce, "t_ms": 0.0}))
        except ConnectionClosed as e:
            holder.pop("ch", None)
            self.tally.statuses["ws_closed_on_send"] += 1
            code = f"{e.rcvd.code} {e.rcvd.reason}" if e.rcvd else ""
            over = _limit_1009(code)  # a frame above the server's websocket limit: 1009, as PROTOCOL.md says
            if case.raw is None and case.field != "<frame>" and not (over and len(payload) > over):
                self.tally.find("ws_closed_without_error", case, f"closed while sending: {e}")
            return
        got: list[dict] = []
        errors: list[dict] = []
        terminal = pong = False
        closed = None
        need = {case.expect} if case.expect else set()
        t_end = time.monotonic() + self.args.request_timeout_s
        while time.monotonic() < t_end:
            try:
                data = await asyncio.wait_for(ws.recv(), max(0.05, t_end - time.monotonic()))
            except asyncio.TimeoutError:
                break
            except ConnectionClosed as e:
                closed = f"{e.rcvd.code if e.rcvd else None} {e.rcvd.reason if e.rcvd else ''}".strip()
                break
            try:
                m = decode(data)
            except RelayInferError as e:
                got.append({"undecodable": str(e)[:200]})
                continue
            t = type(m).__name__
            if t == "Pong":
                pong = pong or m.nonce == nonce
            elif t == "Error":
                errors.append({"code": m.code, "message": m.message[:300], "request_id": m.request_id})
                if m.request_id is None or m.request_id in (rid, pre_rid):
                    terminal = True
            elif t in ("Done", "Scores", "Embeddings"):
                got.append({"type": t.lower(), "request_id": getattr(m, "request_id", None),
                            **({"reason": m.reason} if t == "Done" else {}),
                            **({"last": m.slide_score is not None} if t == "Embeddings" else {})})
                if m.request_id in (rid, pre_rid) or rid is None:
                    terminal = True
            elif t in ("Token", "KVTransfer", "RefinedPrompt"):
                continue
            if pong and (terminal or not need):
                break
        answer = {"errors": errors[:4], "results": got[:4], "closed": closed, "pong": pong}
        if errors:
            codes = {e["code"] for e in errors}
            self.tally.statuses["ws_error:" + "+".join(sorted(codes))] += 1
        elif got:
            self.tally.statuses["ws_result:" + got[0].get("type", "?")] += 1
        elif closed is not None:
            self.tally.statuses["ws_closed_" + closed.split(" ")[0]] += 1
        elif pong:
            self.tally.statuses["ws_no_answer_connection_alive"] += 1
        else:
            self.tally.statuses["ws_silence"] += 1
        if closed is not None:
            holder.pop("ch", None)
        well_framed = case.raw is None
        limit = _limit_1009(closed or "")
        if limit and not errors:  # websockets refused a frame above ws_max_size(limit) before reading it
            size = len(payload)
            if limit == HANDSHAKE_WS_LIMIT and size <= limit * 64:
                self.tally.find("ws_handshake_limit_after_welcome", case, {**answer, "frame_bytes": size},
                                note="a frame sent right after the Welcome was refused at the pre-handshake limit")
            elif size <= limit:
                self.tally.find("ws_closed_without_error", case, {**answer, "frame_bytes": size})
            return
        if closed is not None and not errors:
            if case.target == "error-conn":
                return  # a connection-level Error from the peer: the receiver closes, as the protocol says
            if well_framed or case.label not in ("frame:over limit",) or not closed.startswith("1009"):
                self.tally.find("ws_closed_without_error", case, answer)
            return
        if errors and any(e["code"] not in WS_CODES for e in errors):
            self.tally.find("ws_unknown_error_code", case, answer)
        if any(e["code"] == "internal" for e in errors):
            self.tally.find("ws_internal_error", case, answer)
        if closed is None and not pong and not terminal:
            self.tally.find("ws_no_answer", case, answer, note=f"no answer and no Pong within {self.args.request_timeout_s} s")
            holder.pop("ch", None)
            await _close_quietly(ws)
            return
        if need and not terminal and closed is None and not errors:
            self.tally.find("ws_no_result", case, answer, note=f"Pong came back but no {case.expect}/Error for the request")
        if well_framed and case.invalid and not errors and got:
            self.tally.find("ws_invalid_accepted", case, answer)
        if well_framed and errors and case.field not in ("<frame>",) and case.invalid is not False:
            fname = case.field.split(".")[-1]
            text = " ".join(e["message"] for e in errors)
            whole = re.search(r"unexpected \w+ from a|does not handle \w+", text)  # the message type itself is refused
            if case.label != "missing" and fname not in text and fname != "unknown_field" and not whole and \
                    not any(e["code"] in ("overloaded", "unknown_message") for e in errors) and \
                    case.field not in ("token", "done", "welcome", "hello", "error", "error-conn", "ping", "pong",
                                       "rank", "generate", "tile_batch", "cancel-no-id"):
                self.tally.find("ws_error_not_naming_field", case, answer)
        if not well_framed and not errors and case.field == "<frame>" and case.label != "frame:empty" and closed is None:
            self.tally.find("ws_malformed_frame_not_refused", case, answer)

    async def hello_case(self, case: Case) -> None:
        import websockets

        hello = {"type": "hello", "protocol_version": 1, "model_fingerprint": self.server.fingerprint,
                 "client": "hostile"}
        if self.server.token:
            hello["token"] = self.server.token
        for k, v in case.body.items():
            if k == "type":
                hello = {"type": v, "request_id": "x"}
                continue
            if v is MISSING:
                hello.pop(k, None)
            else:
                hello[k] = v
        answer: dict = {}
        try:
            async with websockets.connect(self.server.ws_url, open_timeout=30, max_size=2**26) as ws:
                await ws.send(_frame(hello))
                try:
                    data = await asyncio.wait_for(ws.recv(), self.args.request_timeout_s)
                    from relayinfer.protocol.messages import decode

                    m = decode(data)
                    answer = {"type": type(m).__name__, **({"code": m.code, "message": m.message[:200]}
                                                          if type(m).__name__ == "Error" else {})}
                except websockets.exceptions.ConnectionClosed as e:
                    answer = {"closed": f"{e.rcvd.code if e.rcvd else None} {e.rcvd.reason if e.rcvd else ''}"}
                except asyncio.TimeoutError:
                    answer = {"timeout": self.args.request_timeout_s}
        except (OSError, websockets.exceptions.WebSocketException, asyncio.TimeoutError) as e:
            answer = {"connect_failed": f"{type(e).__name__}: {e}"}
        self.tally.statuses["hello:" + (answer.get("code") or answer.get("type") or next(iter(answer), "?"))] += 1
        if "timeout" in answer or "connect_failed" in answer:
            self.tally.find("hello_no_answer", case, answer)
        elif "closed" in answer and not answer["closed"].startswith("1009"):
            self.tally.find("hello_closed_without_error", case, answer)
        elif answer.get("type") == "Welcome" and case.invalid:
            self.tally.find("hello_invalid_accepted", case, answer)
        elif answer.get("code") == "internal":
            self.tally.find("ws_internal_error", case, answer)

    # -- checks --
    async def probe(self, session) -> dict:
        """Process alive, /healthz 200 (cloud, pd), and one valid request answered."""
        out: dict = {"alive": alive(self.server.proc.pid)}
        if not out["alive"]:
            return out
        if self.server.kind in ("cloud", "pd"):
            try:
                async with session.get(self.server.http_url + "/healthz", headers=self._auth()) as r:
                    out["healthz"] = r.status
            except Exception as e:  # noqa: BLE001  a dead or hung server is the finding
                out["healthz"] = f"{type(e).__name__}: {e}"
        from relayinfer.protocol.messages import decode

        frame = {"cloud": {"type": "generate", "request_id": "probe", "prompt_ids": [1, 2, 3], "max_new_tokens": 2},
                 "pd": {"type": "generate", "request_id": "probe", "prompt_ids": [1, 2, 3], "max_new_tokens": 2},
                 "relay": {"type": "rank", "request_id": "probe", "user_id": 1, "item_ids": [1, 2, 3],
                           "timestamps": [1, 2, 3], "candidate_ids": [4, 5]},
                 "patho": {"type": "tile_batch", "request_id": "probe", "slide_id": "s", "coords": [[0, 0]],
                           "tiles": {"dtype": "uint8", "shape": [0, 224, 224, 3], "data": b""},
                           "features": {"dtype": "float32", "shape": [1, 1280], "data": b"\x00" * 5120},
                           "last": True}}[self.server.kind]
        want = {"cloud": "Done", "pd": "Done", "relay": "Scores", "patho": "Embeddings"}[self.server.kind]
        try:
            ch = await asyncio.wait_for(self.open(), 60)
            try:
                await ch.ws.send(_frame(frame))
                t_end = time.monotonic() + 60
                while time.monotonic() < t_end:
                    m = decode(await asyncio.wait_for(ch.ws.recv(), t_end - time.monotonic()))
                    if type(m).__name__ in (want, "Error"):
                        out["probe"] = type(m).__name__ + (f" {m.code}: {m.message[:200]}" if type(m).__name__ == "Error" else "")
                        break
                else:
                    out["probe"] = "timeout"
            finally:
                await _close_quietly(ch.ws)
        except Exception as e:  # noqa: BLE001
            out["probe"] = f"{type(e).__name__}: {e}"[:300]
        return out

    def healthy(self, p: dict) -> bool:
        return p.get("alive") and p.get("healthz", 200) == 200 and str(p.get("probe", "")).split(" ")[0] in (
            "Done", "Scores", "Embeddings")

    async def gauges(self, session) -> dict:
        """Gauge values that must return to 0 (cloud/pd: /metrics gauges; relay: /stats counters in flight)."""
        if self.server.kind in ("cloud", "pd"):
            try:
                async with session.get(self.server.http_url + "/metrics", headers=self._auth()) as r:
                    text = await r.text()
            except Exception as e:  # noqa: BLE001
                return {"error": f"{type(e).__name__}: {e}"}
            gauges = set(re.findall(r"^# TYPE (\S+) gauge$", text, re.M))
            out = {}
            for m in re.finditer(r"^(\w+)(\{[^}]*\})? (\S+)$", text, re.M):
                if m.group(1) in gauges and ZERO_GAUGE.search(m.group(1)) and "total" not in m.group(1) \
                        and not m.group(1).endswith("_created") \
                        and "limit" not in m.group(1) and "max" not in m.group(1):
                    out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
            return out
        if self.server.kind == "relay":
            try:
                async with session.get(self.server.http_url + "/stats") as r:
                    st = json.loads(await r.text())
            except Exception as e:  # noqa: BLE001
                return {"error": f"{type(e).__name__}: {e}"}
            return {k: v for k, v in st.items() if isinstance(v, (int, float)) and ZERO_GAUGE.search(k)
                    and "total" not in k}
        return {}

    async def run(self, n_inputs: int, wall_s: float) -> dict:
        import aiohttp

        t0 = time.monotonic()
        deadline = t0 + wall_s
        rss = {"ready": tree_rss_mib(self.server.proc.pid)}
        health_log = []
        sem = asyncio.Semaphore(self.args.concurrency)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.args.request_timeout_s)) as session:
            holders = [dict() for _ in range(self.args.concurrency)]
            i = self.args.start
            while i < self.args.start + n_inputs and time.monotonic() < deadline:
                batch = list(range(i, min(i + self.args.batch, self.args.start + n_inputs)))
                i = batch[-1] + 1
                free = list(holders)

                async def one(idx):
                    async with sem:
                        h = free.pop()
                        try:
                            if time.monotonic() >= deadline:
                                return
                            case = self.gen.case(idx)
                            self.tally.sent += 1
                            self.tally.fields[case.field] += 1
                            try:
                                if case.door == "http":
                                    await self.http_case(session, case)
                                else:
                                    await self.ws_case(h, case)
                            except Exception as e:  # noqa: BLE001  a driver bug: recorded, never silent
                                self.tally.statuses["driver_error"] += 1
                                self.tally.find("driver_error", case, f"{type(e).__name__}: {e}"[:400])
                        finally:
                            free.append(h)
                await asyncio.gather(*(one(k) for k in batch))
                p = await self.probe(session)
                if "rss_warm" not in rss:
                    rss["warm"] = tree_rss_mib(self.server.proc.pid)
                    rss["rss_warm"] = True
                if not self.healthy(p):
                    health_log.append({"after_input": batch[-1], **p})
                    window = [self.gen.case(k).repro() for k in batch[-self.args.concurrency * 2:]]
                    self.tally.find("server_unhealthy" if p.get("alive") else "server_died", None,
                                    {"probe": p, "last_inputs": window,
                                     "log_tail": self.server.output()[-1500:]},
                                    note=f"after inputs {batch[0]}..{batch[-1]}", max_per_key=10)
                    if not p.get("alive") and self.restarts < 2:
                        for h in holders:
                            h.pop("ch", None)
                        self.restarts += 1
                        self.server.stop()
                        self.server.start()
                    elif not p.get("alive"):
                        break
                print(f"  {self.server.kind}: {self.tally.sent} inputs, {sum(self.tally.kinds.values())} findings, "
                      f"{time.monotonic() - t0:.0f} s", flush=True)
            for h in holders:
                if h.get("ch") is not None:
                    await _close_quietly(h["ch"].ws)
            t1 = time.monotonic()
            g = await self.gauges(session)
            while any(v for v in g.values() if isinstance(v, (int, float))) and time.monotonic() - t1 < self.args.settle_s:
                await asyncio.sleep(1.0)
                g = await self.gauges(session)
            end_probe = await self.probe(session)
            g = await self.gauges(session)
        rss["end"] = tree_rss_mib(self.server.proc.pid) if alive(self.server.proc.pid) else None
        rss.pop("rss_warm", None)
        nonzero = {k: v for k, v in g.items() if isinstance(v, (int, float)) and v and "probe" not in k}
        if nonzero:
            self.tally.find("gauges_not_zero_at_end", None, {"gauges": g, "settle_s": self.args.settle_s})
        if not self.healthy(end_probe):
            self.tally.find("unhealthy_at_end", None, end_probe)
        return {"wall_s": round(time.monotonic() - t0, 1), "rss_mib": rss,
                "rss_delta_mib": None if rss.get("end") is None or rss.get("warm") is None
                else round(rss["end"] - rss["warm"], 1), "gauges_end": g, "end_probe": end_probe,
                "unhealthy_batches": health_log, "restarts": self.restarts}


async def _close_quietly(ws) -> None:
    try:
        await asyncio.wait_for(ws.close(), 5)
    except Exception:  # noqa: BLE001
        pass


# --- main -------------------------------------------------------------------------------------------

def _git() -> dict:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                               text=True, timeout=10).stdout.splitlines()
        return {"commit": head, "modified_tracked_files": len(dirty)}
    except (OSError, subprocess.SubprocessError):
        return {}


def _model_limits() -> tuple[int, int]:
    """(vocab size, context length) of the default model, from the export cache when there (no torch)."""
    try:
        from relayinfer.protocol.model.model_file import (ModelConfig, default_model_path, model_cache_dir,
            open_gguf, read_config)

        path = default_model_path()
        cached = model_cache_dir(path) / "config.json"
        mc = ModelConfig.from_json(cached.read_text()) if cached.is_file() else read_config(open_gguf(path))
        return mc.vocab_size, mc.context_length
    except Exception:  # noqa: BLE001  the defaults of SmolLM2-135M
        return 49152, 8192


def run_server(kind: str, n_inputs: int, wall_s: float, args) -> dict:
    """Start `kind`, send its inputs, stop it; its section of the report."""
    vocab, ctx = _model_limits()
    gen = Generator(kind, args.seed, vocab=vocab, max_len=ctx)
    server = Server(kind, start_timeout_s=args.start_timeout_s, duration_s=wall_s + args.start_timeout_s + 600)
    print(f"{kind}: starting {server.command}", flush=True)
    t0 = time.monotonic()
    start_failures = []
    try:
        try:
            server.start()
        except (RuntimeError, TimeoutError) as e:
            if not getattr(server, "fallback_argv", None):
                raise
            start_failures.append({"command": server.command, "error": str(e)[-1500:]})
            server.stop()
            server.argv = server.fallback_argv
            print(f"{kind}: the CLI did not start ({str(e)[-200:]!r}); trying {' '.join(server.argv[1:])}", flush=True)
            server.start()
    except (RuntimeError, TimeoutError) as e:
        server.stop()
        out = server.output()
        server.cleanup()
        return {"command": server.command, "started": False, "error": str(e)[:3000], "inputs_sent": 0,
                "start_failures": start_failures, "log_tracebacks": tracebacks(out)}
    start_s = round(time.monotonic() - t0, 1)
    if kind in ("cloud", "pd"):
        import urllib.request

        req = urllib.request.Request(server.http_url + "/healthz", headers={"Authorization": f"Bearer {server.token}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            server.fingerprint = json.loads(r.read()).get("model_fingerprint", "")
    print(f"{kind}: up in {start_s} s at {server.ws_url} {server.http_url or ''}; {gen.grid} grid inputs", flush=True)
    runner = Runner(server, gen, args)
    try:
        res = asyncio.run(runner.run(n_inputs, wall_s))
    finally:
        alive_end = alive(server.proc.pid)
        rc = server.stop()
        out = server.output()
        server.cleanup()
    t = runner.tally
    for f in start_failures:
        t.find("server_failed_to_start", None, f)
    return {"command": server.command, "started": True, "start_failures": start_failures, "start_s": start_s, "grid_inputs": gen.grid,
            "inputs_sent": t.sent, "status_histogram": dict(t.statuses.most_common()),
            "findings_by_kind": dict(t.kinds.most_common()), "findings": t.findings,
            "alive_at_end": alive_end, "exit_code": rc, "log_tracebacks": tracebacks(out),
            "fields_covered": len(t.fields), **res}


def markdown(report: dict) -> str:
    """The short table of bench/results/hostile.md."""
    lines = [f"# Hostile-input run ({report['date']}, commit {report['code'].get('commit', '?')[:10]})", "",
             f"`{report['command']}`", "",
             "| server | inputs | fields | findings | 5xx | dropped / hangs | RSS warm -> end (MiB) | gauges at end | alive |",
             "|---|---:|---:|---:|---:|---:|---|---|---|"]
    for kind, s in report["servers"].items():
        if not s.get("started"):
            lines.append(f"| {kind} | 0 | - | not started: {s.get('error', '')[:80]} | | | | | |")
            continue
        k = s["findings_by_kind"]
        drops = sum(v for n, v in k.items() if "closed" in n or "timeout" in n or "no_answer" in n or "dropped" in n)
        r = s["rss_mib"]
        g = {n: v for n, v in s["gauges_end"].items() if v} or "all 0"
        lines.append(f"| {kind} | {s['inputs_sent']} | {s['fields_covered']} | {sum(k.values())} | {k.get('http_5xx', 0)} | "
                     f"{drops} | {r.get('warm')} -> {r.get('end')} ({s['rss_delta_mib']:+}) | {g} | {s['alive_at_end']} |"
                     if s["rss_delta_mib"] is not None else
                     f"| {kind} | {s['inputs_sent']} | {s['fields_covered']} | {sum(k.values())} | {k.get('http_5xx', 0)} | "
                     f"{drops} | {r} | {g} | {s['alive_at_end']} |")
    lines += ["", "## Findings (first example of each kind and field)", ""]
    for kind, s in report["servers"].items():
        for f in s.get("findings", []):
            inp = f.get("input") or {}
            got = json.dumps(f["got"], default=str)[:300]
            lines.append(f"- **{kind}** `{f['kind']}` x{f['count']} -- {inp.get('target', '')} `{inp.get('field', '')}` = "
                         f"`{inp.get('value', '')}` (input {inp.get('index', '-')}): {got}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the hostile inputs (see the module docstring); write the JSON and Markdown reports."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--servers", nargs="+", default=list(SERVERS), choices=SERVERS)
    p.add_argument("--inputs", type=int, default=10_000, help="inputs in all, shared by the servers (default 10000)")
    p.add_argument("--max-wall-s", type=float, default=900.0,
                   help="seconds of sending in all, shared by the servers (default 900; server start-up not counted)")
    p.add_argument("--quick", action="store_true", help="at most 300 inputs and 600 s of sending (the test: bounded by its input count)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=100, help="inputs between health checks")
    p.add_argument("--concurrency", type=int, default=2, help="inputs in flight per server")
    p.add_argument("--request-timeout-s", type=float, default=30.0)
    p.add_argument("--settle-s", type=float, default=30.0, help="wait at most this long for the gauges to reach 0")
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--replay", type=int, default=None, help="send only input N of each --servers (and check)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "hostile.json"))
    args = p.parse_args(argv)
    args.start = 0
    if args.quick:
        args.inputs, args.max_wall_s, args.batch = min(args.inputs, 300), min(args.max_wall_s, 600.0), 50
    if args.replay is not None:
        args.start, args.inputs, args.batch = args.replay, len(args.servers), 1
    shares = {k: SHARE[k] for k in args.servers}
    total = sum(shares.values())
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": "python -m bench.hostile " + " ".join(argv if argv is not None else sys.argv[1:]),
              "code": _git(), "seed": args.seed,
              "machine": {"nproc": os.cpu_count(), "loadavg_at_start": list(os.getloadavg()),
                          "python": platform.python_version()},
              "settings": {k: v for k, v in vars(args).items() if k != "out"}, "servers": {}}
    started = 0
    for kind in args.servers:
        n = 1 if args.replay is not None else max(1, round(args.inputs * shares[kind] / total))
        wall = args.max_wall_s * shares[kind] / total
        res = report["servers"][kind] = run_server(kind, n, wall, args)
        started += bool(res.get("started"))
        print(f"{kind}: {res.get('inputs_sent')} inputs, findings {res.get('findings_by_kind')}", flush=True)
        if args.replay is not None:
            print(json.dumps({k: res.get(k) for k in ("status_histogram", "findings", "log_tracebacks")}, indent=1,
                             default=str))
    report["total_inputs"] = sum(s.get("inputs_sent", 0) for s in report["servers"].values())
    report["total_findings"] = sum(sum(s.get("findings_by_kind", {}).values()) for s in report["servers"].values())
    if args.replay is None:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1, default=str) + "\n")
        out.with_suffix(".md").write_text(markdown(report))
        print(f"wrote {out} and {out.with_suffix('.md')}: {report['total_inputs']} inputs, "
              f"{report['total_findings']} findings")
    return 0 if started == len(args.servers) else 2


if __name__ == "__main__":
    sys.exit(main())
