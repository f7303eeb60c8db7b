"""OpenAPI 3.1 description of the OpenAI-compatible routes, served at `GET /openapi.json`.

Written from OpenAI's published API description (https://github.com/openai/openai-openapi),
restricted to what this server implements: request fields it refuses with a 400 (tools,
response_format other than text, images...) are absent, and ranges are ours where they differ
(`n` and `best_of` up to 16, `top_logprobs` and completions' `logprobs` up to 20, as vLLM). vLLM's
extensions `top_k`, `min_tokens`, `repetition_penalty` and `stop_token_ids` are included. The
schemathesis test in `tests/test_openai_conformance.py` checks every response against it.
"""
from __future__ import annotations

from typing import Any

from relayinfer.protocol.validate import MAX_TOKENS, MAX_TOP_K

_NUM = {"type": ["number", "null"]}
_INT = {"type": ["integer", "null"]}


def _range(schema: dict, lo=None, hi=None) -> dict:
    s = dict(schema)
    if lo is not None:
        s["minimum"] = lo
    if hi is not None:
        s["maximum"] = hi
    return s


def _error() -> dict:
    return {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}


def _usage() -> dict:
    return {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
            "properties": {k: {"type": "integer", "minimum": 0} for k in
                           ("prompt_tokens", "completion_tokens", "total_tokens")}}


def _common(model_name: str) -> dict:
    stop = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 4},
                      {"type": "null"}]}
    return {
        "model": {"type": "string", "enum": [model_name]},
        "temperature": _range(_NUM, 0, 2), "top_p": _range(_NUM, 0, 1),
        "top_k": _range(_INT, -1, MAX_TOP_K), "n": _range(_INT, 1, 16),
        "max_tokens": _range(_INT, 1, MAX_TOKENS), "seed": _range(_INT, -(1 << 63), (1 << 63) - 1),
        "stop": stop, "stream": {"type": ["boolean", "null"]},
        "stream_options": {"oneOf": [{"type": "object", "properties": {"include_usage": {"type": "boolean"}},
                                      "additionalProperties": False},
                                     {"type": "null"}]},
        "presence_penalty": _range(_NUM, -2, 2), "frequency_penalty": _range(_NUM, -2, 2),
        "repetition_penalty": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 2},
        "min_tokens": _range(_INT, 0, MAX_TOKENS),
        "stop_token_ids": {"oneOf": [{"type": "array", "maxItems": 64, "items": {"type": "integer", "minimum": 0,
                                                                                       "maximum": 49151}},
                                     {"type": "null"}]},
        "logit_bias": {"oneOf": [{"type": "object", "maxProperties": 300,
                                  "propertyNames": {"pattern": "^[0-9]{1,9}$"},
                                  "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
                                 {"type": "null"}]},
        "user": {"type": ["string", "null"]},
        "ignore_eos": {"type": ["boolean", "null"]},
    }


def _logprob_item() -> dict:
    return {"type": "object", "required": ["token", "logprob", "bytes"],
            "properties": {"token": {"type": "string"}, "logprob": {"type": "number", "maximum": 0},
                           "bytes": {"type": ["array", "null"], "items": {"type": "integer"}}}}


def _chat_logprobs() -> dict:
    item = _logprob_item()
    item = {**item, "required": item["required"] + ["top_logprobs"],
            "properties": {**item["properties"], "top_logprobs": {"type": "array", "items": _logprob_item()}}}
    return {"type": ["object", "null"], "required": ["content"],
            "properties": {"content": {"type": ["array", "null"], "items": item},
                           "refusal": {"type": ["array", "null"]}}}


def _comp_logprobs() -> dict:
    return {"type": ["object", "null"], "properties": {
        "tokens": {"type": "array", "items": {"type": "string"}},
        "token_logprobs": {"type": "array", "items": {"type": ["number", "null"]}},
        "top_logprobs": {"type": "array", "items": {"type": ["object", "null"],
                                                    "additionalProperties": {"type": "number"}}},
        "text_offset": {"type": "array", "items": {"type": "integer"}}}}


_FINISH = {"type": "string", "enum": ["stop", "length"]}


