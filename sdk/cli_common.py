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
    print_error(message, e.code.value if isinstance(e, RelayInferError) else "bad_request", type(e).__name__, as_json)
    raise typer.Exit(2)


def print_error(message: str, code: str, kind: str, as_json: bool, hint: str = "") -> None:
    """An error as the command line reports it: with `as_json` one object on stdout, {"error":
    {"message", "code", "type": kind}}; else one line on stderr, `error: <message><hint>`."""
    if as_json:
        print(json.dumps({"error": {"message": message, "code": code, "type": kind}}))
    else:
        typer.secho(f"error: {message}{hint}", err=True, fg=typer.colors.RED)


def serve_for(svc, duration_s: float | None, up) -> None:
    """Run a service until SIGINT/SIGTERM or `duration_s` seconds (exit 0), or until it says it
    cannot go on (`svc.health()` names a reason: its batching engine or P/D pool failed): one line
    on stderr and exit code 3 (`lifecycle.EXIT_FAILED`), for a supervisor to restart it. `up()` (a
    coroutine function) starts `svc` and announces it; `svc.stop()` runs on the way out, bounded
    (`lifecycle.run_server`: open requests get 5 s, then what is left is cancelled)."""
    from relayinfer.protocol.transport.lifecycle import run_server

    code = run_server(svc, up, duration_s)
    if code:
        raise typer.Exit(code)


def sigterm_stops_startup(what: str):
    """Decorator of a serve command: a SIGTERM that comes while it starts (loading a model, starting
    Ray and its actors, before `serve_for` takes the signals over) stops it as one once it is up
    does: one line on stderr, exit 0, and what was started is stopped on the way out (Ray's atexit
    shutdown ends a local Ray and the driver's actors). Without it a SIGTERM killed the process, or,
    once Ray was up, Ray's failure handler dumped a stack and aborted (exit -6), which a supervisor
    reads as a crash; that handler is switched off for this process (`RAY_DISABLE_FAILURE_SIGNAL_HANDLER`)."""
    import functools
    import os
    import signal
    import threading

    def wrap(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            if threading.current_thread() is not threading.main_thread():
                return fn(*args, **kwargs)
            os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")

            def stop(signum, frame):
                typer.echo(f"stopped by SIGTERM before {what} was up", err=True)
                raise SystemExit(0)

            prev = signal.signal(signal.SIGTERM, stop)
            try:
                return fn(*args, **kwargs)
            finally:
                signal.signal(signal.SIGTERM, prev)

        return run

    return wrap


def bench_module(name: str):
    """Import the benchmark driver `bench.<name>` (drivers live in the `bench` package of a source
    checkout, not in the library): the checkout this library runs from, else a `bench` package
    of relayinfer on sys.path (`python -m` from the checkout root). Exit 2 saying a source
    checkout is needed when neither is there (an installed wheel), or naming an unknown driver."""
    import importlib
    import importlib.util
    from pathlib import Path

    pkg = sys.modules.get("bench")
    if pkg is None or not getattr(pkg, "RELAYINFER_BENCH", False):
        init = Path(__file__).resolve().parents[1] / "bench" / "__init__.py"
        if init.is_file():
            spec = importlib.util.spec_from_file_location("bench", init, submodule_search_locations=[str(init.parent)])
            pkg = importlib.util.module_from_spec(spec)
            sys.modules["bench"] = pkg  # worker processes find the drivers' functions by name
            spec.loader.exec_module(pkg)
        else:
            try:
                pkg = importlib.import_module("bench")
            except ImportError:
                pkg = None
            if pkg is None or not getattr(pkg, "RELAYINFER_BENCH", False):
                fail(FileNotFoundError(f"`relayinfer bench {name}` needs a source checkout of relayinfer: its "
                                       "drivers are the bench/ package there (run it from the checkout root), "
                                       "not part of the installed library"))
    try:
        return importlib.import_module(f"bench.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"bench.{name}":
            raise
        fail(FileNotFoundError(f"no benchmark driver bench/{name}.py in {list(pkg.__path__)[0]}"))
