"""`OpenAIServingChat`: `/v1/chat/completions` without HTTP. The messages go through the model's
chat template; the answer is `choices[].message` (or, streamed, a first chunk with the role and
then `delta`s), with OpenAI's `logprobs.content[]` entries when asked."""
from __future__ import annotations

from relayinfer.cloud.serve.openai.protocol import APIError, ChatCompletionRequest
from relayinfer.cloud.serve.openai.structured import Tools
from relayinfer.cloud.serve.openai.serving_engine import ChoiceFormat, Entry, OpenAIServing, SSEStream, token_str


class OpenAIServingChat(OpenAIServing):
    """Chat completions over the engine (see `OpenAIServing` for the arguments)."""

    request_id_prefix = "chatcmpl"
    response_object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    prompt_field = "messages"

    async def create_chat_completion(self, req: ChatCompletionRequest) -> dict | SSEStream:
        """The answer to `req`: the `chat.completion` dict, or for `req.stream` the `SSEStream` of
        `chat.completion.chunk` events (the caller must `aclose()` it).

        Raises:
            APIError: 400 for messages the template refuses, a request that cannot fit
                (`context_length_exceeded`) or `ignore_eos` on the P/D gateway; any other request
                error of the engine, before anything is answered.
            FieldError: `min_tokens` above the default `max_tokens` that fits.
        """
        try:
            ids = self.tokenizer.encode_chat(list(req.messages))
        except (TypeError, ValueError) as e:
            raise APIError(400, f"invalid 'messages': {e}", "messages", "invalid_value") from None
        self._check_engine(req)
        rid, created = self._new_id()
        choices = await self._choices(req, [ids], rid, ["messages"])
        return await self._respond(req, choices, _ChatFormat(self.tokenizer, req.logprobs is not None, req.tools),
                                   rid, created)


class _ChatFormat(ChoiceFormat):
    """Chat's choices: `message` / `delta` (the role in each choice's first chunk) and logprobs
    `{"content": [{"token", "logprob", "bytes", "top_logprobs"}], "refusal": None}`.

    With `tools`, an answer that is a call in `structured.TOOL_FORMAT` comes back as `tool_calls`
    (content null, finish_reason "tool_calls"). Streamed, text that may be a call (it starts with
    '{' or '[') is held until the answer ends: then one delta carries the whole `tool_calls`
    (`index`, `id`, `type`, `function` with its complete `arguments`), or the held text as
    content; text that cannot be a call streams as it comes."""

    def __init__(self, tokenizer, logprobs: bool, tools: Tools | None = None):
        self.tok, self.logprobs, self.tools = tokenizer, logprobs, tools
        self.held: dict[int, str] = {}  # streamed text held back per choice while it may be a call
        self.free: set[int] = set()  # choices whose text cannot be a call

    def opening(self, ci: int) -> dict:
        return {"index": ci, "delta": {"content": "", "role": "assistant"}, "finish_reason": None, "logprobs": None}

    def _calls(self, text: str, finish: str) -> list[dict] | None:
        return self.tools.calls(text) if self.tools is not None and finish == "stop" else None

    def full(self, ci: int, text: str, entries: list[Entry], finish: str) -> dict:
        calls = self._calls(text, finish)
        message = {"role": "assistant", "content": None if calls else text, "refusal": None}
        if calls:
            message["tool_calls"] = calls
        return {"index": ci, "message": message, "finish_reason": "tool_calls" if calls else finish,
                "logprobs": self._logprobs(entries)}

    def delta(self, ci: int, text: str | None, finish: str | None, entries: list[Entry]) -> dict | None:
        d: dict = {} if text is None else {"content": text}
        if self.tools is not None and ci not in self.free:
            held = self.held.get(ci, "") + (text or "")
            if held.strip() and held.lstrip()[0] not in "{[":
                self.free.add(ci)
                self.held.pop(ci, None)
                d = {"content": held}
            else:
                self.held[ci], d = held, {}
                if finish is not None:
                    calls = self._calls(self.held.pop(ci), finish)
                    if calls:
                        d, finish = {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}, "tool_calls"
                    elif held:
                        d = {"content": held}
        if not d and finish is None and not (entries and self.logprobs):
            return None  # text held back (a tool call in the making): nothing to send yet
        return {"index": ci, "delta": d, "finish_reason": finish,
                "logprobs": self._logprobs(entries) if entries else None}

    def _logprobs(self, entries: list[Entry]) -> dict | None:
        if not self.logprobs:
            return None

        def item(t: int, lp: float | None) -> dict:
            s = token_str(self.tok, t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8", errors="replace"))}
        return {"content": [{**item(t, lp), "top_logprobs": [item(a, b) for a, b in top or []]}
                            for t, lp, top in entries], "refusal": None}
