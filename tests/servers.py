"""Servers the tests start (127.0.0.1, free ports, stopped by the test): the split cloud service and
the OpenAI HTTP API with an `openai` client on it."""
from __future__ import annotations

import contextlib


def split_cloud(torch_engine, device_model_dir=None, step_delay_ms: float = 20.0, **kw):
    """A `ServiceThread` (use it as a context manager) of the split cloud on the per-request engine,
    each decode step held `step_delay_ms` so that a slow test device still sees cloud tokens first."""
    from relayinfer.cloud.serve.service import CloudService, ServiceThread

    svc = CloudService(torch_engine, torch_engine.fingerprint, device_model_dir=device_model_dir,
                       step_delay_ms=step_delay_ms, max_frame_bytes=1 << 20, **kw)
    return ServiceThread(svc)


@contextlib.asynccontextmanager
async def openai_client(engine, tokenizer, model: str, timeout_s: float = 120.0):
    """The OpenAI API (aiohttp, `make_app`) over `engine` on a free port; yields (an
    `openai.AsyncOpenAI` client on it, its base URL ending in /v1)."""
    import openai
    from aiohttp import web

    from relayinfer.cloud.serve.openai.api_server import make_app

    runner = web.AppRunner(make_app(engine, tokenizer, model))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1"
    client = openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0, timeout=timeout_s)
    try:
        yield client, base
    finally:
        await client.close()
        await runner.cleanup()
