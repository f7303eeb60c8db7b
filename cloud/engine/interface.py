"""The one engine interface of the cloud service: `EngineClient`.

Three engines implement it: `AsyncLLMEngine` (continuous batching over a paged KV cache),
`PerRequestEngine` (one request at a time on a `TorchEngine`, with prompt refinement and the KV
hand-off) and `PDEngine` (the P/D gateway over prefill and decode pools). `CloudService` and the
OpenAI routes read engines through these members only.

Per request an engine yields `StepOutput`s (one per generated token, `finish_reason` set on the
token that ends the answer or spends the cloud budget); the per-request engine also yields the
extra outputs `RefinedIndices` (right after token 0 of a request with refinement) and `KVParts`
(right after token 0 of a request with a KV hand-off: `generate(..., kv_from=k)` on the
per-request engine and on `AsyncLLMEngine`, which copies it out of its paged cache; an engine
whose `exports_kv` attribute is not True, such as `PDEngine`, takes no `kv_from`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator, Optional, Protocol, Sequence, Union, runtime_checkable

import numpy as np
from prometheus_client import CollectorRegistry

from relayinfer.protocol.model.decoding import SamplingParams
from relayinfer.protocol.messages import KVTransfer

__all__ = ["EngineClient", "EngineLimits", "EngineOutput", "KVParts", "RefinedIndices"]


@dataclass(frozen=True)
class EngineLimits:
    """What one engine can hold (tokens unless named otherwise).

    context_length: the model's context; vocab_size: token ids are in [0, vocab_size);
    kv_capacity_tokens: tokens of KV one request can hold, None when a request's cache grows up to
    the context (per-request engine); kv_what: how messages name that capacity; kv_pool_bytes: bytes
    of KV cache this engine preallocated in this process (0 when none, or when it lives elsewhere).
    """

    context_length: int
    vocab_size: int
    kv_capacity_tokens: Optional[int] = None
    kv_what: str = "the KV cache capacity"
    kv_pool_bytes: int = 0

    @property
    def max_request_tokens(self) -> int:
        """Prompt + answer tokens one request may hold: min(context length, KV capacity)."""
        cap = self.kv_capacity_tokens
        return self.context_length if cap is None else min(self.context_length, cap)


@dataclass(frozen=True)
class RefinedIndices:
    """The prompt positions prompt refinement keeps (sorted ints), yielded right after token 0."""

    request_id: str
    kept: list[int]


@dataclass(frozen=True)
class KVParts:
    """The KV hand-off of a request's prompt, yielded right after token 0: `kv` float16 numpy
    [layers, 2, kv_heads, tokens, head_dim] (the device's ONNX past-KV layout per layer, keys after
    RoPE) of prompt positions [token_start, token_start + tokens). The service sends it as
    `KVTransfer` pieces of at most `CloudService.kv_piece_bytes` each (`protocol.kvhandoff.kv_pieces`)."""

    request_id: str
    kv: np.ndarray
    token_start: int

    @property
    def messages(self) -> list[KVTransfer]:
        """The whole hand-off as `KVTransfer` messages of at most MAX_FRAME_BYTES (tests, benches)."""
        from relayinfer.protocol.kvhandoff import kv_messages

        return kv_messages(self.request_id, self.kv, self.token_start)


EngineOutput = Union["StepOutput", RefinedIndices, KVParts]
"""One output of `EngineClient.generate`. `StepOutput` and `RequestStats` are the batching engine's
(`cloud.engine.llm_engine`, which imports this module); the other engines yield the same types."""


@runtime_checkable
class EngineClient(Protocol):
    """An engine as the cloud service drives it (asyncio side; every method is called from the
    event loop that consumes `generate`)."""

    @property
    def limits(self) -> EngineLimits:
        """Context, vocabulary and KV capacity (see `EngineLimits`)."""

    @property
    def prefill_tok_s(self) -> Optional[float]:
        """Measured prefill rate (prompt tokens per second of step time), None while unknown or
        not measured by this engine."""

    @property
    def metrics_registry(self) -> Optional[CollectorRegistry]:
        """The engine's Prometheus registry (served on /metrics), None when it has none."""

    def generate(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                 cloud_budget: Optional[int] = None) -> AsyncIterator[EngineOutput]:
        """Run one request: an async iterator of its outputs. It ends after the output whose
        `finish_reason` is set, or without one after `abort`. Leaving it early aborts the request.
        Raises `ValueError` (FieldError, PromptTooLongError) for a request the engine refuses,
        `RequestFailed` from the iteration when this request alone failed, RuntimeError when the
        engine failed."""

    def abort(self, request_id: str) -> None:
        """End a request at its next step and free its KV (no-op for an unknown or finished id)."""

    def set_budget(self, request_id: str, cloud_budget: int) -> None:
        """Change a live request's cloud budget (tokens; applied at its next step)."""

    def request_stats(self, request_id: str) -> Optional[RequestStats]:
        """Counters of a live or recently finished request (prefix-hit tokens among them), None
        when unknown."""

    def health(self) -> Optional[str]:
        """None while the engine can serve, else why not."""

    def state(self) -> dict:
        """The engine's load for /healthz (JSON-able)."""

    async def warmup(self) -> None:
        """Run a short request so the first real one does not pay for allocations."""

    def shutdown(self) -> None:
        """Stop the engine (blocking; call it off the event loop)."""
