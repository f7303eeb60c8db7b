"""OpenAI-compatible HTTP API on aiohttp over the batching engine (`AsyncLLMEngine`).

Routes (https://platform.openai.com/docs/api-reference): `POST /v1/chat/completions`,
`POST /v1/completions` (both non-streaming JSON or streaming server-sent events, `data: {chunk}`
lines ending with `data: [DONE]`) and `GET /v1/models`. Request fields: model, messages / prompt,
temperature (default 1.0, as OpenAI), top_p, max_tokens (or max_completion_tokens), stop (string
or list of up to 4 strings, matched on the decoded text and cut from the answer), seed, stream,
stream_options.include_usage, n (only 1). Errors use OpenAI's shape
`{"error": {"message", "type", "param", "code"}}` with status 400 (invalid request, prompt too
long), 404 (unknown model) or 500 (engine failure).

Use `openai_routes(app, engine, tokenizer, model_name)` to mount the routes on an existing app
(the cloud service), or `make_app(...)` for a standalone server.

Client disconnects: serve the app with `web.AppRunner(app, handler_cancellation=True)` (the cloud
service does): aiohttp >= 3.9 otherwise lets a handler run on after its client left. A cancelled
handler leaves the engine's generator, which aborts the request at the engine's next step and
frees its KV blocks, before the headers (queued or prefilling) or after them (streaming), streamed
or not. A write to a connection the client closed ends the request the same way. Either is an
ordinary event, logged at debug level only.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import AsyncIterator, Collection

from aiohttp import web

from relayinfer.cloud.engine.llm_engine import AsyncLLMEngine
from relayinfer.protocol.checks import check_prompt_text
from relayinfer.protocol.decoding import SamplingParams
from relayinfer.protocol.errors import PromptTooLongError

log = logging.getLogger("relayinfer.openai")

DEFAULT_MAX_TOKENS = 256
_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "budget": "length", "abort": "stop"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def response(self) -> web.Response:
        return web.json_response({"error": {"message": self.message, "type": self.type, "param": self.param,
                                            "code": self.code}}, status=self.status)


def _number(body: dict, name: str, default, lo: float, hi: float, integer: bool = False):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise APIError(400, f"'{name}' must be a {'integer' if integer else 'number'}", name, "invalid_type")
    if not lo <= v <= hi:
        raise APIError(400, f"'{name}' must be between {lo} and {hi}, got {v}", name, "invalid_value")
    return v


def _require_text(body: dict, chat: bool) -> None:
    """The one rule for empty input of every entry point (`protocol.checks.check_prompt_text`): a
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


def _parse_common(body: dict, model_name: str, chat: bool = True,
                  aliases: Collection[str] = ()) -> tuple[SamplingParams, list[str], bool, bool]:
    """SamplingParams, stop strings, stream flag, include_usage from an OpenAI request body.
    `model` may be omitted (the served model, as llama.cpp's server does), `model_name` or one of
    its `aliases` (the GGUF file's name)."""
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_name and model not in aliases:
        known = ", ".join(repr(m) for m in (model_name, *aliases))
        raise APIError(404, f"The model '{model}' does not exist; this server serves {known} (or leave 'model' out)",
                       "model", "model_not_found")
    _require_text(body, chat)
    if _number(body, "n", 1, 1, 1, integer=True) != 1:
        raise APIError(400, "only n=1 is supported", "n")
    temperature = float(_number(body, "temperature", 1.0, 0.0, 2.0))
    top_p = float(_number(body, "top_p", 1.0, 0.0, 1.0))
    if top_p == 0:
        raise APIError(400, "'top_p' must be > 0", "top_p", "invalid_value")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = _number({"max_tokens": max_tokens}, "max_tokens", DEFAULT_MAX_TOKENS, 1, 1 << 20, integer=True)
    seed = _number(body, "seed", None, -(1 << 63), (1 << 63) - 1, integer=True)
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise APIError(400, "'stop' must be a non-empty string or a list of up to 4 of them", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, "'stream' must be a boolean", "stream", "invalid_type")
    opts = body.get("stream_options") or {}
    include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=None if seed is None else abs(seed),
                            max_new_tokens=max_tokens)
    return params, stops, stream, include_usage


class _TextRun:
    """One request's token stream turned into text deltas, with stop strings cut out.

    Text that could be the start of a stop string is held back until it is not (so a streamed
    answer never shows part of a stop string)."""

    def __init__(self, engine: AsyncLLMEngine, tokenizer, request_id: str, ids: list[int],
                 params: SamplingParams, stops: list[str]):
        self.engine, self.tok, self.request_id = engine, tokenizer, request_id
        self.ids, self.params, self.stops = ids, params, stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.finish_reason = "length"
        self.completion_tokens = 0

    async def deltas(self) -> AsyncIterator[str]:
        dec = self.tok.stream_decoder()
        text, sent = "", 0
        eos = self.tok.eos_id
        async for o in self.engine.generate(self.request_id, self.ids, self.params):
            self.completion_tokens += 1
            if o.token_id != eos:
                text += dec.push(o.token_id)
            if self.stops:
                hits = [i for i in (text.find(s, max(0, sent - self.hold)) for s in self.stops) if i >= 0]
                if hits:
                    cut = min(hits)
                    if cut > sent:
                        yield text[sent:cut]
                    self.finish_reason = "stop"
                    return  # leaving the engine's generator aborts the request
            if o.finish_reason is not None:
                self.finish_reason = _FINISH.get(o.finish_reason, "stop")
                if len(text) > sent:
                    yield text[sent:]
                return
            safe = len(text) - self.hold
            if safe > sent:
                yield text[sent:safe]
                sent = safe


