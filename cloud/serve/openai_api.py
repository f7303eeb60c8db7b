"""OpenAI-compatible HTTP API on aiohttp over the batching engine (`AsyncLLMEngine`).

Routes (https://platform.openai.com/docs/api-reference): `POST /v1/chat/completions`,
`POST /v1/completions` (both non-streaming JSON or streaming server-sent events, `data: {chunk}`
lines ending with `data: [DONE]`), `GET /v1/models` (with `max_model_len`, the most prompt +
answer tokens one request can hold) and `GET /openapi.json` (an OpenAPI 3.1 description of these
routes, `openapi_spec()`). Every request field of OpenAI's API is either implemented or refused with
a 400 naming it; docs/SERVING.md's "OpenAI API" table lists each one and any difference from OpenAI/vLLM.
Errors use OpenAI's shape `{"error": {"message", "type", "param", "code"}}` with status 400 (invalid
request, prompt too long: code `context_length_exceeded`), 404 (unknown model, unknown path), 405
(wrong method) or 500 (engine failure); no request body can cause a 5xx. Every number is checked
once, by the shared rules of `relayinfer.protocol.validate` (400 with `param` naming the field and
the allowed range in the message). A stream whose request fails after its headers ends with an error
event in vLLM's shape, a last chunk per open choice with finish_reason "error", and `data: [DONE]`.

Text: one incremental detokenizer (`Tokenizer.stream_decoder`) per choice; control tokens (EOS,
`<|im_end|>`, a `stop_token_ids` id) add no text, a character cut by `max_tokens` is dropped, and
stop strings are held back while they may still match, so the streamed deltas join to the
non-streamed text. Logprobs are the log-softmax of the model's full-vocabulary logits (not changed by
temperature, top_p/top_k, penalties or logit_bias; vLLM's default `raw_logprobs`).

Use `openai_routes(app, engine, tokenizer, model_name)` to mount the routes on an existing app
(the cloud service), or `make_app(...)` for a standalone server.

Client disconnects: serve the app with `web.AppRunner(app, handler_cancellation=True)` (the cloud
service does): aiohttp >= 3.9 otherwise lets a handler run on after its client left. A cancelled
handler leaves the engine's generators, which aborts the requests at the engine's next step and
frees their KV blocks, before the headers (queued or prefilling) or after them (streaming), streamed
or not. A write to a connection the client closed ends the requests the same way. Either is an
ordinary event, logged at debug level only.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Collection

import numpy as np
from aiohttp import web

from relayinfer.cloud.engine.llm_engine import AsyncLLMEngine
from relayinfer.protocol.validate import check_prompt_text
from relayinfer.protocol.model.decoding import SamplingParams, seed_key, token_logprobs
from relayinfer.protocol.model.errors import PromptTooLongError
from relayinfer.protocol.validate import MAX_LOGIT_BIAS, MAX_STOP_IDS, MAX_TOKENS, FieldError, check, check_ids

log = logging.getLogger("relayinfer.openai")

DEFAULT_MAX_TOKENS_CHAT = 256  # OpenAI: up to the context; capped here at min(256, what fits)
DEFAULT_MAX_TOKENS_COMPLETION = 16  # OpenAI's default for /v1/completions
MAX_BATCH = 64  # prompts per /v1/completions request
_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "budget": "length", "abort": "stop"}
_ROLES = {"system", "developer", "user", "assistant"}
# accepted and ignored (they change nothing about the answer): documented in docs/SERVING.md
_IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "safety_identifier",
            "prompt_cache_key"}
# every top-level request field this server reads (implemented, refused by name, or in _IGNORED); any
# other field gets 400 naming it (as OpenAI's "Unrecognized request argument"), never silence
_COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stop", "stop_token_ids",
                  "stream", "stream_options", "presence_penalty", "frequency_penalty", "repetition_penalty",
                  "min_tokens", "logit_bias", "logprobs", "ignore_eos", "best_of", "tools", "tool_choice",
                  "functions", "function_call", "response_format", "audio", "prediction", "web_search_options",
                  "reasoning_effort", "suffix", "verbosity", "modalities"} | _IGNORED
_FIELDS = {True: _COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"},
           False: _COMMON_FIELDS | {"prompt", "echo"}}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def response(self) -> web.Response:
        return _error_response(self.status, self.message, self.param, self.code, self.type)


def _error_response(status: int, message: str, param=None, code=None, type_="invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": type_, "param": param, "code": code}},
                             status=status)


def _unsupported(param: str, what: str | None = None) -> APIError:
    return APIError(400, f"'{param}' is not supported by this server{': ' + what if what else ''}", param,
                    "unsupported_parameter")


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


def _choice_seed(seed: int | None, j: int) -> int | None:
    """Seed of choice `j` of a request seeded with `seed`: choice 0 keeps it, others derive
    distinct reproducible seeds in [0, 2**63) from (seed_key(seed), j)."""
    if seed is None or j == 0:
        return seed
    return int(np.random.SeedSequence([seed_key(seed), j]).generate_state(2, np.uint32).astype(np.uint64)
               .view(np.uint64)[0] >> np.uint64(1))


@dataclass
class _Request:
    """A parsed request: prompts (token ids each), sampling, output options."""

    prompts: list[list[int]]
    params: SamplingParams
    stops: list[str]
    stream: bool
    include_usage: bool
    n: int = 1
    logprobs: int | None = None  # None: off; else top-k count
    echo: bool = False
    max_tokens_set: bool = True
    prompt_texts: list[str] = field(default_factory=list)
    ignore_eos: bool = False  # vLLM's: EOS does not end the answer (it runs to max_tokens or a stop)


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
            try:
                check_prompt_text(item, name if len(items) == 1 else f"{name}[{i}]")
            except ValueError as e:
                raise APIError(400, str(e), name, "invalid_value") from None


def _parse_common(body, model_name: str, chat: bool, aliases: Collection[str] = (),
                  vocab_size: int = 1 << 31) -> tuple[SamplingParams, list[str], bool, bool, int, bool]:
    """Sampling, stop strings, stream, include_usage, n and "max_tokens was given" from the body,
    every number by the shared rules of `protocol.validate` (token ids below `vocab_size`).
    `model` may be omitted (the served model, as llama.cpp's server does), `model_name` or one of
    its `aliases` (the GGUF file's name). Raises APIError(400/404) naming the field."""
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
    model = body.get("model")
    if model is not None and model != model_name and model not in aliases:
        known = ", ".join(repr(m) for m in (model_name, *aliases))
        raise APIError(404, f"The model '{model}' does not exist; this server serves {known} (or leave 'model' out)",
                       "model", "model_not_found")
    _require_text(body, chat)
    for name in ("tools", "functions"):
        if body.get(name):
            raise _unsupported(name, "tool calling is not implemented")
    for name in ("tool_choice", "function_call"):
        if body.get(name) not in (None, "none"):
            raise _unsupported(name, "tool calling is not implemented")
    rf = body.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        raise _unsupported("response_format", "only {'type': 'text'}")
    for name in ("audio", "prediction", "web_search_options", "reasoning_effort", "suffix", "verbosity"):
        if body.get(name) is not None:
            raise _unsupported(name)
    mods = body.get("modalities")
    if mods is not None and mods != ["text"]:
        raise _unsupported("modalities", "only ['text']")
    n = _field(body, "n", 1)
    best_of = _field(body, "best_of", n)
    if best_of != n:
        raise _unsupported("best_of", "only best_of == n (no server-side ranking)")
    temperature = _field(body, "temperature", 1.0)
    top_p = _field(body, "top_p", 1.0)
    if top_p == 0:  # the nucleus is the single most likely token
        temperature, top_p = 0.0, 1.0
    max_tokens = _field(body, "max_tokens", None, "max_new_tokens")
    mct = _field(body, "max_completion_tokens", None, "max_new_tokens")  # wins over max_tokens, as in vLLM
    max_tokens = mct if mct is not None else max_tokens
    min_tokens = _field(body, "min_tokens", 0)
    if max_tokens is not None and min_tokens > max_tokens:
        raise FieldError("min_tokens", f"at most max_tokens ({max_tokens})", min_tokens)
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) for s in stops):
        raise FieldError("stop", "a string or a list of up to 4 strings", stop)
    stops = [s for s in stops if s]  # an empty stop string matches nothing
    stop_ids = check_ids("stop_token_ids", [] if body.get("stop_token_ids") is None else body["stop_token_ids"],
                         vocab_size - 1, max_len=MAX_STOP_IDS)  # vLLM extension
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise FieldError("stream_options", "an object", opts)
    if opts is not None and not stream:  # as vLLM: the options of a stream need a stream
        raise FieldError("stream_options", "left out unless stream is true", opts)
    include_usage = _bool(opts or {}, "include_usage", "stream_options.include_usage")
    bias = body.get("logit_bias")
    pairs: list[tuple[int, float]] = []
    if bias is not None:
        if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
            raise FieldError("logit_bias", f"an object mapping up to {MAX_LOGIT_BIAS} token ids to numbers", bias)
        for k, v in bias.items():
            try:
                tid = int(k)
            except ValueError:
                raise FieldError("logit_bias", "keyed by token ids", k) from None
            pairs.append((check("token_id", tid, "logit_bias", hi=vocab_size - 1), check("logit_bias", v)))
    params = SamplingParams(
        temperature=temperature, top_p=top_p, top_k=_field(body, "top_k", 0), seed=_field(body, "seed", None),
        max_new_tokens=max_tokens or MAX_TOKENS, stop_ids=tuple(stop_ids),
        presence_penalty=_field(body, "presence_penalty", 0.0), frequency_penalty=_field(body, "frequency_penalty", 0.0),
        repetition_penalty=_field(body, "repetition_penalty", 1.0), min_tokens=min_tokens, logit_bias=tuple(pairs))
    return params, stops, stream, bool(include_usage), n, max_tokens is not None


