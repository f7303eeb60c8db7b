"""The split service and the OpenAI-compatible API on the P/D pools: `relayinfer pd serve`.

`PDService` is the `CloudService` (same websocket protocol, limits, auth, TLS, HTTP routes) with the
gateway in place of the single batching engine: `PDEngine` is the gateway as an `EngineClient`
(`cloud.engine.interface`), the interface the service and the OpenAI routes use.

Routing: a device `Generate` with a cloud budget (split mode: the device takes over after a few
tokens) runs on a prefill instance for its few tokens and never uses a decode instance; a
`Generate` without a budget (cloud-only) and every OpenAI request go prefill -> KV hand-off ->
decode. Requests with prompt refinement take the service's per-request path on the gateway's own
engine, as in `cloud serve`.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from prometheus_client import CollectorRegistry

from relayinfer.cloud.engine.interface import EngineLimits
from relayinfer.cloud.engine.llm_engine import StepOutput, check_fits
from relayinfer.cloud.serve.service import CloudService
from relayinfer.protocol.model.decoding import SamplingParams
from relayinfer.protocol.validate import check, check_ids, check_vocab

from .gateway import Gateway


class _EngineView:
    """What the OpenAI routes read of `llm.engine`: limits and the model config."""

    def __init__(self, cfg, max_model_len: int, num_blocks: int, block_size: int, model=None):
        self.cfg, self.max_model_len = cfg, max_model_len
        self.num_blocks, self.block_size = num_blocks, block_size
        self.context_length = cfg.context_length
        self.model = model  # the gateway's own Llama (prompt logprobs of OpenAI `echo`)

    def check_fits(self, n_prompt: int, max_new_tokens: int) -> None:
        """Raise PromptTooLongError naming the limit when a request cannot fit (ValueError if empty)."""
        check_fits(n_prompt, max_new_tokens, self.context_length, self.num_blocks * self.block_size,
                   "the smallest instance's KV cache capacity")


class PDEngine:
    """The gateway as an `EngineClient` (for `CloudService` and `openai_routes`).

    Args:
        gateway: the started or not yet started `Gateway` (started on first use in its loop).
        cfg: the model config; max_model_len / num_blocks / block_size: the smallest instance's.
        model: the gateway's own Llama (prompt logprobs of OpenAI `echo`).
    """

    def __init__(self, gateway: Gateway, cfg, max_model_len: int, num_blocks: int, block_size: int = 16, model=None):
        self.gateway = gateway
        self.engine = _EngineView(cfg, max_model_len, num_blocks, block_size, model)

    @property
    def metrics(self):
        return self.gateway.metrics

    @property
    def limits(self) -> EngineLimits:
        """The model's context and vocabulary; the smallest instance's KV capacity (its blocks live
        in the instances, none in this process)."""
        e = self.engine
        return EngineLimits(e.context_length, e.cfg.vocab_size, e.num_blocks * e.block_size)

    @property
    def prefill_tok_s(self) -> None:
        return None  # the instances measure their own rates; the gateway routes by them

    @property
    def metrics_registry(self) -> CollectorRegistry:
        return self.gateway.metrics.registry

    def request_stats(self, request_id: str):
        """The request's prompt tokens and the tokens its prefill reused from a prefill instance's
        prefix cache (`Gateway.request_stats`); None for an unknown request."""
        return self.gateway.request_stats(request_id)

    def health(self) -> str | None:
        """None while the gateway can serve (see `Gateway.health`)."""
        return self.gateway.health()

    def state(self) -> dict:
        return self.gateway.state()

    async def warmup(self) -> None:
        pass  # the instances warmed up themselves

    async def generate(self, request_id: str, prompt_ids, params: SamplingParams, cloud_budget: int | None = None,
                       tag: str | None = None) -> AsyncIterator[StepOutput]:
        """The gateway's answer as `StepOutput`s. Raises `FieldError` (a ValueError) naming a prompt
        id outside the vocabulary, a negative `cloud_budget` or a stop id outside the vocabulary,
        `PromptTooLongError` when the request cannot fit the smallest instance. A grammar
        (`params.grammar`) is kept on both instances: the prefill instance masks the first token,
        the decode instance's guide consumes it and masks the rest."""
        prompt_ids = check_ids("prompt_ids", prompt_ids, self.engine.cfg.vocab_size - 1, min_len=1)
        check("cloud_budget", cloud_budget, optional=True)
        check_vocab(self.engine.cfg.vocab_size, params.stop_ids, params.logit_bias)
        self.engine.check_fits(len(prompt_ids), params.max_new_tokens)
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

    def health_response(self, details: bool) -> tuple[dict, int]:
        """/healthz: 200 `{"status": "ok"}`, 200 `{"status": "degraded", "dead": [names]}` while an
        instance is dead or being replaced but every pool has a live one, 503 `{"status":
        "unavailable" | "error", "dead": [...]}` when a pool has none (being replaced, or for good:
        the process then exits with code 3); the failures, replacements and the gateway state only
        with `details` (an authorized caller)."""
        st, fatal = self.llm.gateway.health_state(), self.health()
        status = "error" if fatal else st["status"]
        body = {"status": status, **({"dead": sorted(st["dead"])} if st["dead"] else {})}
        if details:
            body.update({"reason": fatal} if fatal else {}, instances_dead=st["dead"], restarting=st["restarting"],
                        restarts=st["restarts"], **self._health_details())
        return body, 503 if status in ("error", "unavailable") else 200

    def _health_details(self) -> dict:
        d = super()._health_details()
        d["pd"] = d.pop("engine")
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


