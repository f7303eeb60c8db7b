"""Request models of the OpenAI API: `ChatCompletionRequest` and `CompletionRequest`, each built
from a decoded JSON body by `from_json` and turned into the engine's `SamplingParams` by
`to_sampling_params`, plus `APIError`, the error every part of the server raises.

Every top-level field of OpenAI's API is read here: implemented, accepted and ignored (`_IGNORED`,
listed in docs/SERVING.md), or refused with a 400 naming it. Every number is checked once, by the
shared rules of `relayinfer.protocol.validate` (`FieldError`, answered 400 with `param` naming the
field and the allowed range in the message). Torch-free and without I/O: a request model knows no
engine, tokenizer or HTTP.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, ClassVar, Self

import numpy as np

from relayinfer.cloud.serve.openai.structured import FUNCTION_NAME, GUIDED_FIELDS, Tools, parse_structured, \
    parse_tools, render_tool_messages
from relayinfer.protocol.messages import Grammar
from relayinfer.protocol.validate import check_prompt_text
from relayinfer.protocol.model.decoding import SamplingParams, seed_key
from relayinfer.protocol.validate import MAX_LOGIT_BIAS, MAX_STOP_IDS, FieldError, check, check_ids

DEFAULT_MAX_TOKENS_CHAT = 256  # OpenAI: up to the context; capped here at min(256, what fits)
DEFAULT_MAX_TOKENS_COMPLETION = 16  # OpenAI's default for /v1/completions
MAX_BATCH = 64  # prompts per /v1/completions request
_ROLES = {"system", "developer", "user", "assistant", "tool"}
# accepted and ignored (they change nothing about the answer), each of its OpenAI type (JSON's):
# documented in docs/SERVING.md
_IGNORED_TYPES = {"user": str, "metadata": dict, "store": bool, "service_tier": str,
                  "safety_identifier": str, "prompt_cache_key": str}
_IGNORED = set(_IGNORED_TYPES)
_TYPE_NAMES = {str: "a string", dict: "an object", bool: "a boolean"}
_STREAM_OPTIONS = {"include_usage"}  # the keys of stream_options this server implements
_TOKEN_KEY = re.compile(r"-?(0|[1-9][0-9]*)")  # a logit_bias key: a token id in decimal, as JSON writes an integer
# every top-level request field this server reads (implemented, refused by name, or in _IGNORED); any
# other field gets 400 naming it (as OpenAI's "Unrecognized request argument"), never silence
_COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stop", "stop_token_ids",
                  "stream", "stream_options", "presence_penalty", "frequency_penalty", "repetition_penalty",
                  "min_tokens", "logit_bias", "logprobs", "ignore_eos", "best_of", "tools", "tool_choice",
                  "functions", "function_call", "response_format", "audio", "prediction", "web_search_options",
                  "reasoning_effort", "suffix", "verbosity", "modalities", *GUIDED_FIELDS} | _IGNORED
_FIELDS = {True: _COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "parallel_tool_calls"},
           False: _COMMON_FIELDS | {"prompt", "echo"}}


class APIError(Exception):
    """An error answered in OpenAI's shape `{"error": {"message", "type", "param", "code"}}`.

    Args:
        status: the HTTP status (400 invalid request, 404 unknown model, 503 no memory, 500).
        message: what was wrong, for the client.
        param: the request field at fault (``messages[0].role``), or None.
        code: OpenAI's error code (``context_length_exceeded``, ``unsupported_parameter``...).
        type_: ``invalid_request_error`` or ``server_error``.
        headers: extra response headers (``Retry-After`` of a 503).
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_
        self.headers = dict(headers or {})

    def body(self) -> dict:
        """The JSON body of the error response."""
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    """OpenAI's error object `{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def unsupported(param: str, what: str | None = None) -> APIError:
    """400 `unsupported_parameter` naming `param` (and why, in `what`)."""
    return APIError(400, f"'{param}' is not supported by this server{': ' + what if what else ''}", param,
                    "unsupported_parameter")


@dataclass(frozen=True)
class ServedModel:
    """The served model as requests may name it: `name` (the id `/v1/models` lists), any of
    `aliases` (e.g. the GGUF file's name), or no `model` at all; `vocab_size` bounds token ids."""

    name: str
    aliases: tuple[str, ...] = ()
    vocab_size: int = 1 << 31

    def check_model(self, model: Any) -> None:
        """Raises APIError(404, code `model_not_found`) unless `model` is None, `name` or an alias
        (400 `invalid_type` when it is no string)."""
        if model is not None and not isinstance(model, str):
            raise APIError(400, f"model must be a string, got {type(model).__name__}", "model", "invalid_type")
        if model is not None and model != self.name and model not in self.aliases:
            known = ", ".join(repr(m) for m in (self.name, *self.aliases))
            raise APIError(404, f"The model '{model}' does not exist; this server serves {known} (or leave "
                           "'model' out)", "model", "model_not_found")


def choice_seed(seed: int | None, j: int) -> int | None:
    """Seed of choice `j` of a request seeded with `seed`: choice 0 keeps it, others derive
    distinct reproducible seeds in [0, 2**63) from (seed_key(seed), j)."""
    if seed is None or j == 0:
        return seed
    return int(np.random.SeedSequence([seed_key(seed), j]).generate_state(2, np.uint32).astype(np.uint64)
               .view(np.uint64)[0] >> np.uint64(1))


@dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    """The fields both endpoints share, checked. `logprobs`: None (off) or the number of top
    alternatives per token (chat's `top_logprobs`, completions' `logprobs`); `max_tokens`: None when
    the request left it out (then `default_max_tokens`, capped to what fits)."""

    default_max_tokens: ClassVar[int] = DEFAULT_MAX_TOKENS_COMPLETION
    chat: ClassVar[bool] = False  # the field set of /v1/chat/completions (else /v1/completions)
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None
    ignore_eos: bool = False  # vLLM's: EOS does not end the answer (it runs to max_tokens or a stop)
    grammar: Grammar | None = None  # structured output (`structured.parse_structured`), or a forced tool call
    grammar_field: str | None = None  # the request field that set `grammar` (errors name it)

    @classmethod
    def from_json(cls, body: Any, served: ServedModel) -> Self:
        """The request of a decoded JSON `body` for the model `served` (an instance of `cls`).

        Raises:
            APIError: 400 naming the field (unknown, unsupported, malformed), 404 unknown model.
            FieldError: a value outside the shared rules of `protocol.validate`.
        """
        _check_body(body, served, cls.chat)
        common = _common_fields(body, served.vocab_size)
        common["grammar"], common["grammar_field"] = parse_structured(body)
        own = cls._own_fields(body, served.vocab_size)
        if own.get("grammar") is not None and common["grammar"] is not None:  # a forced tool call and a format
            raise FieldError(common["grammar_field"], f"left out when tool_choice is {own['tools'].choice!r} (the "
                             "call's format constrains the answer)", "given")
        return cls(**{**common, **own}, ignore_eos=_bool(body, "ignore_eos"))

    @classmethod
    def _own_fields(cls, body: dict, vocab_size: int) -> dict:
        """The endpoint's own fields of `body` (prompt or messages, logprobs...), checked."""
        raise NotImplementedError

    def to_sampling_params(self, prompt_tokens: int, max_model_len: int, choice: int = 0) -> SamplingParams:
        """The engine's sampling of choice `choice` (0..n-1) for a prompt of `prompt_tokens` tokens.

        `top_p` 0 is greedy (the nucleus is the single most likely token); a left-out `max_tokens`
        is `default_max_tokens` (at least `min_tokens`), capped to what fits `max_model_len` (and at
        least 1); choice j > 0 of a seeded request gets `choice_seed(seed, j)`.

        Raises:
            FieldError: `min_tokens` above the capped default (``min_tokens must be at most ...``).
        """
        temperature, top_p = (0.0, 1.0) if self.top_p == 0 else (self.temperature, self.top_p)
        max_new = self.max_tokens
        if max_new is None:  # the default, capped to what fits (vLLM: up to the context)
            max_new = max(1, min(max(self.default_max_tokens, self.min_tokens), max_model_len - prompt_tokens))
            if self.min_tokens > max_new:
                raise FieldError("min_tokens", f"at most the {max_new} tokens that fit after this prompt (max_tokens "
                                 "left out)", self.min_tokens)
        return SamplingParams(
            temperature=temperature, top_p=top_p, top_k=self.top_k, seed=choice_seed(self.seed, choice),
            max_new_tokens=max_new, stop_ids=self.stop_token_ids, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            min_tokens=self.min_tokens, logit_bias=self.logit_bias, logprobs=self.logprobs, grammar=self.grammar)


@dataclass(frozen=True, kw_only=True)
class ChatCompletionRequest(GenerationRequest):
    """A checked `/v1/chat/completions` body. `messages`: ({"role", "content": str}, ...) for the
    chat template (role `developer` given as `system`, text parts joined; tool calls and tool
    results as text, `structured.render_tool_messages`, and the functions of `tools` described in
    the system message); `tools`: the request's functions (None: no tools, or tool_choice 'none')."""

    default_max_tokens: ClassVar[int] = DEFAULT_MAX_TOKENS_CHAT
    chat: ClassVar[bool] = True
    messages: tuple[dict, ...] = ()
    tools: Tools | None = None

    @classmethod
    def _own_fields(cls, body: dict, vocab_size: int) -> dict:
        messages = render_tool_messages(parse_messages(body.get("messages")), body["messages"])
        lp = _bool(body, "logprobs")
        top = _field(body, "top_logprobs", None)
        if top is not None and not lp:  # as OpenAI and vLLM
            raise FieldError("top_logprobs", "left out unless logprobs is true", top)
        own: dict = {"logprobs": (top or 0) if lp else None}
        tools = parse_tools(body)
        if tools is not None:
            if messages[0]["role"] == "system":
                messages[0] = {"role": "system", "content": messages[0]["content"] + "\n\n" + tools.system_text()}
            else:
                messages.insert(0, {"role": "system", "content": tools.system_text()})
            forced = tools.grammar()
            if forced is not None:  # `from_json` refuses it beside a structured-output field
                own["grammar"], own["grammar_field"] = forced, "tool_choice"
        return {**own, "messages": tuple(messages), "tools": tools}


@dataclass(frozen=True, kw_only=True)
class CompletionRequest(GenerationRequest):
    """A checked `/v1/completions` body. `prompt`: one entry per prompt, a string or a tuple of
    token ids (each id below the vocabulary size); `echo`: the prompt comes first in the text."""

    prompt: tuple[str | tuple[int, ...], ...] = ()
    echo: bool = False

    @classmethod
    def _own_fields(cls, body: dict, vocab_size: int) -> dict:
        prompt = parse_prompt(body.get("prompt"), vocab_size)
        return {"prompt": tuple(prompt), "logprobs": _field(body, "logprobs", None), "echo": _bool(body, "echo")}

    def prompt_param(self, i: int) -> str:
        """The field that names prompt `i`: ``prompt``, or ``prompt[i]`` in a batch."""
        return "prompt" if len(self.prompt) == 1 else f"prompt[{i}]"


def _field(body: dict, name: str, default, rule: str | None = None):
    """`body[name]` by the shared rule `RULES[rule or name]` (`protocol.validate`; integers follow
    JSON Schema: 2.0 is the integer 2, true is no number); `default` when absent or null. Raises
    FieldError naming `name`, which the routes answer with 400, `param` = `name`."""
    v = body.get(name)
    return default if v is None else check(rule or name, v, name)


def _bool(body: dict, name: str, field: str | None = None) -> bool:
    """`body[name]` as a JSON boolean (False when absent or null); raises FieldError naming `field`."""
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise FieldError(field or name, "a boolean", v)
    return bool(v)


def _bad_unicode(v, path: str) -> str | None:
    """The path of the first string in `v` (a decoded JSON value) holding a lone surrogate."""
    if isinstance(v, str):
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            return path
    elif isinstance(v, dict):
        for k, x in v.items():
            p = _bad_unicode(k, path) or _bad_unicode(x, f"{path}.{k}" if path else str(k))
            if p:
                return p
    elif isinstance(v, list):
        for i, x in enumerate(v):
            p = _bad_unicode(x, f"{path}[{i}]")
            if p:
                return p
    return None


def _require_text(body: dict, chat: bool) -> None:
    """The one rule for empty input of every entry point (`protocol.validate.check_prompt_text`): a
    blank prompt string or messages without any text get 400 naming the field. Malformed shapes
    are left to the field's own checks."""
    name = "messages" if chat else "prompt"
    v = body.get(name)
    if chat or isinstance(v, str) or (isinstance(v, list) and all(isinstance(t, int) for t in v)):
        items = [v]
    else:
        items = v if isinstance(v, list) else []
    for i, item in enumerate(items):
        if isinstance(item, (str, list)):
            param = name if len(items) == 1 else f"{name}[{i}]"
            try:
                check_prompt_text(item, param)
            except ValueError as e:
                raise APIError(400, str(e), param, "invalid_value") from None


def _check_body(body: Any, served: ServedModel, chat: bool) -> None:
    """The checks before any value is read: a JSON object of known fields, valid Unicode, the
    served model, some prompt text, and no field this server refuses (tools, audio...)."""
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    unknown = sorted(k for k in body if k not in _FIELDS[chat])
    if unknown:
        where = "/v1/chat/completions" if chat else "/v1/completions"
        raise APIError(400, f"Unrecognized request argument supplied: '{unknown[0]}' (not a field of {where} "
                       "on this server)", unknown[0], "unsupported_parameter")
    bad = _bad_unicode(body, "")
    if bad:
        raise APIError(400, f"'{bad}' holds a lone surrogate: not valid Unicode text", bad, "invalid_value")
    served.check_model(body.get("model"))
    for name, kind in _IGNORED_TYPES.items():  # ignored, but only when it is what OpenAI takes
        v = body.get(name)
        if v is not None and not isinstance(v, kind):
            raise FieldError(name, _TYPE_NAMES[kind], v)
    _require_text(body, chat)
    if body.get("functions"):
        raise unsupported("functions", "deprecated by OpenAI; use 'tools'")
    if body.get("function_call") not in (None, "none"):
        raise unsupported("function_call", "deprecated by OpenAI; use 'tool_choice'")
    if not chat and (body.get("tools") or body.get("tool_choice") not in (None, "none")):
        raise unsupported("tools" if body.get("tools") else "tool_choice", "tool calls are a chat feature "
                          "(/v1/chat/completions)")
    for name in ("audio", "prediction", "web_search_options", "reasoning_effort", "suffix", "verbosity"):
        if body.get(name) is not None:
            raise unsupported(name)
    mods = body.get("modalities")
    if mods is not None and mods != ["text"]:
        raise unsupported("modalities", "only ['text']")


def _common_fields(body: dict, vocab_size: int) -> dict:
    """`GenerationRequest`'s fields of `body` (token ids below `vocab_size`), checked in a fixed
    order so that the first bad field is the one named. Raises APIError or FieldError."""
    n = _field(body, "n", 1)
    if _field(body, "best_of", n) != n:
        raise unsupported("best_of", "only best_of == n (no server-side ranking)")
    out: dict = {"n": n, "temperature": _field(body, "temperature", 1.0), "top_p": _field(body, "top_p", 1.0)}
    max_tokens = _field(body, "max_tokens", None, "max_new_tokens")
    mct = _field(body, "max_completion_tokens", None, "max_new_tokens")  # wins over max_tokens, as in vLLM
    max_tokens = mct if mct is not None else max_tokens
    min_tokens = _field(body, "min_tokens", 0)
    if max_tokens is not None and min_tokens > max_tokens:
        raise FieldError("min_tokens", f"at most max_tokens ({max_tokens})", min_tokens)
    out.update(max_tokens=max_tokens, min_tokens=min_tokens, stop=_stop_strings(body.get("stop")))
    out["stop_token_ids"] = tuple(check_ids(  # vLLM extension
        "stop_token_ids", [] if body.get("stop_token_ids") is None else body["stop_token_ids"], vocab_size - 1,
        max_len=MAX_STOP_IDS))
    out["stream"] = stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise FieldError("stream_options", "an object", opts)
    if opts is not None and not stream:  # as vLLM: the options of a stream need a stream
        raise FieldError("stream_options", "left out unless stream is true", opts)
    for key in opts or {}:  # an option accepted must work
        if key not in _STREAM_OPTIONS:
            raise FieldError(f"stream_options.{key}", f"left out (this server implements only "
                             f"{', '.join(sorted(_STREAM_OPTIONS))})", opts[key])
    out["include_usage"] = _bool(opts or {}, "include_usage", "stream_options.include_usage")
    out["logit_bias"] = _logit_bias(body.get("logit_bias"), vocab_size)
    for name, default in (("top_k", 0), ("seed", None), ("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                          ("repetition_penalty", 1.0)):
        out[name] = _field(body, name, default)
    return out


def _stop_strings(stop: Any) -> tuple[str, ...]:
    """`stop`: a string or up to 4 strings, empty ones dropped (they match nothing)."""
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) for s in stops):
        raise FieldError("stop", "a string or a list of up to 4 strings", stop)
    return tuple(s for s in stops if s)


def _logit_bias(bias: Any, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """`logit_bias` {"token id": bias} -> ((id, bias), ...), ids below `vocab_size`, biases by rule."""
    if bias is None:
        return ()
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise FieldError("logit_bias", f"an object mapping up to {MAX_LOGIT_BIAS} token ids to numbers", bias)
    pairs = []
    for k, v in bias.items():
        if not _TOKEN_KEY.fullmatch(k):  # int() would also take "+5", " 5", "1_000", "٥" and "05" (a second 5)
            raise FieldError("logit_bias", 'keyed by token ids in decimal ("50256")', k)
        tid = int(k)
        pairs.append((check("token_id", tid, "logit_bias", hi=vocab_size - 1), check("logit_bias", v)))
    return tuple(pairs)


def parse_messages(msgs: Any) -> list[dict]:
    """OpenAI chat messages -> [{role, content: str}] for the template. Raises APIError naming
    the field of what is malformed or not supported (tool calls, images, audio, files)."""
    if not isinstance(msgs, list) or not msgs:
        raise APIError(400, "'messages' must be a non-empty list", "messages", "missing_required_parameter")
    out = []
    for i, m in enumerate(msgs):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise APIError(400, f"'{p}' must be an object", p, "invalid_type")
        role = m.get("role")
        if role == "function":
            raise unsupported(f"{p}.role", "role 'function' (deprecated by OpenAI; use 'tool')")
        if not isinstance(role, str) or role not in _ROLES:  # a JSON object or list is no role (nor hashable)
            raise APIError(400, f"'{p}.role' must be one of {sorted(_ROLES)}, got {role!r}", f"{p}.role",
                           "invalid_value")
        if m.get("function_call"):
            raise unsupported(f"{p}.function_call", "deprecated by OpenAI; use 'tool_calls'")
        calls = m.get("tool_calls")
        if calls is not None:
            _check_tool_calls(calls, p, role)
        if role == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise APIError(400, f"'{p}.tool_call_id' is required for a tool message (the id of the call it "
                           "answers)", f"{p}.tool_call_id", "missing_required_parameter")
        if m.get("audio") is not None:
            raise unsupported(f"{p}.audio")
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise APIError(400, f"{p}.name must be a string, got {type(m['name']).__name__}", f"{p}.name",
                           "invalid_type")
        content = m.get("content")
        if content is None and calls:
            content = ""
        if content is None:
            raise APIError(400, f"'{p}.content' is required (null content is only valid with tool_calls)",
                           f"{p}.content", "missing_required_parameter")
        if isinstance(content, list):
            content = _content_parts(content, p, role)
        elif not isinstance(content, str):
            raise APIError(400, f"'{p}.content' must be a string or a list of text parts", f"{p}.content",
                           "invalid_type")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def _check_tool_calls(calls: Any, p: str, role: str) -> None:
    """Raises APIError naming the entry of an assistant message's `tool_calls` that is not
    [{"id", "type": "function", "function": {"name", "arguments": JSON text of an object}}]."""
    if role != "assistant":
        raise APIError(400, f"'{p}.tool_calls' is only valid on an assistant message", f"{p}.tool_calls",
                       "invalid_value")
    if not isinstance(calls, list) or not calls:
        raise APIError(400, f"'{p}.tool_calls' must be a non-empty list", f"{p}.tool_calls", "invalid_type")
    for j, c in enumerate(calls):
        q = f"{p}.tool_calls[{j}]"
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not isinstance(f.get("arguments"), str) \
                or not isinstance(c.get("id"), str) or c.get("type", "function") != "function" \
                or not FUNCTION_NAME.fullmatch(f["name"]):
            raise APIError(400, f"'{q}' must be {{'id': a string, 'type': 'function', 'function': {{'name': 1-64 letters, "
                           "digits, '_' or '-', 'arguments': JSON text}}}}", q, "invalid_value")
        try:
            args = json.loads(f["arguments"] or "{}")
        except ValueError:
            args = None
        if not isinstance(args, dict):
            raise APIError(400, f"'{q}.function.arguments' must be the JSON text of an object", f"{q}.function.arguments",
                           "invalid_value")


def _content_parts(content: list, p: str, role: str) -> str:
    """The text of the content parts of message `p` (text parts; an assistant's refusal parts)."""
    parts = []
    for j, part in enumerate(content):
        q = f"{p}.content[{j}]"
        if not isinstance(part, dict):
            raise APIError(400, f"'{q}' must be an object", q, "invalid_type")
        if part.get("type") == "refusal" and role == "assistant" and isinstance(part.get("refusal"), str):
            parts.append(part["refusal"])
            continue
        if part.get("type") != "text":
            raise unsupported(f"{q}.type", f"content part {part.get('type')!r} (only text)")
        if not isinstance(part.get("text"), str):
            raise APIError(400, f"'{q}.text' must be a string", f"{q}.text", "invalid_type")
        parts.append(part["text"])
    return "".join(parts)


def _is_ids(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def parse_prompt(prompt: Any, vocab_size: int) -> list[str | tuple[int, ...]]:
    """`prompt` of /v1/completions: a string, a list of strings, a list of token ids, or a list of
    token-id lists -> one entry per prompt (a string, or token ids below `vocab_size`). Raises
    APIError naming `prompt` (or ``prompt[i]``), FieldError for an id outside the vocabulary."""
    if isinstance(prompt, str) or (_is_ids(prompt) and prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt:
        items = prompt
    else:
        raise APIError(400, "'prompt' must be a non-empty string, list of strings, list of token ids or "
                       "list of token-id lists", "prompt", "invalid_value")
    if len(items) > MAX_BATCH:
        raise APIError(400, f"'prompt' holds {len(items)} prompts, at most {MAX_BATCH} are allowed", "prompt",
                       "invalid_value")
    out: list[str | tuple[int, ...]] = []
    for i, item in enumerate(items):
        p = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            out.append(item)
            continue
        if not _is_ids(item):
            raise APIError(400, f"'{p}' must be a string or a list of token ids", p, "invalid_type")
        ids = check_ids(p, item, vocab_size - 1)
        if not ids:
            raise APIError(400, f"'{p}' has no tokens", p, "invalid_value")
        out.append(tuple(ids))
    return out
