"""The split service and the OpenAI-compatible API on the P/D pools: `relayinfer pd serve`.

`PDService` is the `CloudService` (same websocket protocol, limits, auth, TLS, HTTP routes) with the
gateway in place of the single batching engine: `PDEngine` gives the gateway the interface the
service and the OpenAI routes use (`generate`, `abort`, `set_budget`, `metrics`, `error`).

Routing: a device `Generate` with a cloud budget (split mode: the device takes over after a few
tokens) runs on a prefill instance for its few tokens and never uses a decode instance; a
`Generate` without a budget (cloud-only) and every OpenAI request go prefill -> KV hand-off ->
decode. Requests with prompt refinement take the service's per-request path on the gateway's own
engine, as in `cloud serve`.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from relayinfer.cloud.serve.service import CloudService
from relayinfer.protocol.decoding import SamplingParams
from relayinfer.protocol.errors import PromptTooLongError

from .gateway import Gateway


class _EngineView:
    """What the service reads of `llm.engine`: limits and the model config."""

    def __init__(self, cfg, max_model_len: int, num_blocks: int, block_size: int):
        self.cfg, self.max_model_len = cfg, max_model_len
        self.num_blocks, self.block_size = num_blocks, block_size
        self.context_length = cfg.context_length

    def generate(self, prompts, params):  # the service's warm-up: the instances warmed up themselves
        return [[] for _ in prompts]


class PDEngine:
    """The gateway behind `AsyncLLMEngine`'s interface (for `CloudService` and `openai_routes`).

    Args:
        gateway: the started or not yet started `Gateway` (started on first use in its loop).
        cfg: the model config; max_model_len / num_blocks / block_size: the smallest instance's.
    """

    def __init__(self, gateway: Gateway, cfg, max_model_len: int, num_blocks: int, block_size: int = 16):
        self.gateway = gateway
        self.engine = _EngineView(cfg, max_model_len, num_blocks, block_size)
        self.error: BaseException | None = None

    @property
    def metrics(self):
        return self.gateway.metrics

    async def generate(self, request_id: str, prompt_ids, params: SamplingParams, cloud_budget: int | None = None,
                       tag: str | None = None) -> AsyncIterator:
        n = len(prompt_ids)
        if n == 0:
            raise ValueError("empty prompt: at least one token is needed")
        if n + params.max_new_tokens > self.engine.max_model_len:
            raise PromptTooLongError(
                f"prompt too long: {n} prompt tokens + {params.max_new_tokens} new tokens exceed this server's limit "
                f"of {self.engine.max_model_len} tokens per request (min of the context length and the smallest "
                f"instance's KV cache capacity)")
        gen = self.gateway.generate(request_id, list(prompt_ids), params, cloud_budget, tag=tag,
                                    split=cloud_budget is not None)
        try:
            async for o in gen:
                yield o
        finally:
            await gen.aclose()

    def abort(self, request_id: str) -> None:
        self.gateway.abort(request_id)

    def set_budget(self, request_id: str, cloud_budget: int) -> None:
        self.gateway.set_budget(request_id, cloud_budget)

    def shutdown(self) -> None:  # the service stops the gateway in its own loop (PDService.stop)
        pass


class PDService(CloudService):
    """`CloudService` over P/D pools. `llm` must be a `PDEngine`; `engine` is the gateway's own
    `TorchEngine` (fingerprint, tokenizer path, refinement requests)."""

    def __init__(self, engine, fingerprint: str, llm: PDEngine, ratio_controller=None, **kw):
        super().__init__(engine, fingerprint, llm=llm, **kw)
        self.ratio_controller = ratio_controller

    async def start(self, *args, **kw) -> None:
        await self.llm.gateway.start()
        if self.ratio_controller is not None:
            self.ratio_controller.start()
        await super().start(*args, **kw)

    async def stop(self) -> None:
        if self.ratio_controller is not None:
            await self.ratio_controller.stop()
        await super().stop()
        await self.llm.gateway.stop()

    def _health_details(self) -> dict:
        d = {"model_fingerprint": self.fingerprint, "model": self.model_name,
             "sessions": int(self.metrics.active_sessions._value.get()),
             "requests": int(self.metrics.active_requests._value.get())}
        d["pd"] = self.llm.gateway.state()
        return d


async def wait_idle(gateway: Gateway, timeout_s: float = 30.0) -> dict:
    """Poll the instances until none holds a request or a KV block (tests, benches); returns the
    last reports by instance name."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        await gateway.refresh_reports()
        busy = {n: r for n, r in gateway.reports.items()
                if r["kv_blocks_used"] or r["running"] or r["waiting"] or r["imports"] or r["held"]
                or r["queued_requests"]}
        if not busy or asyncio.get_running_loop().time() > deadline:
            return gateway.reports
        await asyncio.sleep(0.05)