def parse_scenario(text: str):
    """`NAME:N_PREFILL:N_DECODE:TTFT_MS:TPOT_MS[:MAX_PROMPT_TOKENS]` -> GroupSpec (CLI)."""
    from .gateway import GroupSpec, Scenario

    parts = text.split(":")
    if len(parts) not in (5, 6):
        raise ValueError(f"--scenario {text!r}: expected NAME:N_PREFILL:N_DECODE:TTFT_MS:TPOT_MS[:MAX_PROMPT_TOKENS]")
    try:
        n_p, n_d, ttft, tpot = int(parts[1]), int(parts[2]), float(parts[3]), float(parts[4])
        max_prompt = int(parts[5]) if len(parts) == 6 else 1 << 30
    except ValueError:
        raise ValueError(f"--scenario {text!r}: counts must be integers and SLOs numbers") from None
    if n_p < 1 or n_d < 1:
        raise ValueError(f"--scenario {text!r}: a group needs at least one prefill and one decode instance")
    return GroupSpec(Scenario(parts[0], ttft, tpot, max_prompt), n_p, n_d)


def make_pd_service(engine, specs: list, config=None, ray_address: str | None = None, forwarding: str = "on-demand",
                    threads: int = 1, actor_cpus: float = 1.0, spread: bool = False, ray_cpus: int | None = None,
                    ratio_control: bool = False, prefix_routing: bool = True, **service_kw) -> PDService:
    """`PDService` over Ray actor pools (local Ray unless `ray_address`); `engine` is the gateway's
    `TorchEngine`, whose weights the actors share through the object store; `prefix_routing`: the
    gateway routes by cached prefix (`prefix.py`), else round-robin / fewest in flight."""
    from .instance import InstanceConfig
    from .ray_pool import RayPool, start_ray

    config = config or InstanceConfig()
    start_ray(ray_address, num_cpus=ray_cpus)
    pool = RayPool(engine, specs, config, threads=threads, actor_cpus=actor_cpus, spread=spread)
    gw = Gateway(pool.groups, forwarding=forwarding, prefix_routing=prefix_routing, block_size=config.block_size)
    gw.pool = pool
    per_token = 2 * engine.cfg.n_layers * engine.cfg.n_kv_heads * engine.cfg.head_dim * 4
    blocks = config.kv_cache_bytes // (config.block_size * per_token)
    llm = PDEngine(gw, engine.cfg, min(engine.context_length, blocks * config.block_size), blocks, config.block_size,
                   engine.model)
    ctl = None
    if ratio_control:
        from .ratio import RatioController

        ctl = RatioController(gw)
    return PDService(engine, engine.fingerprint, llm=llm, ratio_controller=ctl, **service_kw)