def _response(obj: str, key: str, content: dict, logprobs: dict) -> dict:
    """A whole (non-streamed) response of object type `obj` whose choices hold `key` (`content`'s
    schema) and `logprobs`."""
    choice = {"type": "object", "required": ["index", key, "finish_reason", "logprobs"], "properties": {
        "index": {"type": "integer"}, key: content, "finish_reason": _FINISH, "logprobs": logprobs}}
    return {"type": "object", "required": ["id", "object", "created", "model", "choices"], "properties": {
        "id": {"type": "string"}, "object": {"const": obj}, "created": {"type": "integer"},
        "model": {"type": "string"}, "usage": _usage(), "choices": {"type": "array", "items": choice}}}


def openapi_spec(model_name: str) -> dict[str, Any]:
    """The OpenAPI 3.1 document (a JSON-ready dict) of `/v1/chat/completions`, `/v1/completions`
    and `/v1/models` as served for `model_name`."""
    text_part = {"type": "object", "required": ["type", "text"],
                 "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
    message = {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant"]},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": text_part}]},
        "name": {"type": "string"}}}
    chat_req = {"type": "object", "required": ["model", "messages"], "additionalProperties": False, "properties": {
        **_common(model_name), "messages": {"type": "array", "items": message, "minItems": 1},
        "max_completion_tokens": _range(_INT, 1, MAX_TOKENS), "logprobs": {"type": ["boolean", "null"]},
        "top_logprobs": _range(_INT, 0, 20)},
        # top_logprobs (a number) needs logprobs true, as in OpenAI's API and vLLM
        "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
        "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}}
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 49151}, "minItems": 1}
    comp_req = {"type": "object", "required": ["model", "prompt"], "additionalProperties": False, "properties": {
        **_common(model_name),
        "prompt": {"oneOf": [{"type": "string", "minLength": 1},
                             {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1,
                              "maxItems": 64},
                             ids, {"type": "array", "items": ids, "minItems": 1, "maxItems": 64}]},
        "echo": {"type": ["boolean", "null"]}, "logprobs": _range(_INT, 0, 20), "best_of": _range(_INT, 1, 16)}}
    chat_resp = _response("chat.completion", "message", {
        "type": "object", "required": ["role", "content", "refusal"], "properties": {
            "role": {"const": "assistant"}, "content": {"type": ["string", "null"]},
            "refusal": {"type": ["string", "null"]}}}, _chat_logprobs())
    comp_resp = _response("text_completion", "text", {"type": "string"}, _comp_logprobs())
    errors = {str(c): {"description": d, "content": {"application/json": {"schema": _error()}}}
              for c, d in ((400, "invalid request"), (401, "missing or wrong bearer token"),
                           (404, "unknown model"), (500, "engine failure"))}

    def post(req: dict, resp: dict, summary: str) -> dict:
        return {"post": {"summary": summary, "requestBody": {"required": True, "content": {
            "application/json": {"schema": req}}}, "responses": {
            "200": {"description": "the completion (JSON), or server-sent events when stream is true",
                    "content": {"application/json": {"schema": resp},
                                # one server-sent event (`data: <chunk JSON>` or `data: [DONE]`)
                                "text/event-stream": {"schema": {"type": "object", "required": ["data"],
                                                                 "properties": {"data": {"type": "string"}}}}}},
                      **errors}}}

    models = {"type": "object", "required": ["object", "data"], "properties": {
        "object": {"const": "list"}, "data": {"type": "array", "items": {
            "type": "object", "required": ["id", "object", "created", "owned_by", "max_model_len"],
            "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                           "owned_by": {"type": "string"}, "max_model_len": {"type": "integer", "minimum": 1}}}}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "relayinfer OpenAI-compatible API", "version": "1"},
        "paths": {
            "/v1/chat/completions": post(chat_req, chat_resp, "Chat completion"),
            "/v1/completions": post(comp_req, comp_resp, "Text completion"),
            "/v1/models": {"get": {"summary": "Served models", "responses": {
                "200": {"description": "the model list", "content": {"application/json": {"schema": models}}},
                "401": errors["401"]}}},
        },
    }