def openai_routes(app: web.Application, engine: AsyncLLMEngine, tokenizer, model_name: str,
                  aliases: Collection[str] = ()) -> None:
    """Add `/v1/chat/completions`, `/v1/completions` and `/v1/models` to `app`.

    Args:
        engine: the `AsyncLLMEngine` (started lazily inside the app's event loop).
        tokenizer: `relayinfer.protocol.tokenizer.Tokenizer` of the served model (chat template).
        model_name: the id that `/v1/models` lists and answers carry; requests may send it as
            `model`, one of `aliases` (e.g. the GGUF file's name), or no `model` at all.
    """
    created = int(time.time())

    async def read_json(request: web.Request) -> dict:
        try:
            return await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise APIError(400, "request body is not valid JSON") from None

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": created, "owned_by": "relayinfer"}]})

    async def serve(request: web.Request, chat: bool) -> web.StreamResponse:
        body = await read_json(request)
        params, stops, stream, include_usage = _parse_common(body, model_name, chat, aliases)
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise APIError(400, "'messages' must be a non-empty list", "messages", "missing_required_parameter")
            try:
                msgs = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
                         "".join(p.get("text", "") for p in m["content"])} for m in msgs]
                ids = tokenizer.encode_chat(msgs)
            except (KeyError, TypeError, AttributeError, ValueError) as e:
                raise APIError(400, f"invalid 'messages': {e}", "messages") from None
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if isinstance(prompt, str) and prompt:
                ids = tokenizer.encode(prompt)
            elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                             for t in prompt):
                ids = list(prompt)
            else:
                raise APIError(400, "'prompt' must be a non-empty string or list of token ids", "prompt")
            if not ids or max(ids) >= engine.engine.cfg.vocab_size or min(ids) < 0:
                raise APIError(400, "'prompt' has no tokens or an out-of-range token id", "prompt")
        prefix = "chatcmpl" if chat else "cmpl"
        run = _TextRun(engine, tokenizer, f"{prefix}-{uuid.uuid4().hex}", ids, params, stops)
        try:
            gen = run.deltas()
            first = await _first(gen)
        except PromptTooLongError as e:
            raise APIError(400, str(e), "messages" if chat else "prompt", "context_length_exceeded") from None
        except ValueError as e:
            raise APIError(400, str(e)) from None
        rid, now = run.request_id, int(time.time())
        obj = "chat.completion" if chat else "text_completion"

        def usage():
            return {"prompt_tokens": len(ids), "completion_tokens": run.completion_tokens,
                    "total_tokens": len(ids) + run.completion_tokens}

        if not stream:
            parts = [] if first is _DONE else [first]
            async for d in gen:
                parts.append(d)
            text = "".join(parts)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                       "finish_reason": run.finish_reason, "logprobs": None} if chat else
                      {"index": 0, "text": text, "finish_reason": run.finish_reason, "logprobs": None})
            return web.json_response({"id": rid, "object": obj, "created": now, "model": model_name,
                                      "choices": [choice], "usage": usage()})

        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        async def send(choice: dict | None, usage_: dict | None = None) -> None:
            c = {"id": rid, "object": chunk_obj, "created": now, "model": model_name,
                 "choices": [] if choice is None else [choice]}
            if usage_ is not None or include_usage:
                c["usage"] = usage_
            await resp.write(b"data: " + json.dumps(c).encode() + b"\n\n")

        def choice(delta: str | None, finish: str | None, role: bool = False) -> dict:
            if chat:
                d = {} if delta is None else {"content": delta}
                if role:
                    d["role"] = "assistant"
                return {"index": 0, "delta": d, "finish_reason": finish, "logprobs": None}
            return {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}

        try:
            if chat:
                await send(choice("", None, role=True))
            if first is not _DONE:
                await send(choice(first, None))
                async for d in gen:
                    await send(choice(d, None))
            await send(choice(None, run.finish_reason))
            if include_usage:
                await send(None, usage())
            await resp.write(b"data: [DONE]\n\n")
        except ConnectionResetError:  # the client closed the connection between two writes
            log.debug("client of %s went away mid-stream; request aborted", rid)
        finally:
            await gen.aclose()  # client gone (write failed, handler cancelled): abort the request
        return resp

    def json_errors(handler):
        async def wrapped(request):
            try:
                return await handler(request)
            except APIError as e:
                return e.response()
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

    async def chat_completions(request):
        return await serve(request, True)

    async def completions(request):
        return await serve(request, False)

    app.router.add_get("/v1/models", json_errors(models))
    app.router.add_post("/v1/chat/completions", json_errors(chat_completions))
    app.router.add_post("/v1/completions", json_errors(completions))


_DONE = object()


async def _first(gen: AsyncIterator[str]):
    """First delta of `gen` (or `_DONE`): runs `add_request`, so request errors raise here,
    before any response header is sent."""
    try:
        return await gen.__anext__()
    except StopAsyncIteration:
        return _DONE


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
