"""`OpenAIServing`, the base of the chat and completion serving classes: admission, the choices of
one request started together, token-to-text streaming (`TextRun`), usage, and the two ways out: a
whole response (a JSON-ready dict) or an `SSEStream` of server-sent events.

A serving class knows no HTTP: it takes a checked request model (`protocol.py`), raises `APIError`
before anything is answered, and returns what the routes (`api_server.py`) write. How a choice
looks (chat's `message`/`delta` or a completion's `text`, the logprobs layout) is a
`ChoiceFormat` the subclass gives per request.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import AsyncIterator, Sequence

from relayinfer.cloud.engine.llm_engine import AsyncLLMEngine
from relayinfer.cloud.serve.openai.protocol import APIError, GenerationRequest, error_body, unsupported
from relayinfer.cloud.serve.openai.serving_models import OpenAIServingModels
from relayinfer.protocol.model.decoding import SamplingParams
from relayinfer.protocol.model.grammar import GrammarError, Guide
from relayinfer.protocol.model.errors import PromptTooLongError

log = logging.getLogger("relayinfer.openai")

_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "budget": "length", "abort": "stop"}
_DONE = object()
DONE_EVENT = b"data: [DONE]\n\n"

# (token id, its logprob or None, [(id, logprob)] of the top alternatives or None) of one token
Entry = tuple[int, float | None, list[tuple[int, float]] | None]


def sse_event(obj: dict) -> bytes:
    """One server-sent event `data: <obj as JSON>` and its blank line."""
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def token_str(tokenizer, tid: int) -> str:
    """The text of token `tid` alone (its bytes, invalid UTF-8 replaced; a control token's name)."""
    b = tokenizer.token_bytes(tid)
    return b.decode("utf-8", errors="replace") if b else tokenizer.decode([tid])


def lp_entries(outs) -> list[Entry]:
    """The logprob entries of the `StepOutput`s `outs` that carry logprobs."""
    return [(o.token_id, o.logprobs[0], o.logprobs[1]) for o in outs if o.logprobs is not None]


def check_first_token(grammar, tokenizer, field: str) -> None:
    """Raises APIError(400) naming `field` when `grammar` allows no first token of this model's
    vocabulary (e.g. a regex whose only text is a control token's, which ends answers), before any
    engine work: the request could only fail mid-answer."""
    try:
        ok = Guide(grammar, tokenizer).allowed([]).any()
    except GrammarError as e:
        raise APIError(400, str(e).replace("grammar must", f"{field} must", 1), field, "invalid_value") from None
    if not ok:
        raise APIError(400, f"{field}: no token of this model can begin an answer under it (a text that only a "
                       "control token spells, such as the end-of-turn marker, cannot be written)", field,
                       "invalid_value")


def ends_silently(o, params: SamplingParams) -> bool:
    """True for a token that ends the answer and adds no text: EOS, or a `stop_token_ids` id (a
    token that completes the grammar ends the answer with 'stop' and is part of it)."""
    return o.finish_reason == "eos" or (o.finish_reason == "stop" and o.token_id in params.stop_ids)


class TextRun:
    """One choice's token stream turned into text deltas, with stop strings cut out.

    Text that could be the start of a stop string is held back until it is not (so a streamed
    answer never shows part of a stop string). A token that ends the answer as EOS or as a
    `stop_token_ids` id adds no text. `deltas()` yields (text, [StepOutput of the tokens behind it]);
    afterwards `finish_reason` is OpenAI's ("stop" or "length") and `completion_tokens` counts the
    tokens the engine generated.
    """

    def __init__(self, engine: AsyncLLMEngine, tokenizer, request_id: str, ids: Sequence[int],
                 params: SamplingParams, stops: Sequence[str], ignore_eos: bool = False):
        self.engine, self.tok, self.request_id = engine, tokenizer, request_id
        self.ids, self.params, self.stops, self.ignore_eos = list(ids), params, list(stops), ignore_eos
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.finish_reason = "length"
        self.completion_tokens = 0
        self.cached_tokens = 0  # prompt tokens taken from the prefix cache (the engine's request_stats)

    async def deltas(self) -> AsyncIterator[tuple[str, list]]:
        """The answer's text in pieces, each with the `StepOutput`s behind it; the first
        `__anext__` adds the request to the engine (request errors raise there)."""
        dec = self.tok.stream_decoder()
        text, sent, pending = "", 0, []
        kw = {"ignore_eos": True} if self.ignore_eos else {}  # only AsyncLLMEngine takes it (checked before)
        async for o in self.engine.generate(self.request_id, self.ids, self.params, **kw):
            if not self.completion_tokens:
                stats = self.engine.request_stats(self.request_id)
                self.cached_tokens = stats.prefix_hit_tokens if stats is not None else 0
            self.completion_tokens += 1
            pending.append(o)
            if not ends_silently(o, self.params):
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


class Choices:
    """The choices of one request: `n` per prompt, choice-major per prompt (choice index =
    prompt * n + j), each a `TextRun` and its delta generator. `start()` starts them together;
    `aclose()` leaves every generator, which aborts what still runs in the engine."""

    def __init__(self, runs: list[TextRun], n: int, prompts: list[list[int]]):
        self.runs, self.n, self.prompts = runs, n, prompts
        self.gens = [r.deltas() for r in runs]
        self.firsts: list = []

    def __len__(self) -> int:
        """The number of choices (prompts x n)."""
        return len(self.runs)

    async def start(self) -> None:
        """Every choice's first delta (see `_firsts`): request errors raise here."""
        self.firsts = await _firsts(self.gens, self.n)

    async def deltas(self, ci: int) -> AsyncIterator[tuple[str, list]]:
        """Choice `ci`'s deltas from its first one on (after `start`)."""
        if self.firsts[ci] is not _DONE:
            yield self.firsts[ci]
            async for d in self.gens[ci]:
                yield d

    def usage(self) -> dict:
        """OpenAI's usage: each prompt counted once, every choice's generated tokens, and in
        `prompt_tokens_details.cached_tokens` the prompt tokens of each prompt's first choice that
        came from the prefix cache."""
        c = sum(r.completion_tokens for r in self.runs)
        p = sum(len(ids) for ids in self.prompts)
        cached = sum(r.cached_tokens for r in self.runs[::self.n])
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": cached}}

    async def aclose(self) -> None:
        """Leave every choice's generator (idempotent): what still runs is aborted in the engine."""
        for g in self.gens:
            await g.aclose()


class ChoiceFormat:
    """How the choices of one request look; the chat and completion serving classes subclass it."""

    def opening(self, ci: int) -> dict | None:
        """The streamed choice sent for choice `ci` before its first token (or None)."""
        return None

    def full(self, ci: int, text: str, entries: list[Entry], finish: str) -> dict:
        """Choice `ci` of a whole response: its `text`, logprob `entries` and finish reason."""
        raise NotImplementedError

    def delta(self, ci: int, text: str | None, finish: str | None, entries: list[Entry]) -> dict | None:
        """One streamed piece of choice `ci`: new `text` (None: none) and its `entries`, or its
        `finish` reason (None while it runs; "error" when the request failed); None when there is
        nothing to send yet (text held back)."""
        raise NotImplementedError


class SSEStream:
    """The server-sent events of a streamed request (bytes: `data: {chunk}` events, then
    `data: [DONE]`). Iterate it once; `aclose()` (always, also when not iterated) ends the
    generation and aborts what still runs in the engine."""

    def __init__(self, request_id: str, events: AsyncIterator[bytes], choices: Choices):
        self.request_id, self._events, self._choices = request_id, events, choices

    def __aiter__(self) -> AsyncIterator[bytes]:
        """The events, each `bytes` ready to write."""
        return self._events

    async def aclose(self) -> None:
        """End the events and leave every choice's generator (idempotent)."""
        await self._events.aclose()
        await self._choices.aclose()


class OpenAIServing:
    """What the chat and completion serving classes share.

    Args:
        engine: the `AsyncLLMEngine` (or the P/D gateway behind its interface); its `engine`
            attribute gives `max_model_len`, `check_fits`, `cfg` and `model`.
        tokenizer: `relayinfer.protocol.model.tokenizer.Tokenizer` of the served model.
        models: the served model (`OpenAIServingModels`): the id answers carry.
    """

    request_id_prefix = "cmpl"
    response_object = "text_completion"
    chunk_object = "text_completion"
    prompt_field = "prompt"

    def __init__(self, engine: AsyncLLMEngine, tokenizer, models: OpenAIServingModels):
        self.engine, self.tokenizer, self.models = engine, tokenizer, models
        self.llm = engine.engine

    def _check_engine(self, req: GenerationRequest) -> None:
        """Raises APIError(400) for what only the batching engine does (`ignore_eos`)."""
        if req.ignore_eos and not isinstance(self.engine, AsyncLLMEngine):
            raise unsupported("ignore_eos", "not on the P/D gateway")

    def _new_id(self) -> tuple[str, int]:
        """A fresh response id and its creation time (Unix seconds)."""
        return f"{self.request_id_prefix}-{uuid.uuid4().hex}", int(time.time())

    async def _choices(self, req: GenerationRequest, prompts: list[list[int]], rid: str,
                       params: list[str]) -> Choices:
        """The `req.n` choices of every prompt (`params[i]`: the field naming prompt i), each
        admitted: raises APIError(400, `context_length_exceeded`) when one cannot fit. A grammar
        is checked (and compiled, for the engine to copy) on a worker thread, so the other
        requests' streams go on meanwhile."""
        if req.grammar is not None:
            await asyncio.to_thread(check_first_token, req.grammar, self.tokenizer, req.grammar_field or "grammar")
        runs: list[TextRun] = []
        for i, ids in enumerate(prompts):
            for j in range(req.n):
                p = req.to_sampling_params(len(ids), self.llm.max_model_len, j)
                try:
                    self.llm.check_fits(len(ids), p.max_new_tokens)
                except PromptTooLongError as e:
                    raise APIError(400, f"{e} (max_tokens {p.max_new_tokens})", params[i],
                                   "context_length_exceeded") from None
                runs.append(TextRun(self.engine, self.tokenizer, f"{rid}-{len(runs)}", ids, p, req.stop,
                                    req.ignore_eos))
        return Choices(runs, req.n, prompts)

    async def _respond(self, req: GenerationRequest, choices: Choices, fmt: ChoiceFormat, rid: str,
                       created: int) -> dict | SSEStream:
        """Start the choices (request errors raise here as APIError, before any answer), then the
        whole response or, for `req.stream`, its `SSEStream`."""
        try:
            await choices.start()
        except PromptTooLongError as e:
            await choices.aclose()
            raise APIError(400, str(e), self.prompt_field, "context_length_exceeded") from None
        except ValueError as e:
            await choices.aclose()
            raise APIError(400, str(e)) from None
        except BaseException:
            await choices.aclose()
            raise
        head = {"id": rid, "object": self.response_object, "created": created, "model": self.models.model_name}
        if not req.stream:
            return await self._full(head, choices, fmt)
        head["object"] = self.chunk_object
        return SSEStream(rid, self._events(head, req, choices, fmt), choices)

    async def _full(self, head: dict, choices: Choices, fmt: ChoiceFormat) -> dict:
        """The whole response: every choice's text, logprobs and finish reason, and the usage."""
        try:
            out = []
            for ci, run in enumerate(choices.runs):
                parts = [d async for d in choices.deltas(ci)]
                text = "".join(t for t, _ in parts)
                out.append(fmt.full(ci, text, [e for _, outs in parts for e in lp_entries(outs)], run.finish_reason))
        finally:
            await choices.aclose()
        return {**head, "choices": out, "usage": choices.usage()}

    async def _events(self, head: dict, req: GenerationRequest, choices: Choices,
                      fmt: ChoiceFormat) -> AsyncIterator[bytes]:
        """The streamed response: per choice its opening, then deltas as they come (choices
        interleaved), its finish reason, the usage (`stream_options.include_usage`), `[DONE]`.
        A request that fails meanwhile ends with `_failed`'s events instead."""
        def chunk(choice: dict | None, usage: dict | None = None) -> bytes:
            c = {**head, "choices": [] if choice is None else [choice]}
            if req.include_usage:
                c["usage"] = usage
            return sse_event(c)

        queue: asyncio.Queue = asyncio.Queue()
        tasks: list[asyncio.Task] = []
        finished: set[int] = set()  # choices whose finish_reason was sent
        try:
            for ci in range(len(choices)):
                c = fmt.opening(ci)
                if c is not None:
                    yield chunk(c)
            tasks = [asyncio.create_task(_pump(choices, ci, queue)) for ci in range(len(choices))]
            left = len(choices)
            while left:
                ci, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    left -= 1
                    finished.add(ci)
                    yield chunk(fmt.delta(ci, None, choices.runs[ci].finish_reason, []))
                    continue
                text, outs = item
                if text or lp_entries(outs):
                    c = fmt.delta(ci, text, None, lp_entries(outs))
                    if c is not None:
                        yield chunk(c)
            if req.include_usage:
                yield chunk(None, choices.usage())
            yield DONE_EVENT
        except Exception as e:  # the request failed mid-stream: the headers are out, say so in the stream
            log.exception("%s failed mid-stream", head["id"])
            finals = [chunk(fmt.delta(ci, None, "error", [])) for ci in range(len(choices)) if ci not in finished]
            if req.include_usage:  # the tokens generated up to the failure
                finals.append(chunk(None, choices.usage()))
            for event in _failed(e, finals):
                yield event
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await choices.aclose()  # client gone (write failed, handler cancelled): abort the requests


async def _pump(choices: Choices, ci: int, queue: asyncio.Queue) -> None:
    """Put choice `ci`'s deltas on `queue` as (ci, delta), then (ci, None), or (ci, the exception)."""
    try:
        async for d in choices.deltas(ci):
            await queue.put((ci, d))
        await queue.put((ci, None))
    except BaseException as e:  # delivered to the stream, which ends the response
        await queue.put((ci, e))


def _failed(e: Exception, finals: list[bytes]) -> list[bytes]:
    """The end of a stream whose request failed after the headers went out, as vLLM's: an error
    event `data: {"error": {"message", "type", "param", "code"}}` (vLLM's
    `create_streaming_error_response`; the `openai` client raises `APIError` on it), then a last
    chunk with finish_reason "error" for every choice still open and, with `include_usage`, the
    usage so far (`finals`), then `data: [DONE]`."""
    err = error_body(f"internal error while generating: {type(e).__name__}: {e}", "server_error", None, 500)
    return [sse_event(err), *finals, DONE_EVENT]


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
