"""OpenAI-compatible HTTP API on aiohttp over the batching engine (`AsyncLLMEngine`), laid out
as vLLM's `entrypoints/openai`:

- `protocol.py`: the request models `ChatCompletionRequest` / `CompletionRequest` (checked from
  the JSON body, `to_sampling_params` per choice) and `APIError`;
- `serving_engine.py`: `OpenAIServing`, the base of the serving classes (admission, choices,
  token-to-text streaming, logprobs layout hooks, usage, server-sent events);
- `serving_chat.py`, `serving_completion.py`, `serving_models.py`: `OpenAIServingChat`,
  `OpenAIServingCompletion`, `OpenAIServingModels`, each callable without HTTP;
- `api_server.py`: the thin aiohttp routes, `openai_routes(...)` and `make_app(...)`;
- `openapi.py`: the OpenAPI 3.1 description served at `GET /openapi.json`.

Routes (https://platform.openai.com/docs/api-reference): `POST /v1/chat/completions`,
`POST /v1/completions` (both non-streaming JSON or streaming server-sent events, `data: {chunk}`
lines ending with `data: [DONE]`), `GET /v1/models` (with `max_model_len`, the most prompt +
answer tokens one request can hold) and `GET /openapi.json`. Every request field of OpenAI's API is
either implemented or refused with a 400 naming it; docs/SERVING.md's "OpenAI API" table lists each
one and any difference from OpenAI/vLLM. Errors use OpenAI's shape `{"error": {"message", "type",
"param", "code"}}` with status 400 (invalid request, prompt too long: code
`context_length_exceeded`), 404 (unknown model, unknown path), 405 (wrong method), 503 (echo
logprobs that do not fit the memory budget) or 500 (engine failure); no request body can cause a
5xx. Every number is checked once, by the shared rules of `relayinfer.protocol.validate` (400 with
`param` naming the field and the allowed range in the message). A stream whose request fails after
its headers ends with an error event in vLLM's shape, a last chunk per open choice with
finish_reason "error", and `data: [DONE]`.

Text: one incremental detokenizer (`Tokenizer.stream_decoder`) per choice; control tokens (EOS,
`<|im_end|>`, a `stop_token_ids` id) add no text, a character cut by `max_tokens` is dropped, and
stop strings are held back while they may still match, so the streamed deltas join to the
non-streamed text. Logprobs are the log-softmax of the model's full-vocabulary logits (not changed by
temperature, top_p/top_k, penalties or logit_bias; vLLM's default `raw_logprobs`).

Client disconnects: serve the app with `web.AppRunner(app, handler_cancellation=True)` (the cloud
service does): aiohttp >= 3.9 otherwise lets a handler run on after its client left. A cancelled
handler leaves the engine's generators, which aborts the requests at the engine's next step and
frees their KV blocks, before the headers (queued or prefilling) or after them (streaming), streamed
or not. A write to a connection the client closed ends the requests the same way. Either is an
ordinary event, logged at debug level only.
"""
