"""Pieces the `relayinfer` command line's modules share (`sdk.cli`, `sdk.patho_cli`): the one-line
error exit, running a service for a while, and loading a benchmark driver from `bench/`."""
from __future__ import annotations

import json
import sys

import typer

from relayinfer.protocol.errors import RelayInferError

_OPTION_FIELDS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed")  # errors name them by their option


def fail(e: Exception, as_json: bool = False) -> None:
    """Print a one-line error naming what was wrong, in plain words, and exit 2. The protocol code
    (`bad_request`, `prompt_too_long`, ...) is shown only with `as_json`, where the error is one JSON
    object on stdout: {"error": {"message", "code", "type"}}."""
    message = e.message if isinstance(e, RelayInferError) else str(e)
    for name in _OPTION_FIELDS:  # 'max_new_tokens must be ...' -> '--max-new-tokens must be ...'
        if message.startswith(name + " "):
            message = "--" + name.replace("_", "-") + message[len(name):]
    if as_json:
        code = e.code.value if isinstance(e, RelayInferError) else "bad_request"
        print(json.dumps({"error": {"message": message, "code": code, "type": type(e).__name__}}))
    else:
        typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(2)


def serve_for(svc, duration_s: float | None, up) -> None:
    """Run a service until Ctrl-C or `duration_s` seconds: `up()` (a coroutine function) starts
    `svc` and announces it; `svc.stop()` runs on the way out, whatever ended the wait."""
    import asyncio

    async def main():
        await up()
        try:
            await asyncio.sleep(duration_s if duration_s else 1e9)
        finally:
            await svc.stop()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass


def bench_module(name: str):
    """Load `bench/<name>.py` of this source checkout as a module (benchmark drivers live in
    `bench/`, not in the library); exit 2 naming the file when it is not there."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    if not path.is_file():
        fail(FileNotFoundError(f"{path} not found: `relayinfer bench {name}` runs from a source checkout"))
    spec = importlib.util.spec_from_file_location(f"relayinfer_bench_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # worker processes find its functions by name
    spec.loader.exec_module(mod)
    return mod