def _messages(msgs) -> list[dict]:
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
        if role in ("tool", "function"):
            raise _unsupported(f"{p}.role", f"role '{role}' (tool calling is not implemented)")
        if not isinstance(role, str) or role not in _ROLES:  # a JSON object or list is no role (nor hashable)
            raise APIError(400, f"'{p}.role' must be one of {sorted(_ROLES)}, got {role!r}", f"{p}.role",
                           "invalid_value")
        if m.get("tool_calls") or m.get("function_call"):
            raise _unsupported(f"{p}.tool_calls", "tool calling is not implemented")
        if m.get("audio") is not None:
            raise _unsupported(f"{p}.audio")
        content = m.get("content")
        if content is None:
            raise APIError(400, f"'{p}.content' is required (null content is only valid with tool_calls, "
                           f"which are not supported)", f"{p}.content", "missing_required_parameter")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                q = f"{p}.content[{j}]"
                if not isinstance(part, dict):
                    raise APIError(400, f"'{q}' must be an object", q, "invalid_type")
                if part.get("type") == "refusal" and role == "assistant" and isinstance(part.get("refusal"), str):
                    parts.append(part["refusal"])
                    continue
                if part.get("type") != "text":
                    raise _unsupported(f"{q}.type", f"content part {part.get('type')!r} (only text)")
                if not isinstance(part.get("text"), str):
                    raise APIError(400, f"'{q}.text' must be a string", f"{q}.text", "invalid_type")
                parts.append(part["text"])
            content = "".join(parts)
        elif not isinstance(content, str):
            raise APIError(400, f"'{p}.content' must be a string or a list of text parts", f"{p}.content",
                           "invalid_type")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def _prompts(body: dict, tokenizer, vocab_size: int) -> tuple[list[list[int]], list[str]]:
    """`prompt` of /v1/completions: a string, a list of strings, a list of token ids, or a list of
    token-id lists -> (ids per prompt, text per prompt). Raises APIError naming `prompt`."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        items = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt:
        items = prompt
    else:
        raise APIError(400, "'prompt' must be a non-empty string, list of strings, list of token ids or "
                       "list of token-id lists", "prompt", "invalid_value")
    if len(items) > MAX_BATCH:
        raise APIError(400, f"'prompt' holds {len(items)} prompts, at most {MAX_BATCH} are allowed", "prompt",
                       "invalid_value")
    ids_out, texts = [], []
    for i, item in enumerate(items):
        p = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            ids = tokenizer.encode_prompt(item)
            text = item
        elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            ids = check_ids(p, item, vocab_size - 1)
            text = tokenizer.decode(ids)
        else:
            raise APIError(400, f"'{p}' must be a string or a list of token ids", p, "invalid_type")
        if not ids:
            raise APIError(400, f"'{p}' has no tokens", p, "invalid_value")
        ids_out.append(ids)
        texts.append(text)
    return ids_out, texts


def _token_str(tokenizer, tid: int) -> str:
    b = tokenizer.token_bytes(tid)
    return b.decode("utf-8", errors="replace") if b else tokenizer.decode([tid])


class _TextRun:
    """One choice's token stream turned into text deltas, with stop strings cut out.

    Text that could be the start of a stop string is held back until it is not (so a streamed
    answer never shows part of a stop string). A token that ends the answer as EOS or as a
    `stop_token_ids` id adds no text. `deltas()` yields (text, [StepOutput of the tokens behind it]).
    """

    def __init__(self, engine: AsyncLLMEngine, tokenizer, request_id: str, ids: list[int],
                 params: SamplingParams, stops: list[str], ignore_eos: bool = False):
        self.engine, self.tok, self.request_id = engine, tokenizer, request_id
        self.ids, self.params, self.stops, self.ignore_eos = ids, params, stops, ignore_eos
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.finish_reason = "length"
        self.completion_tokens = 0

    async def deltas(self) -> AsyncIterator[tuple[str, list]]:
        dec = self.tok.stream_decoder()
        text, sent, pending = "", 0, []
        kw = {"ignore_eos": True} if self.ignore_eos else {}  # only AsyncLLMEngine takes it (parse() checks)
        async for o in self.engine.generate(self.request_id, self.ids, self.params, **kw):
            self.completion_tokens += 1
            pending.append(o)
            if o.finish_reason not in ("eos", "stop"):
                text += dec.push(o.token_id)
            if self.stops:
                hits = [i for i in (text.find(s, max(0, sent - self.hold)) for s in self.stops) if i >= 0]
                if hits:
                    cut = min(hits)
                    self.finish_reason = "stop"
                    yield text[sent:cut] if cut > sent else "", pending
                    return  # leaving the engine's generator aborts the request
            if o.finish_reason is not None:
                self.finish_reason = _FINISH.get(o.finish_reason, "stop")
                yield text[sent:], pending
                return
            safe = len(text) - self.hold
            if safe > sent:
                yield text[sent:safe], pending
                sent, pending = safe, []


def _prompt_logprobs(model, ids: list[int], top: int) -> list[tuple[float, list[tuple[int, float]]] | None]:
    """Logprobs of each prompt token given the ones before it (None for the first), from one
    full forward of `model` (the engine's `Llama`, read-only) over `ids`."""
    import torch

    from relayinfer.cloud.models.llama import ConcatKV

    cfg = model.cfg
    dev = next(model.parameters()).device
    dt = next(model.parameters()).dtype
    empty = torch.zeros(1, cfg.n_kv_heads, 0, cfg.head_dim, device=dev, dtype=dt)
    with torch.inference_mode():
        logits = model(torch.tensor([ids], device=dev), ConcatKV([(empty, empty)] * cfg.n_layers), 0,
                       last_only=False)[0].float().cpu().numpy()
    return [None] + [token_logprobs(logits[i - 1], ids[i], top) for i in range(1, len(ids))]


def openai_routes(app: web.Application, engine: AsyncLLMEngine, tokenizer, model_name: str,
                  aliases: Collection[str] = (), budget=None, retry_after_s: float = 5.0) -> None:
    """Add `/v1/chat/completions`, `/v1/completions`, `/v1/models` and `/openapi.json` to `app`,
    and a middleware that answers 404/405 (and any other HTTP error) in OpenAI's JSON error shape.

    Args:
        engine: the `AsyncLLMEngine` (started lazily inside the app's event loop).
        tokenizer: `relayinfer.protocol.model.tokenizer.Tokenizer` of the served model (chat template).
        model_name: the id that `/v1/models` lists and answers carry; requests may send it as
            `model`, one of `aliases` (e.g. the GGUF file's name), or no `model` at all.
        budget: the server's `protocol.transport.limits.MemoryBudget` (None: not charged); `echo` with
            `logprobs` runs one full forward per prompt outside the batch, charged its float32
            logits and hidden states while it runs, and answered 503 with `Retry-After`
            (`retry_after_s`, seconds) when they do not fit.
    """
    created = int(time.time())
    llm = engine.engine
    vocab = llm.cfg.vocab_size

    async def read_json(request: web.Request):
        raw = await request.read()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            raise APIError(400, "request body is not valid JSON") from None

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": created, "owned_by": "relayinfer",
             "max_model_len": llm.max_model_len}]})

    async def spec(request: web.Request) -> web.Response:
        from relayinfer.cloud.serve.openapi import openapi_spec

        return web.json_response(openapi_spec(model_name))

    def parse(body, chat: bool) -> _Request:
        params, stops, stream, include_usage, n, max_set = _parse_common(body, model_name, chat, aliases, vocab)
        if chat:
            msgs = _messages(body.get("messages"))
            try:
                prompts = [tokenizer.encode_chat(msgs)]
            except (TypeError, ValueError) as e:
                raise APIError(400, f"invalid 'messages': {e}", "messages", "invalid_value") from None
            texts = [""]
            lp = _bool(body, "logprobs")
            top = _field(body, "top_logprobs", None)
            if top is not None and not lp:  # as OpenAI and vLLM
                raise FieldError("top_logprobs", "left out unless logprobs is true", top)
            logprobs = (top or 0) if lp else None
            echo = False
        else:
            prompts, texts = _prompts(body, tokenizer, vocab)
            logprobs = _field(body, "logprobs", None)
            echo = _bool(body, "echo")
        if logprobs is not None:
            params = replace(params, logprobs=logprobs)
        ignore_eos = _bool(body, "ignore_eos")
        if ignore_eos and not isinstance(engine, AsyncLLMEngine):
            raise _unsupported("ignore_eos", "not on the P/D gateway")
        return _Request(prompts, params, stops, stream, include_usage, n, logprobs, echo, max_set, texts,
                        bool(ignore_eos))

    def params_for(req: _Request, ids: list[int], j: int) -> SamplingParams:
        p = req.params
        if not req.max_tokens_set:  # the default, capped to what fits (vLLM: up to the context)
            default = DEFAULT_MAX_TOKENS_CHAT if req.prompt_texts == [""] else DEFAULT_MAX_TOKENS_COMPLETION
            p = replace(p, max_new_tokens=max(1, min(max(default, p.min_tokens), llm.max_model_len - len(ids))))
        return replace(p, seed=_choice_seed(p.seed, j)) if j else p

    async def serve(request: web.Request, chat: bool) -> web.StreamResponse:
        body = await read_json(request)
        req = parse(body, chat)
        prefix = "chatcmpl" if chat else "cmpl"
        rid, now = f"{prefix}-{uuid.uuid4().hex}", int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        runs: list[_TextRun] = []
        for i, ids in enumerate(req.prompts):
            for j in range(req.n):
                p = params_for(req, ids, j)
                try:
                    llm.check_fits(len(ids), p.max_new_tokens)
                except PromptTooLongError as e:
                    param = "messages" if chat else ("prompt" if len(req.prompts) == 1 else f"prompt[{i}]")
                    raise APIError(400, f"{e} (max_tokens {p.max_new_tokens})", param,
                                   "context_length_exceeded") from None
                runs.append(_TextRun(engine, tokenizer, f"{rid}-{len(runs)}", ids, p, req.stops, req.ignore_eos))
        echo_lp: list = [None] * len(req.prompts)
        if req.echo and req.logprobs is not None:
            loop = asyncio.get_running_loop()
            echo_lp = []
            for ids in req.prompts:
                need = len(ids) * 4 * (2 * vocab + 4 * llm.cfg.dim + 3 * llm.cfg.ffn_dim)
                charge = budget.try_charge("echo_logprobs", need) if budget is not None else None
                if budget is not None and charge is None:
                    raise web.HTTPServiceUnavailable(
                        text=budget.refusal(f"echo logprobs of a {len(ids)}-token prompt", need),
                        headers={"Retry-After": str(max(1, round(retry_after_s)))})
                try:
                    echo_lp.append(await loop.run_in_executor(None, _prompt_logprobs, llm.model, ids, req.logprobs))
                finally:
                    if charge is not None:
                        charge.release()

        def usage():
            c = sum(r.completion_tokens for r in runs)
            p = sum(len(ids) for ids in req.prompts)
            return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

        def lp_entries(outs) -> list[tuple[int, float | None, list[tuple[int, float]] | None]]:
            return [(o.token_id, o.logprobs[0], o.logprobs[1]) for o in outs if o.logprobs is not None]

        def chat_logprobs(entries) -> dict | None:
            if req.logprobs is None:
                return None

            def item(t, lp):
                s = _token_str(tokenizer, t)
                return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8", errors="replace"))}
            return {"content": [{**item(t, lp), "top_logprobs": [item(a, b) for a, b in top or []]}
                                for t, lp, top in entries], "refusal": None}

        def comp_logprobs(entries, offset: int) -> dict | None:
            if req.logprobs is None:
                return None
            toks, lps, tops, offs = [], [], [], []
            for t, lp, top in entries:
                s = _token_str(tokenizer, t)
                toks.append(s)
                lps.append(lp)
                tops.append(None if top is None else {_token_str(tokenizer, a): b for a, b in top})
                offs.append(offset)
                offset += len(s)
            return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}

        def echo_prefix(ci: int) -> tuple[str, list]:
            pi = ci // req.n
            if not req.echo:
                return "", []
            entries = []
            if req.logprobs is not None:
                for t, e in zip(req.prompts[pi], echo_lp[pi]):
                    entries.append((t, None, None) if e is None else (t, e[0], e[1]))
            return req.prompt_texts[pi], entries

        gens = [r.deltas() for r in runs]
        try:  # request errors raise here, before any header; the choices start together
            firsts = await _firsts(gens, req.n)
        except PromptTooLongError as e:
            await _close_all(gens)
            raise APIError(400, str(e), "messages" if chat else "prompt", "context_length_exceeded") from None
        except ValueError as e:
            await _close_all(gens)
            raise APIError(400, str(e)) from None
        except BaseException:
            await _close_all(gens)
            raise

        if not req.stream:
            try:
                choices = []
                for ci, (run, g, first) in enumerate(zip(runs, gens, firsts)):
                    parts = [] if first is _DONE else [first]
                    async for d in g:
                        parts.append(d)
                    text = "".join(t for t, _ in parts)
                    entries = [e for _, outs in parts for e in lp_entries(outs)]
                    if chat:
                        choices.append({"index": ci, "message": {"role": "assistant", "content": text,
                                                                  "refusal": None},
                                        "finish_reason": run.finish_reason, "logprobs": chat_logprobs(entries)})
                    else:
                        pre, pre_entries = echo_prefix(ci)
                        choices.append({"index": ci, "text": pre + text, "finish_reason": run.finish_reason,
                                        "logprobs": comp_logprobs(pre_entries + entries, 0)})
            finally:
                await _close_all(gens)
            return web.json_response({"id": rid, "object": obj, "created": now, "model": model_name,
                                      "choices": choices, "usage": usage()})

        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"
        offsets = [0] * len(runs)

        async def send(choice: dict | None, usage_: dict | None = None) -> None:
            c = {"id": rid, "object": chunk_obj, "created": now, "model": model_name,
                 "choices": [] if choice is None else [choice]}
            if req.include_usage:
                c["usage"] = usage_
            await resp.write(b"data: " + json.dumps(c).encode() + b"\n\n")

        def choice(ci: int, delta: str | None, finish: str | None, outs=(), role: bool = False,
                   pre_entries=()) -> dict:
            entries = list(pre_entries) + lp_entries(outs)
            if chat:
                d = {} if delta is None else {"content": delta}
                if role:
                    d["role"] = "assistant"
                return {"index": ci, "delta": d, "finish_reason": finish,
                        "logprobs": chat_logprobs(entries) if entries else None}
            lp = comp_logprobs(entries, offsets[ci]) if entries else None
            offsets[ci] += len(delta or "")
            return {"index": ci, "text": delta or "", "finish_reason": finish, "logprobs": lp}

        queue: asyncio.Queue = asyncio.Queue()

        async def pump(ci: int) -> None:
            try:
                if firsts[ci] is not _DONE:
                    await queue.put((ci, firsts[ci]))
                    async for d in gens[ci]:
                        await queue.put((ci, d))
                await queue.put((ci, None))
            except BaseException as e:  # delivered to the handler, which ends the response
                await queue.put((ci, e))

        await resp.prepare(request)
        tasks: list[asyncio.Task] = []
        finished: set[int] = set()  # choices whose finish_reason was sent
        try:
            for ci in range(len(runs)):
                if chat:
                    await send(choice(ci, "", None, role=True))
                else:
                    pre, pre_entries = echo_prefix(ci)
                    if pre:
                        await send(choice(ci, pre, None, pre_entries=pre_entries))
            tasks = [asyncio.create_task(pump(ci)) for ci in range(len(runs))]
            left = len(runs)
            while left:
                ci, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    left -= 1
                    finished.add(ci)
                    await send(choice(ci, None, runs[ci].finish_reason))
                    continue
                text, outs = item
                if text or lp_entries(outs):
                    await send(choice(ci, text, None, outs))
            if req.include_usage:
                await send(None, usage())
            await resp.write(b"data: [DONE]\n\n")
        except ConnectionResetError:  # the client closed the connection between two writes
            log.debug("client of %s went away mid-stream; request aborted", rid)
        except Exception as e:  # the request failed mid-stream: the headers are out, say so in the stream
            log.exception("%s failed mid-stream", rid)
            await _stream_failed(resp, e, send, [choice(ci, None, "error") for ci in range(len(runs))
                                                  if ci not in finished], rid)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await _close_all(gens)  # client gone (write failed, handler cancelled): abort the requests
        return resp

    def json_errors(handler):
        async def wrapped(request):
            try:
                return await handler(request)
            except APIError as e:
                return e.response()
            except FieldError as e:  # a value outside the shared rules (`protocol.validate`)
                return APIError(400, str(e), e.field, "invalid_value").response()
            except web.HTTPException:
                raise
            except asyncio.CancelledError:  # the client left (handler_cancellation): an ordinary event
                log.debug("%s %s: client went away, handler cancelled", request.method, request.path)
                raise
            except ConnectionResetError:  # the client left while we read or wrote: nobody to answer
                log.debug("%s %s: client went away", request.method, request.path)
                return web.Response(status=499, text="client closed the request")
            except Exception as e:  # engine failure
                log.exception("%s %s failed", request.method, request.path)
                return APIError(500, f"internal error: {e}", type_="server_error").response()
        return wrapped

    @web.middleware
    async def http_errors_as_json(request, handler):
        """404 (unknown path), 405 (wrong method), 413 (body too large)... in OpenAI's error shape."""
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status < 400 or e.content_type == "application/json":
                raise
            headers = {k: v for k, v in e.headers.items() if k.lower() in ("allow", "www-authenticate",
                                                                          "retry-after")}
            r = _error_response(e.status, e.reason if e.text in (None, "", f"{e.status}: {e.reason}") else e.text,
                                type_="invalid_request_error" if e.status < 500 else "server_error",
                                code={404: "not_found", 405: "method_not_allowed"}.get(e.status))
            r.headers.update(headers)
            return r

    async def chat_completions(request):
        return await serve(request, True)

    async def completions(request):
        return await serve(request, False)

    app.middlewares.append(http_errors_as_json)
    app.router.add_get("/v1/models", json_errors(models))
    app.router.add_get("/openapi.json", json_errors(spec))
    app.router.add_post("/v1/chat/completions", json_errors(chat_completions))
    app.router.add_post("/v1/completions", json_errors(completions))


