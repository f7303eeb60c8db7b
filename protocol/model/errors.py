"""Errors of the model side that both ends share: the model file, the tokenizer, a prompt that does
not fit, an engine name. Each carries the wire `ErrorCode` it is reported with (`protocol.errors`)."""
from __future__ import annotations

from relayinfer.protocol.errors import ErrorCode, RelayInferError


class ModelFileError(RelayInferError):
    """The model file is missing, not a GGUF file, truncated or corrupt, or lacks a tensor."""

    code = ErrorCode.BAD_REQUEST


class UnsupportedModelError(RelayInferError):
    """The model file is valid but not a Llama-family architecture (or tokenizer) we run."""

    code = ErrorCode.BAD_REQUEST


class PromptTooLongError(RelayInferError):
    """Prompt tokens + max_new_tokens exceed the model's context length."""

    code = ErrorCode.PROMPT_TOO_LONG


class UnknownEngineError(RelayInferError):
    """An engine name other than the ones offered ('torch', 'onnx')."""

    code = ErrorCode.BAD_REQUEST
