"""The aiohttp routes of the OpenAI API, thin over the serving classes: read the JSON body, build
the request model, call the serving class, write its JSON or its server-sent events. Errors
(`APIError`, `FieldError`, aiohttp's 404/405/413...) are answered in OpenAI's JSON shape.

`openai_routes(app, ...)` mounts the routes on an existing app (the cloud service), `make_app(...)`
builds a standalone one. Serve either with `web.AppRunner(app, handler_cancellation=True)` so that
a request whose client left is aborted (see the package docstring).
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Awaitable, Callable, Collection

from aiohttp import web

from relayinfer.cloud.engine.llm_engine import AsyncLLMEngine
from relayinfer.cloud.serve.openai.openapi import openapi_spec
from relayinfer.cloud.serve.openai.protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body
from relayinfer.cloud.serve.openai.serving_chat import OpenAIServingChat
from relayinfer.cloud.serve.openai.serving_completion import OpenAIServingCompletion
from relayinfer.cloud.serve.openai.serving_engine import SSEStream
from relayinfer.cloud.serve.openai.serving_models import OpenAIServingModels
from relayinfer.protocol.validate import FieldError

log = logging.getLogger("relayinfer.openai")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error_response(e: APIError) -> web.Response:
    r = web.json_response(e.body(), status=e.status, headers=e.headers or None)
    if e.headers.get("Connection") == "close":
        r.force_close()  # the request's body was not read to its end: the connection cannot go on
    return r


async def read_json(request: web.Request, timeout_s: float = 60.0):
    """The request body as JSON; raises APIError(400) when it is not valid JSON, APIError(408)
    (the connection then closes) when the whole body did not arrive within `timeout_s` seconds of
    the handler's start (a client that sends its head, then trickles or stalls the body)."""
    try:
        raw = await asyncio.wait_for(request.read(), timeout_s)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s", code="request_timeout",
                       headers={"Connection": "close"}) from None
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise APIError(400, "request body is not valid JSON") from None


async def respond(request: web.Request, result: dict | SSEStream) -> web.StreamResponse:
    """A serving class's answer over HTTP: JSON for a dict, else its events as `text/event-stream`.
    A client that leaves mid-stream (a write fails, or the handler is cancelled) ends the stream,
    which aborts the requests; that is logged at debug level only."""
    if isinstance(result, dict):
        return web.json_response(result)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    try:
        await resp.prepare(request)
        try:
            async for event in result:
                await resp.write(event)
        except ConnectionResetError:  # the client closed the connection between two writes
            log.debug("client of %s went away mid-stream; request aborted", result.request_id)
    finally:
        await result.aclose()
    return resp


def json_errors(handler: Handler) -> Handler:
    """`handler` with its errors answered in OpenAI's shape: APIError as given, FieldError 400
    naming the field, any other failure 500; a client that left gets no answer."""
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except APIError as e:
            return _error_response(e)
        except FieldError as e:  # a value outside the shared rules (`protocol.validate`)
            return _error_response(APIError(400, str(e), e.field, "invalid_value"))
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
            return _error_response(APIError(500, f"internal error: {e}", type_="server_error"))
    return wrapped


@web.middleware
async def http_errors_as_json(request: web.Request, handler: Handler) -> web.StreamResponse:
    """404 (unknown path), 405 (wrong method), 413 (body too large)... in OpenAI's error shape."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400 or e.content_type == "application/json":
            raise
        headers = {k: v for k, v in e.headers.items() if k.lower() in ("allow", "www-authenticate", "retry-after")}
        message = e.reason if e.text in (None, "", f"{e.status}: {e.reason}") else e.text
        r = web.json_response(error_body(message, "invalid_request_error" if e.status < 500 else "server_error",
                                         None, {404: "not_found", 405: "method_not_allowed"}.get(e.status)),
                              status=e.status)
        r.headers.update(headers)
        return r


def openai_routes(app: web.Application, engine: AsyncLLMEngine, tokenizer, model_name: str,
                  aliases: Collection[str] = (), budget=None, retry_after_s: float = 5.0,
                  body_timeout_s: float = 60.0) -> None:
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
        body_timeout_s: seconds a request body may take to arrive in full (408 beyond, see
            `read_json`); `cloud serve` passes its `--idle-timeout-s`.
    """
    models = OpenAIServingModels(engine, model_name, aliases)
    chat = OpenAIServingChat(engine, tokenizer, models)
    completion = OpenAIServingCompletion(engine, tokenizer, models, budget, retry_after_s)

    async def show_models(request: web.Request) -> web.Response:
        return web.json_response(models.show_available_models())

    async def spec(request: web.Request) -> web.Response:
        return web.json_response(openapi_spec(models.model_name))

    # a request is parsed on a worker thread: its structured-output field is compiled there (a
    # schema of hundreds of fields takes ~0.1 s), while the loop streams the other answers
    async def chat_completions(request: web.Request) -> web.StreamResponse:
        body = await read_json(request, body_timeout_s)
        req = await asyncio.to_thread(ChatCompletionRequest.from_json, body, models.served)
        return await respond(request, await chat.create_chat_completion(req))

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await read_json(request, body_timeout_s)
        req = await asyncio.to_thread(CompletionRequest.from_json, body, models.served)
        return await respond(request, await completion.create_completion(req))

    app.middlewares.append(http_errors_as_json)
    app.router.add_get("/v1/models", json_errors(show_models))
    app.router.add_get("/openapi.json", json_errors(spec))
    app.router.add_post("/v1/chat/completions", json_errors(chat_completions))
    app.router.add_post("/v1/completions", json_errors(completions))


def make_app(engine: AsyncLLMEngine, tokenizer, model_name: str, aliases: Collection[str] = ()) -> web.Application:
    """A standalone aiohttp app serving only the OpenAI routes; shuts the engine thread down on cleanup.
    Run it with `web.AppRunner(app, handler_cancellation=True)` so that requests whose client left
    are aborted (see the package docstring)."""
    app = web.Application()
    openai_routes(app, engine, tokenizer, model_name, aliases)

    async def stop(_app):
        engine.shutdown()

    app.on_cleanup.append(stop)
    return app