_DONE = object()


async def _stream_failed(resp: web.StreamResponse, e: Exception, send, finals: list[dict], rid: str) -> None:
    """End a stream whose request failed after the headers went out, as vLLM does: an error event
    `data: {"error": {"message", "type", "param", "code"}}` (vLLM's `create_streaming_error_response`;
    the `openai` client raises `APIError` on it), then a last chunk with finish_reason "error" for
    every choice still open (`finals`), then `data: [DONE]`. A client already gone is not written to."""
    err = {"error": {"message": f"internal error while generating: {type(e).__name__}: {e}",
                     "type": "server_error", "param": None, "code": 500}}
    try:
        await resp.write(b"data: " + json.dumps(err).encode() + b"\n\n")
        for c in finals:
            await send(c)
        await resp.write(b"data: [DONE]\n\n")
    except (ConnectionResetError, RuntimeError):  # the client left meanwhile (RuntimeError: transport closed)
        log.debug("client of %s went away before the stream's error event", rid)


async def _first(gen: AsyncIterator):
    """First delta of `gen` (or `_DONE`): runs `add_request`, so request errors raise here,
    before any response header is sent."""
    try:
        return await gen.__anext__()
    except StopAsyncIteration:
        return _DONE


async def _firsts(gens: list, n: int) -> list:
    """`_first` of every generator (`n` choices per prompt, choice-major per prompt): the first
    choice of every prompt runs first; once it has its first token its prompt's full KV blocks are
    in the prefix cache, so the other n - 1 choices, started then, share those blocks (ref counts)
    and compute only the prompt's last partial block: one prefill forked into n answers. On any
    error or cancellation the others are cancelled and awaited before it propagates, so that the
    generators are idle when the caller closes them."""
    if len(gens) == 1:
        return [await _first(gens[0])]
    out: list = [None] * len(gens)
    tasks: list[asyncio.Task] = []

    async def run(idx: list[int]) -> None:
        batch = [asyncio.ensure_future(_first(gens[i])) for i in idx]
        tasks.extend(batch)
        for i, v in zip(idx, await asyncio.gather(*batch)):
            out[i] = v

    try:
        await run(list(range(0, len(gens), n)))  # the first choice of each prompt
        await run([i for i in range(len(gens)) if i % n])  # the forks, on the cached prompt blocks
        return out
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _close_all(gens) -> None:
    for g in gens:
        await g.aclose()


def make_app(engine: AsyncLLMEngine, tokenizer, model_name: str, aliases: Collection[str] = ()) -> web.Application:
    """A standalone aiohttp app serving only the OpenAI routes; shuts the engine thread down on cleanup.
    Run it with `web.AppRunner(app, handler_cancellation=True)` so that requests whose client left
    are aborted (see the module docstring)."""
    app = web.Application()
    openai_routes(app, engine, tokenizer, model_name, aliases)

    async def stop(_app):
        engine.shutdown()

    app.on_cleanup.append(stop)
    return app
