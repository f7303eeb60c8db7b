"""The `relayinfer` command line."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer

if not sys.stdout.isatty() and not os.environ.get("TERMINAL_WIDTH"):  # piped help: whole option names, none cut short
    import typer.rich_utils

    typer.rich_utils.MAX_WIDTH = 140

from relayinfer.device.profiles import available as _profiles
from relayinfer.protocol.errors import RelayInferError
from relayinfer.sdk.cli_common import bench_module, fail, print_error, serve_for, sigterm_stops_startup  # noqa: F401  (also this module's API)
from relayinfer.sdk.server_opts import server_tls as _server_tls

class _App(typer.Typer):
    """The `relayinfer` command. Run as a program (the console script), a usage error (an unknown
    option, a value out of range) is one line on stderr, `error: ... (see relayinfer CMD --help)`,
    or with `--json` among the arguments one object on stdout, {"error": {"message", "code":
    "bad_request", "type"}}; exit status 2 either way, as `fail` does for errors found later."""

    def __call__(self, *args, **kwargs):
        if kwargs.get("standalone_mode", True) is False:
            return super().__call__(*args, **kwargs)
        argv = list(kwargs.get("args") or (args[0] if args else sys.argv[1:]))
        self.standalone(lambda: super(_App, self).__call__(*args, standalone_mode=False, **kwargs), argv)

    @staticmethod
    def standalone(run, argv: list[str]) -> None:
        """Call `run()` (a click command in standalone_mode=False) and exit as `relayinfer` does:
        usage errors as one line and exit 2, the command's own exit code otherwise. Also for the
        sub-apps mounted by forwarding their arguments (`relayinfer relay ...`)."""
        mods = _click_exception_modules()
        usage = tuple(m.UsageError for m in mods)
        no_args = tuple(m.NoArgsIsHelpError for m in mods if hasattr(m, "NoArgsIsHelpError"))
        abort = (typer.Abort,) + tuple(m.Abort for m in mods if hasattr(m, "Abort"))
        try:
            code = run()
        except no_args as e:  # `relayinfer` alone: the help, as click shows it
            e.show()
            sys.exit(e.exit_code)
        except usage as e:
            where = e.ctx.command_path if e.ctx is not None else "relayinfer"
            print_error(e.format_message(), "bad_request", type(e).__name__, "--json" in argv, f" (see {where} --help)")
            sys.exit(2)
        except abort:
            typer.echo("Aborted.", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


def _click_exception_modules() -> list:
    """The modules whose exceptions typer raises: its vendored click's (`typer._click`, newer
    typer) and click's, whichever import."""
    import importlib

    mods = []
    for name in ("typer._click.exceptions", "click.exceptions"):
        try:
            mods.append(importlib.import_module(name))
        except ImportError:
            pass
    return mods


app = _App(help="relayinfer: split inference between cloud and devices.", no_args_is_help=True,
           pretty_exceptions_enable=False, add_completion=False)


CLOUD_EXTRA_HINT = "pip install torch==2.13.0, then pip install 'relayinfer[cloud]'"


def _need_cloud(what: str, module: str = "relayinfer.cloud.export", *also: str):
    """Import and return the cloud `module` for the sub-command `what` (after importing the
    modules `also` it needs at run time, e.g. onnx for the export); on a device-only install (no
    [cloud] extra) exit 2 with one line naming what to install."""
    import importlib

    try:
        for m in also:
            importlib.import_module(m)
        return importlib.import_module(module)
    except ImportError as e:
        fail(ValueError(f"{what} needs the cloud side, which this install lacks ({e}); "
                        f"install it with: {CLOUD_EXTRA_HINT}"))


def _download_progress():
    """A rich progress bar on stderr for a device-model download from the cloud: returns
    (callback(name, done_bytes, total_bytes), stop). Nothing is shown when nothing is downloaded."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                   console=Console(stderr=True))
    tasks: dict = {}

    def on(name: str, done: int, total: int) -> None:
        if not tasks:
            bar.start()
        if name not in tasks:
            tasks[name] = bar.add_task(f"fetching {name}", total=total or None)
        bar.update(tasks[name], completed=done)

    return on, bar.stop


def _log_to_stderr() -> None:
    """Show relayinfer's warnings (a cloud that is unreachable, a device runtime failure) as one
    `warning: ...` line on stderr, without logger names or source locations."""
    import logging

    class StderrHandler(logging.Handler):
        def emit(self, record):  # the stderr of the moment (a second command in one process, tests)
            try:
                sys.stderr.write(self.format(record) + "\n")
            except (ValueError, OSError):
                pass

    lg = logging.getLogger("relayinfer")
    if not any(getattr(h, "_relayinfer_cli", False) for h in lg.handlers):
        h = StderrHandler(logging.WARNING)
        h.setFormatter(_PlainFormatter())
        h._relayinfer_cli = True
        lg.addHandler(h)  # one handler in the hierarchy: Python's last-resort handler stays silent
        lg.setLevel(min(lg.level or logging.WARNING, logging.WARNING))


class _PlainFormatter:
    """`warning: message` (level in lower case, no logger name, time or source location)."""

    def format(self, record) -> str:
        import logging

        text = f"{record.levelname.lower()}: {record.getMessage()}"
        if record.exc_info and record.levelno >= logging.ERROR:
            text += f" ({record.exc_info[1]!r})"
        return text


def _check_quantize(quantize: str | None) -> None:
    """Raise ValueError naming --quantize when it is not a device weights variant."""
    from relayinfer.protocol.model.device_model import check_weights

    check_weights(quantize, "--quantize")


def _check_model(model: str | None) -> None:
    """Raise ModelFileError for a bad --model (None: the default) before anything loads."""
    if model is not None:
        from relayinfer.protocol.model.model_file import resolve_model_path

        resolve_model_path(model)


def _ensure_device_model(model, quantize: str | None = None, show: bool = True):
    """The exported device model's directory; when it must be exported first (once per model file),
    a rich progress bar on stderr shows the step and the time against the measured estimate
    (`cloud.export.export_seconds`). Nothing is printed when the model is already in the cache.

    Raises:
        ValueError: `quantize` is not a device weights variant (naming --quantize).
    """
    import threading
    import time

    _check_quantize(quantize)

    try:
        from relayinfer.cloud.export import device_model_ready, ensure_device_model, export_seconds
    except ImportError:  # torch-free install: the device model must already be exported (load_engine says so)
        from relayinfer.device.onnx_engine import device_model_dir
        from relayinfer.protocol.model.errors import ModelFileError

        try:
            return device_model_dir(model)
        except ModelFileError as e:
            raise ModelFileError(f"{e.message}; on a device-only install, fetch the device model from the "
                                 "cloud instead: --cloud-http URL (the cloud's HTTP port)") from None
    if not show or device_model_ready(model, quantize):
        return ensure_device_model(model, quantize)
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    total = export_seconds(model)
    t0, done = time.monotonic(), threading.Event()
    usual = f"(about {total:.0f} s on 2 cores, once per model)"
    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), TextColumn("{task.fields[note]}"),
                  console=console) as bar:
        task = bar.add_task("exporting the device model to ONNX", total=total, note=usual)

        def tick():  # the export reports steps, not fractions: the bar follows the clock, held short of 100 %
            while not done.wait(0.25):
                elapsed = time.monotonic() - t0
                bar.update(task, completed=min(elapsed, 0.97 * total),
                           note=usual if elapsed < total else f"(usually {total:.0f} s; a busy CPU is slower: still working)")

        threading.Thread(target=tick, name="export-progress", daemon=True).start()
        try:
            d = ensure_device_model(model, quantize, progress=lambda m: bar.update(
                task, description=m.split(" (")[0] if not m.startswith("device model ready") else "device model ready"))
        finally:
            done.set()
        bar.update(task, completed=total)
    console.print(f"device model exported in {time.monotonic() - t0:.0f} s, cached in {d} (later runs skip this)",
                  soft_wrap=True, highlight=False)  # one line: a long path is not folded onto the next
    return d


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="User message (chat template applied) or raw text with --raw."),
    engine: str = typer.Option("torch", help="torch (cloud runtime) or onnx (device runtime)."),
    model: Optional[str] = typer.Option(None, help="GGUF file or installed model name (`relayinfer models`); default SmolLM2-135M-Instruct."),
    quantize: Optional[str] = typer.Option(None, help="Device weights, gguf (default: the GGUF's own blocks), gguf-q8 (the MLP and 8-bit blocks on int8 activations, ~2x faster decode) or fp32 (onnx engine only)."),
    max_new_tokens: int = typer.Option(128, help="Generated tokens at most (EOS included), at least 1."),
    temperature: float = typer.Option(0.0, help="0 means greedy."),
    top_p: float = typer.Option(1.0, help="Nucleus filter, in (0, 1]; 1 = off."),
    top_k: int = typer.Option(0, help="Keep the k most likely tokens; 0 = off."),
    seed: Optional[int] = typer.Option(None),
    threads: Optional[int] = typer.Option(None, min=1, help="Intra-op threads (onnx default 1)."),
    raw: bool = typer.Option(False, help="Do not apply the chat template."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
):
    """Generate an answer on one runtime (no split)."""
    from relayinfer.protocol.validate import check_prompt_text
    from relayinfer.protocol.model.decoding import SamplingParams, check_prompt
    from relayinfer.protocol.model.tokenizer import Tokenizer
    from relayinfer.sdk.engines import ENGINES, load_engine

    _log_to_stderr()
    try:
        check_prompt_text(prompt)
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                max_new_tokens=max_new_tokens)
        if engine not in ENGINES:
            load_engine(engine)  # raises UnknownEngineError naming the choices, before any model loads
        if engine == "torch":
            _need_cloud("--engine torch", "relayinfer.cloud.engine.torch_engine")
        tok = Tokenizer.from_gguf(model)
        ids = tok.encode(prompt) if raw else tok.encode_chat(prompt)
        if engine == "onnx":  # the exported config knows the context: a too-long request fails before the load
            d = _ensure_device_model(model, quantize, show=not as_json)
            check_prompt(len(ids), params.max_new_tokens, json.loads((d / "config.json").read_text())["context_length"])
        eng = load_engine(engine, model, quantize, threads)
        out = eng.generate(ids, params)
    except (RelayInferError, ValueError) as e:
        fail(e, as_json)
    text = tok.decode(out.token_ids, skip_special=True)
    if as_json:
        print(json.dumps({"engine": engine, "quantize": quantize, "prompt_ids": ids, "token_ids": out.token_ids,
                          "text": text, "finish_reason": out.finish_reason, "prefill_ms": round(out.prefill_ms, 3),
                          "decode_ms_per_token": round(out.decode_ms_per_token, 3)}))
    else:
        print(text)


@app.command("export")
def export_cmd(
    model: Optional[str] = typer.Option(None, help="GGUF file or installed model name (`relayinfer models`); default SmolLM2-135M-Instruct."),
    quantize: Optional[str] = typer.Option(None, help="Device weights: gguf (default, the GGUF's own 4/8-bit blocks), gguf-q8 (the MLP and 8-bit blocks on int8 activations, ~2x faster decode) or fp32."),
):
    """Export the device model (ONNX + tokenizer + config) into the user cache, once per model hash."""
    _need_cloud("`relayinfer export`", "relayinfer.cloud.export", "onnx")
    try:
        d = _ensure_device_model(model, quantize)
    except (RelayInferError, ValueError) as e:
        fail(e)
    print(d)


cloud_app = typer.Typer(help="The cloud prefill service.", no_args_is_help=True)
app.add_typer(cloud_app, name="cloud")


def _cloud_service(model, device: str, threads: int | None, token: str | None, export: bool = True,
                   kv_cache_mb: int | None = None, metrics_public: bool = False, dtype: str = "auto",
                   weights: str = "fp32", **limits):
    """A CloudService; with `kv_cache_mb` it batches requests in an LLMEngine (continuous batching,
    paged KV cache of that many MiB) and serves the OpenAI-compatible API too. `device` / `dtype`:
    `torch_engine.pick_device` / `pick_dtype` ('auto': cuda and bfloat16 when torch sees a GPU);
    `weights`: `llama.WEIGHTS`."""
    from relayinfer.cloud.engine.torch_engine import TorchEngine
    from relayinfer.cloud.export import ensure_device_model
    from relayinfer.cloud.serve.service import CloudService

    engine = TorchEngine(model, device=device, threads=threads, dtype=dtype, weights=weights)
    model_dir = ensure_device_model(model) if export else None
    _warm_grammar(engine)
    llm = None
    if kv_cache_mb:
        from relayinfer.cloud.engine.llm_engine import AsyncLLMEngine, LLMEngine

        llm = AsyncLLMEngine(LLMEngine(engine, kv_cache_bytes=kv_cache_mb << 20))
    return CloudService(engine, engine.fingerprint, auth_token=token, device_model_dir=model_dir, llm=llm,
                        metrics_public=metrics_public, **limits)


def _warm_grammar(engine) -> None:
    """Build the model's structured-output vocabulary before the server listens (~0.5 s that holds
    the GIL; `protocol.model.grammar.warm`): the first request with a grammar then stalls no stream
    of this process (`pd serve`: of the gateway; each Ray instance builds its own on first use)."""
    from relayinfer.protocol.model.grammar import warm

    warm(engine.tokenizer)


def _check_ports(host: str, *ports: tuple[str, int | None]) -> None:
    """Exit 2 with one line naming the port when a listening command cannot bind one of `ports`
    ((option name, port); 0 = any free port, skipped). Called before any model loads."""
    from relayinfer.sdk.checks import check_ports_free

    try:
        check_ports_free(host, ports)
    except ValueError as e:
        fail(e)


from relayinfer.sdk.server_opts import (OPT_HEADER_TIMEOUT, OPT_IDLE_TIMEOUT, OPT_INSECURE_NO_AUTH,  # noqa: E402
                                         OPT_MAX_CONNECTIONS, OPT_MAX_PER_CLIENT, connection_limits, server_policy)


@cloud_app.command("serve")
@sigterm_stops_startup("the cloud service")
def cloud_serve(
    host: str = typer.Option("127.0.0.1", help="Listen address."),
    port: int = typer.Option(8765, help="Websocket (device stream) port; 0 = any free port."),
    http_port: int = typer.Option(8766,
                                  help="HTTP port: OpenAI API, /healthz, /metrics, /v1/device-model; 0 = any free port."),
    model: Optional[str] = typer.Option(None, help="GGUF file or installed model name (`relayinfer models`); default SmolLM2-135M-Instruct."),
    device: str = typer.Option("auto", help="torch device: auto (cuda when torch sees one, else cpu), cpu, cuda[:i], npu."),
    dtype: str = typer.Option("auto", help="Weights and KV cache: auto (bfloat16 on cuda/npu, float32 on cpu), "
                              "float32, bfloat16, float16."),
    weights: str = typer.Option("fp32", help="Weight format: fp32 (every tensor dequantized: the reference) or "
                                "gguf (CPU, float32: the file's 4-bit block layers run on their blocks, torch's "
                                "int4 kernel; faster decode, bf16 activations into those matmuls)."),
    threads: Optional[int] = typer.Option(None, min=1, help="torch intra-op threads."),
    token: Optional[str] = typer.Option(None, envvar="RELAYINFER_TOKEN",
                                        help="Bearer token every client must send (devices and HTTP)."),
    duration_s: Optional[float] = typer.Option(None, min=0.0, help="Stop by itself after this many seconds."),
    kv_cache_mb: int = typer.Option(256, min=0, help="Paged KV cache of the batching engine (MiB); 0 = one request at a time."),
    certfile: Optional[str] = typer.Option(None, help="PEM certificate chain: serve wss:// and https:// (with --keyfile)."),
    keyfile: Optional[str] = typer.Option(None, help="PEM private key of --certfile."),
    metrics_public: bool = typer.Option(False, help="Serve /metrics without the token."),
    max_sessions: int = typer.Option(256, min=1, help="Open device sessions at most; more get OVERLOADED + retry-after."),
    max_requests_per_session: int = typer.Option(4, min=1, help="Concurrent Generates per device session at most."),
    retry_after_ms: float = typer.Option(5000.0, min=0, help="Back-off hint sent with OVERLOADED (ms)."),
    max_queued_tokens: int = typer.Option(4096, min=1, help="Prompt tokens waiting for prefill at most; more get OVERLOADED."),
    max_queue_wait_ms: float = typer.Option(2000.0, min=0, help="Expected wait for a first token at most (ms, from the measured prefill rate); more get OVERLOADED."),
    memory_mb: Optional[int] = typer.Option(None, min=1, help="Memory budget of every request path (MiB): the "
                                            "--kv-cache-mb pool plus refinement, KV hand-off and per-request "
                                            "caches; more get OVERLOADED / 503. Default: --kv-cache-mb + 512."),
    kv_piece_kib: int = typer.Option(1024, min=1, help="Largest KVTransfer frame of a KV hand-off (KiB): the KV "
                                     "goes out in pieces of at most this size, so pings, Stop and Cancel are not "
                                     "held behind it (docs/PROTOCOL.md)."),
    insecure_no_auth: bool = OPT_INSECURE_NO_AUTH,
    max_connections: int = OPT_MAX_CONNECTIONS,
    max_connections_per_client: int = OPT_MAX_PER_CLIENT,
    header_timeout_s: float = OPT_HEADER_TIMEOUT,
    idle_timeout_s: float = OPT_IDLE_TIMEOUT,
    web: bool = typer.Option(False, "--web", help="Serve the browser demo page on the HTTP port under /web/ "
                             "(built by `npm ci && npm run build:web` in clients/js)."),
    web_dir: Optional[str] = typer.Option(None, help="The built page folder for --web (default: clients/js/web/dist "
                                          "of this checkout)."),
):
    """Run the cloud prefill service until Ctrl-C (or --duration-s). Requests share a continuously
    batched engine; the HTTP side also serves the OpenAI-compatible API (/v1/chat/completions).

    SIGINT/SIGTERM stop it (open requests get 5 s) and it exits 0. When the engine fails (a fault
    outside any request), /healthz answers 503 with the reason, one line goes to stderr and the
    process exits with code 3, for a supervisor to restart it. Test hook:
    RELAYINFER_TEST_ENGINE_FAULT=1 breaks the engine's scheduler once the service is up, so the
    first request makes the engine fail."""
    _need_cloud("`relayinfer cloud serve`", "relayinfer.cloud.serve.service")
    tls = server_policy(host, token, insecure_no_auth, certfile, keyfile)  # before loading the model: fails fast
    limits = connection_limits(max_connections, max_connections_per_client, header_timeout_s, idle_timeout_s,
                               retry_after_ms)
    if memory_mb is not None and memory_mb < (kv_cache_mb or 0):
        fail(ValueError(f"--memory-mb {memory_mb} is below --kv-cache-mb {kv_cache_mb}: the budget holds the KV pool"))
    from relayinfer.cloud.engine.torch_engine import check_dtype_fits, pick_device, pick_dtype
    from relayinfer.cloud.models.llama import check_weights_fit
    from relayinfer.protocol.model.model_file import resolve_model_path

    flag = "--device"
    try:  # before loading the model, like the ports
        dev = pick_device(device)
        flag = "--dtype"
        dt = pick_dtype(dtype, dev)
        try:  # a bad --model (missing, corrupt) is reported where the model loads
            path = resolve_model_path(model)
            check_dtype_fits(dt, model_path=path)
        except RelayInferError:
            path = None
        flag = "--weights"
        try:  # the file's tensor types too, before the device model's export
            check_weights_fit(weights, dev, dt, model_path=path)
        except RelayInferError:  # a corrupt --model: reported where the model loads
            pass
    except ValueError as e:
        fail(ValueError(f"{flag}: {e}"))
    _check_ports(host, ("--port", port), ("--http-port", http_port))  # so does a busy port
    page = _web_page(web_dir) if web or web_dir else None
    _log_to_stderr()
    typer.echo("loading the model (torch)...", err=True)
    try:
        _ensure_device_model(model)
        if page is not None:  # the page runs model.fp32.onnx on WASM (MatMulNBits is ~8x slower there)
            _ensure_device_model(model, "fp32")
        svc = _cloud_service(model, device, threads, token, kv_cache_mb=kv_cache_mb or None, dtype=dtype,
                             weights=weights, metrics_public=metrics_public, max_sessions=max_sessions,
                             max_requests_per_session=max_requests_per_session, retry_after_ms=retry_after_ms,
                             max_queued_tokens=max_queued_tokens, max_queue_wait_ms=max_queue_wait_ms,
                             limits=limits, memory_bytes=None if memory_mb is None else memory_mb << 20,
                             kv_piece_bytes=kv_piece_kib << 10)
    except (RelayInferError, ValueError) as e:
        fail(ValueError(f"--kv-piece-kib {kv_piece_kib}: {e}") if str(e).startswith("kv_piece_bytes") else e)
    svc.http.web_dir = page

    async def up():
        try:
            await svc.start(host, port, http_port, ssl=tls)
        except OSError as e:  # taken between the check and now
            await svc.stop()
            fail(ValueError(f"cannot listen on {host} (--port {port}, --http-port {http_port}): {e.strerror or e}"))
        s = "s" if tls else ""
        if os.environ.get("RELAYINFER_TEST_ENGINE_FAULT") == "1" and svc.llm is not None:  # test hook, see the docstring
            def broken():
                raise RuntimeError("injected engine fault (RELAYINFER_TEST_ENGINE_FAULT)")

            svc.llm.engine.scheduler.schedule = broken
        typer.echo(f"cloud service: ws{s}://{host}:{svc.ws_port}  http{s}://{host}:{svc.http_port}  "
                   f"model {svc.model_name} {svc.fingerprint[:16]}"
                   + "".join(f"  {k} {v}" for k, v in svc.placement().items()) + ("" if token else "  (no --token: open to anyone who can connect)"),
                   err=True)
        if page is not None:
            typer.echo(f"demo page: http{s}://{host}:{svc.http_port}/web/" + ("#token=<the token>" if token else ""), err=True)

    serve_for(svc, duration_s, up)


def _web_page(web_dir: str | None) -> Path:
    """The built demo page folder of `cloud serve --web` (exit 2 naming what to build when it is missing)."""
    js = Path(__file__).resolve().parent.parent / "clients" / "js"
    d = Path(web_dir) if web_dir else js / "web" / "dist"
    missing = [f for f in ("index.html", "app.js", "ort-wasm-simd-threaded.wasm") if not (d / f).is_file()]
    if missing:
        fail(ValueError(f"--web: {d} has no built page ({', '.join(missing)} missing); build it with "
                        f"`cd {js} && npm ci && npm run build:web`" + (" or give --web-dir" if not web_dir else "")))
    return d


def _print_stream(stream, tty: bool) -> None:
    colours = {"cloud": "\x1b[36m", "device": "\x1b[32m"}
    for ev in stream:
        text = ev.text
        if tty:
            text = f"{colours[ev.source]}{text}\x1b[0m"
        sys.stdout.write(text)
        sys.stdout.flush()
    sys.stdout.write("\n")


# SmolLM2's model card recommends sampling at temperature 0.2, top_p 0.9; greedy decoding of a 135M
# model repeats itself. Seeded, so a demo run can be repeated (and split = device-only token for token).
DEMO_SAMPLING = dict(temperature=0.2, top_p=0.9, seed=0)
# The default conversation: chitchat-dataset's conversation 7, first turn (a 114-token prompt about changing
# the world). Of the first nine conversations it is one whose sampled answer runs to the 64-token limit without
# repeating itself, so the hand-off shows; the old default (a random six-turn chat) got one sentence eight times.
DEMO_CONVERSATION = dict(index=7, max_turns=2)
# What the demo chooses from, in order of preference, when no prompt / --max-new-tokens is given: the
# conversations (DEMO_CONVERSATION's first, then longer and shorter first turns) and the answer lengths. The
# first (conversation, length) whose plan is a split with the hand-off planned in the first DEMO_HANDOFF_SHARE
# of the answer is taken (`choose_demo`).
DEMO_CONVERSATIONS = (7, 1, 2, 3, 4, 5)
DEMO_LENGTHS = (64, 96, 128, 192, 256)
DEMO_HANDOFF_SHARE = 0.6


def choose_demo(candidates, lengths, timing_of, target_tpot_ms: float, max_interval_ms: float,
                share: float = DEMO_HANDOFF_SHARE) -> dict:
    """The demo's prompt and answer length, from the plan (`device.policy.plan`): the first of
    `candidates` ((label, prompt ids) pairs) and `lengths` (answer tokens, ascending) whose plan is
    a split handing off at an index h with 0 < h <= share x the length (`settings.catch_up` on the
    planned budget). `timing_of(n)` is the `settings.Timing` for an n-token prompt (the device fit,
    the client's measured cloud TTFT and TPOT, ms). Returns {'label', 'prompt_ids', 'max_new_tokens',
    'planned_handoff', 'budget', 'interval_ms', 'plan_reason', 'split': True}; when none fits, the
    first candidate at the longest length with 'split' False and the plan's reason."""
    from relayinfer.device.policy import PlanInput, plan
    from relayinfer.device.settings import catch_up

    first = None
    for label, ids in candidates:
        t = timing_of(len(ids))
        for n_new in lengths:
            p = plan(PlanInput(t, len(ids), n_new, target_tpot_ms, max_interval_ms=max_interval_ms))
            h = catch_up(t, len(ids), p.budget)[0] if p.budget is not None else None
            pick = {"label": label, "prompt_ids": list(ids), "max_new_tokens": n_new, "planned_handoff": h,
                    "budget": p.budget, "interval_ms": p.interval_ms, "plan_reason": p.reason,
                    "cloud_ttft_ms": t.cloud_ttft_ms, "cloud_tpot_ms": t.cloud_tpot_ms}
            if h is not None and 0 < h <= share * n_new:
                return {**pick, "split": True}
            if first is None and n_new == lengths[-1]:
                first = {**pick, "split": False}
    return first


def _sampling_line(sampling: dict) -> str:
    s = sampling
    seed = "a fresh one per answer" if s["seed"] is None else s["seed"]
    return (f"sampling: temperature {s['temperature']:g}, top_p {s['top_p']:g}, seed {seed}, at most "
            f"{s['max_new_tokens']} new tokens" + ("  (greedy)" if s["temperature"] == 0 else
                                                    "  (--temperature 0 for greedy decoding)"))


def _outcome(res) -> str:
    """What was planned and what happened, in words (the second summary line of demo and chat)."""
    if res.fault:
        return f"fault {res.fault}: {res.error}  (planned {res.plan})"
    if res.mode == "split" and res.handoff_index:
        n = len(res.token_ids)
        times = "once" if res.budget_extensions == 1 else f"{res.budget_extensions} times"
        ext = (f"; the device extended the cloud's budget {times} (its prefill ran later than planned)"
               if res.budget_extensions else "")
        return (f"split: the cloud streamed tokens 0-{res.handoff_index - 1}, the device took over at token "
                f"{res.handoff_index} and decoded {n - res.handoff_index} of the {n} (planned {res.plan}){ext}")
    if res.plan == "split" and res.mode == "cloud-only":
        end = "at the end-of-text token" if res.finish_reason == "eos" else f"({res.finish_reason})"
        return (f"planned split; the answer ended {end} after {len(res.token_ids)} tokens, before the device had "
                "caught up, so the cloud streamed all of it (no fault)")
    if res.plan == "split" and res.mode == "device-only":
        return "planned split; the device was ready before the cloud's first token, so it answered alone (no fault)"
    return f"planned {res.plan}: {res.plan_reason}"


@app.command()
def demo(
    prompt: Optional[str] = typer.Argument(None, help="User message; default: a real conversation from chitchat-dataset."),
    max_new_tokens: Optional[int] = typer.Option(None, min=1, help="Generated tokens at most; default: the "
                                                 "shortest answer for which the plan is a split (64..256)."),
    temperature: float = typer.Option(DEMO_SAMPLING["temperature"],
                                      help="Sampling temperature (0.2: SmolLM2's recommended value); 0 = greedy."),
    top_p: float = typer.Option(DEMO_SAMPLING["top_p"], help="Nucleus filter, in (0, 1]."),
    seed: Optional[int] = typer.Option(DEMO_SAMPLING["seed"], help="Sampling seed (same seed, same answer)."),
    target_tpot_ms: float = typer.Option(60.0, min=1.0, help="TPOT shown to the user (ms)."),
    profile: str = typer.Option("phone", help=f"Device profile pacing the device engine: {', '.join(_profiles())} (device/profiles/), or a JSON path."),
    cloud_budget: Optional[int] = typer.Option(None, min=1, help="Most tokens the cloud streams; default: the "
                                               "settings algorithm's (auto)."),
    model: Optional[str] = typer.Option(None, help="GGUF file or installed model name (`relayinfer models`); default SmolLM2-135M-Instruct."),
    quantize: Optional[str] = typer.Option(None, help="Device weights: gguf (default, the GGUF's own blocks), "
                                           "gguf-q8 (the MLP and 8-bit blocks on int8 activations: the fast one for an "
                                           "8-bit-heavy file such as Gemma 3's) or fp32."),
    as_json: bool = typer.Option(False, "--json", help="Print the GenerationResult as one JSON object."),
    certfile: Optional[str] = typer.Option(None, help="Embedded cloud over TLS (wss://): PEM certificate chain."),
    keyfile: Optional[str] = typer.Option(None, help="PEM private key of --certfile."),
    ca: Optional[str] = typer.Option(None, help="PEM CA file the device trusts for wss:// (a private CA)."),
    insecure: bool = typer.Option(False, "--insecure", help="Do not verify the cloud's TLS certificate."),
):
    """The main job: an embedded cloud service on loopback and a device session against it.

    Without a prompt or --max-new-tokens the demo chooses them (`choose_demo`) from the plan the
    device computes with its profile and the cloud figures it measured on a warm-up request, so
    that the plan is a split; the summary says where the hand-off happened, or what went wrong."""
    from relayinfer.device.profiles import load_profile
    from relayinfer.protocol.validate import check_prompt_text
    from relayinfer.protocol.model.decoding import SamplingParams

    say = (lambda m: typer.echo(m, err=True)) if not as_json else (lambda m: None)
    sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
    try:  # bad input fails here, before any model loads
        if prompt is not None:
            check_prompt_text(prompt)
        SamplingParams(**{**sampling, "max_new_tokens": max_new_tokens or DEMO_LENGTHS[0]})
        load_profile(profile)
        _check_quantize(quantize)
    except ValueError as e:
        fail(e, as_json)
    _need_cloud("`relayinfer demo` (it runs the cloud too)", "relayinfer.cloud.serve.service")
    tls = _server_tls(certfile, keyfile)
    _log_to_stderr()
    from relayinfer.cloud.serve.service import ServiceThread
    from relayinfer.sdk.client import Client
    from relayinfer.sdk.datasets import chitchat_prompt
    from relayinfer.sdk.heap import freeze_heap

    try:
        say("loading the cloud model (torch) and the device model (ONNX)...")
        _ensure_device_model(model, quantize, show=not as_json)
        svc = _cloud_service(model, "cpu", 1, None)
        with ServiceThread(svc, ssl=tls) as running:
            client = Client(cloud_url=running.url, model=model, quantize=quantize, target_tpot_ms=target_tpot_ms, profile=profile,
                            cloud_budget="auto" if cloud_budget is None else cloud_budget, ca=ca, verify=not insecure)
            problem = client.check_cloud()  # an unreachable cloud (e.g. TLS not trusted) is announced once, up front
            messages, choice = _demo_choice(client, prompt, max_new_tokens, target_tpot_ms, problem is None)
            sampling["max_new_tokens"] = choice["max_new_tokens"]
            if not prompt:
                for m in messages:
                    say(f"[{m['role']}] {m['content']}")
            say(f"cloud {running.url}  device profile {profile}  target TPOT {target_tpot_ms:.0f} ms")
            say(_choice_line(choice))
            say(_sampling_line(sampling))
            freeze_heap()  # both models, the dataset: no full collection walks them while the answer is shown
            stream = client.generate(messages, **sampling)
            if as_json:
                res = stream.collect()
            else:
                tty = sys.stdout.isatty()
                if tty:
                    say("(\x1b[36mcloud tokens\x1b[0m, \x1b[32mdevice tokens\x1b[0m)")
                _print_stream(stream, tty)
                res = stream.result
            device_only = client.complete(messages, **{**sampling, "max_new_tokens": 1}, mode="device-only")
    except (RelayInferError, ValueError) as e:
        fail(e, as_json)
    out = res.to_dict()
    out["device_only_ttft_ms"] = device_only.ttft_ms
    out["sampling"] = sampling
    out["demo"] = {k: v for k, v in choice.items() if k != "prompt_ids"}
    out["outcome"] = _outcome(res)
    from relayinfer.protocol.model.device_model import DEFAULT_WEIGHTS

    out["device_weights"] = quantize or DEFAULT_WEIGHTS
    if as_json:
        print(json.dumps(out))
        return
    if not sys.stdout.isatty():
        print(f"[cloud tokens 0..{(res.handoff_index or res.cloud_tokens) - 1}, device tokens after]"
              if res.cloud_tokens and res.device_tokens else "")
    typer.echo(
        f"mode {res.mode}  TTFT {res.ttft_ms:.0f} ms (device-only {device_only.ttft_ms:.0f} ms)  "
        f"TPOT p50 {res.tpot_ms_p50:.0f} ms max {res.tpot_ms_max:.0f} ms  stalls {res.stalls}  "
        f"cloud tokens {res.cloud_tokens}  device tokens {res.device_tokens}  hand-off at {res.handoff_index}", err=True)
    typer.echo(_outcome(res), err=True)


def _demo_choice(client, prompt: str | None, max_new_tokens: int | None, target_tpot_ms: float,
                 cloud_ok: bool) -> tuple[list[dict], dict]:
    """The demo's messages and `choose_demo`'s choice. Two cloud-only requests on the first
    candidate warm the cloud up and then measure it (TTFT, TPOT: `client.cloud`); the plan then uses
    the client's device fit (`Client.device_timing`) and those figures. A given prompt or
    --max-new-tokens is kept (only the other is chosen); without a cloud nothing is chosen."""
    from relayinfer.device.settings import Timing
    from relayinfer.device.split import SplitOptions
    from relayinfer.sdk.datasets import chitchat_prompt

    if prompt:
        convs = [("your prompt", [{"role": "user", "content": prompt}])]
    else:
        convs = [(f"chitchat conversation {i}", chitchat_prompt(index=i, max_turns=DEMO_CONVERSATION["max_turns"]))
                 for i in DEMO_CONVERSATIONS]
    lengths = (max_new_tokens,) if max_new_tokens else DEMO_LENGTHS
    if not cloud_ok or (prompt and max_new_tokens):
        return convs[0][1], {"label": convs[0][0], "max_new_tokens": lengths[-1] if not max_new_tokens
                             else max_new_tokens, "split": None, "chosen_by_plan": False}
    ids = {label: client.prompt_ids(m) for label, m in convs}
    client.complete(ids[convs[0][0]], max_new_tokens=4, mode="cloud-only")  # warms the cloud up (a cold first
    client.cloud = type(client.cloud)()  # request is slower than any later one: its figures are dropped)
    client.complete(ids[convs[0][0]], max_new_tokens=8, mode="cloud-only")  # measures the cloud
    a, b, d = client.device_timing()
    c = client.cloud
    pick = choose_demo(list(ids.items()), lengths, lambda n: Timing(a, b, d, c.ttft_ms(n), c.tpot_ms),
                       target_tpot_ms, SplitOptions(target_tpot_ms=target_tpot_ms).max_interval_ms())
    pick["chosen_by_plan"] = True
    return dict(convs)[pick["label"]], pick


def _choice_line(choice: dict) -> str:
    """The demo's choice in words."""
    if not choice.get("chosen_by_plan"):
        return f"{choice['label']}, at most {choice['max_new_tokens']} new tokens (not chosen by the plan)"
    head = (f"chose {choice['label']} ({len(choice['prompt_ids'])} prompt tokens) and {choice['max_new_tokens']} new "
            f"tokens from the plan (cloud measured: TTFT {choice['cloud_ttft_ms']:.0f} ms, TPOT "
            f"{choice['cloud_tpot_ms']:.0f} ms): ")
    if choice["split"]:
        return head + (f"a split, a cloud budget of {choice['budget']} tokens (the device extends it if its prefill "
                       f"runs late) and the device taking over near token {choice['planned_handoff']}, display every "
                       f"{choice['interval_ms']:.0f} ms")
    return head + f"no split fits ({choice['plan_reason']})"


@app.command()
def chat(
    cloud: str = typer.Option("ws://127.0.0.1:8765", help="ws:// or wss:// URL of a running `relayinfer cloud serve` "
                              "(its --port; the default is `cloud serve`'s own default)."),
    token: Optional[str] = typer.Option(None, envvar="RELAYINFER_TOKEN"),
    model: Optional[str] = typer.Option(None, help="GGUF file or installed model name (`relayinfer models`), the "
                                        "same as the cloud's; default SmolLM2-135M-Instruct."),
    quantize: Optional[str] = typer.Option(None, help="Device weights: gguf (default, the GGUF's own blocks), "
                                           "gguf-q8 (the MLP and 8-bit blocks on int8 activations: the fast one for an "
                                           "8-bit-heavy file such as Gemma 3's) or fp32."),
    profile: Optional[str] = typer.Option(None, help=f"Device profile pacing the device engine: {', '.join(_profiles())}, or a "
                                          "JSON path; default: this machine's own speed (often ready before the "
                                          "cloud's first token, so the answer is device-only)."),
    target_tpot_ms: float = typer.Option(50.0, min=1.0),
    max_new_tokens: int = typer.Option(256),
    temperature: float = typer.Option(DEMO_SAMPLING["temperature"], help="0 = greedy."),
    top_p: float = typer.Option(DEMO_SAMPLING["top_p"]),
    seed: Optional[int] = typer.Option(None, help="Sampling seed; default: a fresh one per answer."),
    ca: Optional[str] = typer.Option(None, help="PEM CA file trusted for a wss:// cloud (a private CA)."),
    insecure: bool = typer.Option(False, "--insecure", help="Do not verify the cloud's TLS certificate."),
    cloud_http: Optional[str] = typer.Option(None, "--cloud-http", help="http(s):// URL of the cloud's HTTP side "
                                             "(`cloud serve --http-port`): without --model, fetch the device model "
                                             "from there (cached by fingerprint, resumed when interrupted). "
                                             "Default: on a device-only install, where the cloud's handshake says."),
):
    """Interactive chat against a running cloud service (an empty line or Ctrl-D ends the chat).

    The chat is one `Conversation`: one websocket for all turns, and each turn prefills only what
    the previous turns did not (the device keeps its KV cache, the cloud its own)."""
    from relayinfer.device.profiles import load_profile
    from relayinfer.sdk.checks import check_cloud_url
    from relayinfer.protocol.model.decoding import SamplingParams

    sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
    try:  # bad input fails here, before the model loads
        check_cloud_url(cloud, "--cloud")
        SamplingParams(**sampling)
        if profile:
            load_profile(profile)
    except ValueError as e:
        fail(e)
    _log_to_stderr()
    from relayinfer.sdk.client import Client
    from relayinfer.sdk.heap import freeze_heap

    import urllib.error

    import importlib.util

    # the device model: from --cloud-http, exported here (full install), or, on a device-only
    # install without a model file, from where the cloud's Welcome says (the Client asks)
    local = model is not None or importlib.util.find_spec("onnx") is not None
    fetch = model is None and (cloud_http is not None or not local)
    progress, stop = _download_progress() if fetch else (None, lambda: None)
    try:
        _check_quantize(quantize)
        if quantize is not None and fetch:
            raise ValueError("--quantize applies to a device model exported here (--model); the cloud serves its "
                             "default device model")
        if not fetch:
            _ensure_device_model(model, quantize)
        client = Client(cloud_url=cloud, token=token, model=model, quantize=quantize, target_tpot_ms=target_tpot_ms, profile=profile,
                        ca=ca, verify=not insecure, cloud_http_url=cloud_http, progress=progress)
    except (RelayInferError, ValueError) as e:
        stop()
        fail(e)
    except urllib.error.URLError as e:
        stop()
        fail(ValueError(f"cannot fetch the device model from --cloud-http {cloud_http}: {getattr(e, 'reason', e)}"))
    stop()
    client.check_cloud()  # an unreachable cloud is announced once: "warning: cloud unreachable at ..."
    typer.echo(_sampling_line(sampling) + "; an empty line or Ctrl-D ends the chat", err=True)
    conv = client.conversation(**sampling)
    freeze_heap()  # start-up's objects: no full collection walks them while a turn is shown
    tty = sys.stdin.isatty()  # from a pipe or file: no "> " prompts in the output
    while True:
        try:
            line = input("> " if tty else "").strip()
        except EOFError:
            if tty:
                typer.echo()
            break
        if not line:
            break
        try:
            stream = conv.stream(line)
            _print_stream(stream, sys.stdout.isatty())
        except (RelayInferError, ValueError) as e:  # e.g. the conversation outgrew the context
            fail(e)
        res = stream.result
        note = f"; {_outcome(res)}" if res.fault or res.plan != res.mode else ""
        typer.echo(f"[{res.mode} TTFT {res.ttft_ms:.0f} ms, cloud {res.cloud_tokens} / device {res.device_tokens}"
                   f"{_reuse_note(res)}{note}]", err=True)
    conv.close()
    client.close()


def _reuse_note(res) -> str:
    """', reused 120 device / 118 cloud' for a later turn of a conversation, else ''."""
    dev, cloud = getattr(res, "device_cached_tokens", 0), getattr(res, "cloud_cached_tokens", 0)
    return f", reused {dev} device / {cloud} cloud" if dev or cloud else ""


bench_app = typer.Typer(help="Benchmarks (results under bench/results/).", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


@bench_app.command("split")
def bench_split(
    profile: str = typer.Option("phone", help=f"Device profile: {', '.join(_profiles())}, or a JSON path (with --goodput a comma list)."),
    prompts: int = typer.Option(12, help="Real chitchat prompts, spread over 64..2048 tokens (with --goodput: the "
                                "prompt pool, over three buckets of 64..192 tokens; at most 3 with --quick)."),
    out: Optional[str] = typer.Option(None, help="Results JSON; default bench/results/split-<profile>.json."),
    quick: bool = typer.Option(False, help="Smoke run: few prompts, short answers."),
    seed: int = typer.Option(0),
    link: Optional[list[str]] = typer.Option(None, help="Emulated link between device and cloud: loopback, wifi, "
                                             "lte, lossy (repeatable or a comma list; one run per link, default "
                                             "out bench/results/split-link-<link>.json, no capacity sweep; with "
                                             "--per-bucket: every prompt on each link in one run, with "
                                             "--no-capacity, out default bench/results/split-handoff-links.json)."),
    pin_cores: Optional[bool] = typer.Option(None, help="Pin the cloud and device model threads to two cores "
                                             "(default: on with --link)."),
    per_bucket: Optional[int] = typer.Option(None, min=1, help="The hand-off benchmark (bench/SPLIT.md): this many "
                                             "prompts per length bucket (<256, 256-511, 512-1023, >=1024) on the "
                                             "batched cloud, --profile a comma list (e.g. phone,laptop), answers of "
                                             "up to --max-new-tokens to EOS, then the capacity sweep; out default "
                                             "bench/results/split-handoff.json."),
    max_new_tokens: int = typer.Option(256, min=1, help="With --per-bucket: the split answers' token cap; with "
                                       "--goodput: every answer's cap (to EOS)."),
    capacity: bool = typer.Option(True, help="With --per-bucket: run the capacity sweep."),
    bucket_targets: Optional[str] = typer.Option(None, help="With --per-bucket: the prompt lengths drawn, a comma "
                                                 "list of tokens (default 160,384,720,1150: one per bucket; "
                                                 "720,1150: the >=512 buckets only)."),
    time_limit_s: float = typer.Option(1500.0, min=1.0, help="With --per-bucket: skip prompts after this many seconds; "
                                       "with --goodput: add no rate point after this many seconds."),
    goodput: bool = typer.Option(False, help="Cloud goodput under TTFT/TPOT SLOs (bench/goodput.py): Poisson rate "
                                 "sweeps of virtual devices, cloud-only and split per --profile (a comma list), "
                                 "chitchat prompts in three length buckets (--prompts: the pool), answers to EOS "
                                 "capped at --max-new-tokens, then real SplitSessions against virtual twins; out default "
                                 "bench/results/goodput.json (+ .md, .png). With --quick: two 20 s rate points, one "
                                 "validation request per rate."),
    target_tpot_ms: Optional[float] = typer.Option(None, min=1.0, help="With --goodput: the speed controller's "
                                                   "target TPOT of every virtual device, both modes (ms; default 50). "
                                                   "An SLO-aware choice is just under the TPOT SLO (e.g. 90 for 100): "
                                                   "the display then runs behind a faster cloud and its buffer absorbs "
                                                   "the cloud's step-time spikes."),
    model: Optional[str] = typer.Option(None, help="GGUF file or installed model name (`relayinfer models`); "
                                        "default SmolLM2-135M-Instruct."),
    quantize: Optional[str] = typer.Option(None, help="The device model's weights: gguf (default, the GGUF's own "
                                           "blocks), gguf-q8 (the MLP and 8-bit blocks on int8 activations, ~2x faster decode) or fp32."),
):
    """Split vs device-only vs cloud-only (and split+refine) on real conversations."""
    import shlex

    from relayinfer.sdk.linkem import PROFILES

    command = shlex.join(["relayinfer", *sys.argv[1:]])
    links = [x.strip() for item in link or [] for x in item.split(",") if x.strip()]
    try:
        _check_quantize(quantize)
        _check_model(model)  # a bad --model fails here, before any model loads
    except (RelayInferError, ValueError) as e:
        fail(e)
    bad = [x for x in links if x not in PROFILES]
    if bad:
        fail(ValueError(f"unknown link profile {bad[0]!r}; choose from {', '.join(PROFILES)}"))
    if bucket_targets is not None and per_bucket is None:
        fail(ValueError("--bucket-targets applies to --per-bucket only"))
    if target_tpot_ms is not None and not goodput:
        fail(ValueError("--target-tpot-ms applies to --goodput only (the other split benchmarks take the "
                        "profile's and the settings algorithm's pace)"))
    if out and len(links) > 1 and per_bucket is None:
        fail(ValueError("--out names one file: give one --link, or none and get split-link-<link>.json each"))
    if goodput:
        for flag, given in (("--link", bool(links)), ("--per-bucket", per_bucket is not None),
                            ("--no-pin-cores", pin_cores is False), ("--no-capacity", not capacity)):
            if given:
                fail(ValueError(f"{flag} does not apply to --goodput (a capacity sweep on the direct loopback, "
                                "cloud and load driver always pinned to two cores)"))
        profiles = [x.strip() for x in profile.split(",") if x.strip()]
        kw = dict(pool_size=min(prompts, 3), rates=(0.05, 0.4), duration_s=20.0, max_requests=12, warmup_s=5.0,
                  validate_rates=(0.0, 0.4), validate_per_rate=1, refine=0) if quick else dict(pool_size=prompts)
        if target_tpot_ms is not None:
            kw["target_tpot_ms"] = target_tpot_ms
        try:
            out = out or "bench/results/goodput.json"
            res = bench_module("goodput").run_goodput_bench(
                profiles, out, seed=seed, max_new_tokens=max_new_tokens,
                time_limit_s=time_limit_s, command=command, model=model, quantize=quantize, **kw)
        except (RelayInferError, ValueError) as e:
            fail(e)
        print(json.dumps({"goodput": res["goodput"], "validation": (res["validation"] or {}).get("summary")},
                         indent=1, default=str))
        wrote(out, Path(out).with_suffix(".md"), Path(out).with_suffix(".png"))
        return
    if per_bucket is not None:
        if links and capacity:
            fail(ValueError("--per-bucket with --link: add --no-capacity (the capacity sweep runs on the direct "
                            "loopback; run it without --link)"))
        profiles = [x.strip() for x in profile.split(",") if x.strip()]
        try:
            targets = tuple(int(x) for x in (bucket_targets or "").split(",") if x.strip())
            if any(t < 1 for t in targets):
                raise ValueError(f"--bucket-targets must be prompt lengths >= 1 token, got {bucket_targets!r}")
        except ValueError as e:
            fail(ValueError(f"--bucket-targets: a comma list of token counts, got {bucket_targets!r} ({e})"))
        out = out or ("bench/results/split-handoff-links.json" if links else "bench/results/split-handoff.json")
        try:
            res = bench_module("split").run_handoff_bench(
                profiles, per_bucket, out, seed=seed,
                max_new_tokens=max_new_tokens, capacity=capacity, time_limit_s=time_limit_s, command=command,
                links=links or None, model=model, quantize=quantize, **({"bucket_targets": targets} if targets else {}))
        except (RelayInferError, ValueError) as e:
            fail(e)
        print(json.dumps({"buckets": {k: {m: v[m] for m in ("handed_off_fraction", "ttft_p50_over_device_only",
                                                             "stalls", "tpot_ms_max", "result_modes")}
                                      for k, v in res["buckets"].items()}, "goals": res["goals"]}, indent=1, default=str))
        wrote(out, Path(out).with_suffix(".md"))
        return
    run_split_bench = bench_module("split").run_split_bench
    if not links:
        out = out or f"bench/results/split-{profile}.json"
        res = run_split_bench(profile, prompts, out, quick=quick, seed=seed,
                              pin_cores=bool(pin_cores), command=command, model=model, quantize=quantize)
        print(json.dumps(res.get("summary", res), indent=1, default=str))
        wrote(out, Path(out).with_suffix(".md"))
        return
    table = []
    written = []
    for name in links:
        written.append(out or f"bench/results/split-link-{name}.json")
        res = run_split_bench(profile, prompts, written[-1], quick=quick, seed=seed,
                              capacity=False, link=name, pin_cores=pin_cores is not False, command=command,
                              model=model, quantize=quantize)
        for mode, s in res["summary"]["link"]["per_mode"].items():
            table.append(f"{name:8s} {mode:12s} {s['ttft_ms_p50']:8.0f} {s['ttft_ms_p99']:8.0f} "
                         f"{s['ttft_p50_over_device_only'] or 0:6.2f} {s['stalls']:6d} {s['tpot_ms_p50']:7.0f} "
                         f"{s['tpot_ms_max']:7.0f} {s['fallbacks']:5d}  {s['result_modes']} {s['faults']}")
    print("link     mode         TTFTp50  TTFTp99  /dev  stalls TPOTp50 TPOTmax fallb  modes faults")
    print("\n".join(table))
    wrote(*written)


@bench_app.command("soak")
def bench_soak(
    devices: int = typer.Option(100, help="Virtual devices (each loops: connect, 1-3 requests, close, think)."),
    duration_s: float = typer.Option(600.0, help="Seconds during which devices start requests."),
    cloud_url: Optional[str] = typer.Option(None, help="ws:// URL of a running service; default: start "
                                            "`relayinfer cloud serve` on 127.0.0.1 with a random token."),
    http_url: Optional[str] = typer.Option(None, help="HTTP side of --cloud-url (/healthz, /metrics)."),
    token: Optional[str] = typer.Option(None, envvar="RELAYINFER_TOKEN", help="Token of --cloud-url."),
    server_pid: Optional[int] = typer.Option(None, help="Process id of --cloud-url's server (for its RSS)."),
    fault_rate: float = typer.Option(0.2, help="Probability per request of an injected fault."),
    seed: int = typer.Option(0),
    threads: int = typer.Option(1, help="torch threads of the started server."),
    request_timeout_s: float = typer.Option(120.0, help="A request with no end after this long is a failure (s)."),
    out: str = typer.Option("bench/results/soak.json", help="Results JSON."),
    model: Optional[str] = typer.Option(None, help="GGUF file or installed model name the started server runs (with "
                                        "--cloud-url: the one that server runs); default SmolLM2-135M-Instruct."),
):
    """Soak: virtual devices against one cloud service with disconnects, stalls, oversize frames,
    garbage, bad requests, cancels and bursts mixed in; tokens lost/duplicated must be 0 and the
    server's sessions, requests and KV blocks must be back to 0 after the run."""
    import shlex

    soak = bench_module("soak")
    run_soak, table = soak.run_soak, soak.table

    if not 0 <= fault_rate <= 1 or devices < 1 or duration_s <= 0:
        fail(ValueError("need --devices >= 1, --duration-s > 0 and 0 <= --fault-rate <= 1"))
    try:
        res = run_soak(devices, duration_s, cloud_url=cloud_url, http_url=http_url, token=token,
                       server_pid=server_pid, fault_rate=fault_rate, seed=seed, out=out, threads=threads,
                       request_timeout_s=request_timeout_s, command=shlex.join(["relayinfer", *sys.argv[1:]]),
                       progress=lambda m: typer.echo(m, err=True), model=model)
    except (RelayInferError, ValueError, RuntimeError, TimeoutError) as e:
        fail(e)
    print(table(res))
    wrote(out)
    if not res["passed"]["all"]:
        raise typer.Exit(1)


pd_app = typer.Typer(help="P/D serving: disaggregated prefill and decode pools on Ray.", no_args_is_help=True)
app.add_typer(pd_app, name="pd")


@pd_app.command("serve")
@sigterm_stops_startup("the P/D service")
def pd_serve(
    host: str = typer.Option("127.0.0.1", help="Listen address of the gateway."),
    port: int = typer.Option(8765, help="Websocket (device stream) port; 0 = any free port."),
    http_port: int = typer.Option(8766, help="HTTP port: OpenAI API, /healthz, /metrics, /v1/device-model; "
                                  "0 = any free port."),
    model: Optional[str] = typer.Option(None, help="GGUF file or installed model name (`relayinfer models`); default SmolLM2-135M-Instruct."),
    scenario: Optional[list[str]] = typer.Option(None, help="A P/D group: NAME:N_PREFILL:N_DECODE:TTFT_MS:TPOT_MS"
                                                 "[:MAX_PROMPT_TOKENS] (repeatable; default chat:1:1:2000:300)."),
    ray_address: Optional[str] = typer.Option(None, help="Join this Ray cluster ('auto' on a cluster node); "
                                              "default: start a local Ray."),
    transfer: str = typer.Option("contiguous", help="KV hand-off: contiguous or block-fixed."),
    forwarding: str = typer.Option("on-demand", help="on-demand (instances accept or reject) or push (stale reports)."),
    kv_cache_mb: int = typer.Option(128, min=1, help="Paged KV cache per instance (MiB)."),
    threads: int = typer.Option(1, min=1, help="torch threads per instance."),
    weights: str = typer.Option("fp32", help="Layer linears: fp32 (dequantized) or gguf (the file's own 4-bit "
                                "blocks, as `cloud serve --weights`)."),
    actor_cpus: float = typer.Option(1.0, min=0, help="Ray CPUs each instance reserves."),
    spread: bool = typer.Option(False, help="Spread instances across the cluster's nodes."),
    ratio_control: bool = typer.Option(False, help="Move instances between P and D (and lend idle ones across "
                                       "groups) from measured TTFT/TPOT."),
    prefix_routing: bool = typer.Option(True, help="Route a request to the instance that caches the longest prefix "
                                        "of its prompt (within a load slack); --no-prefix-routing: round-robin "
                                        "prefill, fewest-in-flight decode."),
    token: Optional[str] = typer.Option(None, envvar="RELAYINFER_TOKEN", help="Bearer token (devices and HTTP)."),
    duration_s: Optional[float] = typer.Option(None, min=0.0, help="Stop by itself after this many seconds."),
    export: bool = typer.Option(True, help="Serve the device model (exported once) on /v1/device-model."),
    certfile: Optional[str] = typer.Option(None, help="PEM certificate chain: serve wss:// and https:// (with --keyfile)."),
    keyfile: Optional[str] = typer.Option(None, help="PEM private key of --certfile."),
    memory_mb: int = typer.Option(512, min=1, help="Memory budget of the gateway's own request paths (MiB: "
                                  "refinement and per-request caches); more get OVERLOADED / 503."),
    insecure_no_auth: bool = OPT_INSECURE_NO_AUTH,
    max_connections: int = OPT_MAX_CONNECTIONS,
    max_connections_per_client: int = OPT_MAX_PER_CLIENT,
    header_timeout_s: float = OPT_HEADER_TIMEOUT,
    idle_timeout_s: float = OPT_IDLE_TIMEOUT,
):
    """The split service and the OpenAI API in front of P/D pools of Ray actors (a local Ray by
    default; --ray-address for a cluster). Same protocol as `relayinfer cloud serve`."""
    _need_cloud("`relayinfer pd serve`", "relayinfer.cloud.pd.service")
    from relayinfer.cloud.pd.instance import InstanceConfig
    from relayinfer.cloud.pd.kv import MODES
    from relayinfer.cloud.pd.service import make_pd_service, parse_scenario

    tls = server_policy(host, token, insecure_no_auth, certfile, keyfile)  # before Ray or any model starts
    limits = connection_limits(max_connections, max_connections_per_client, header_timeout_s, idle_timeout_s)
    _check_ports(host, ("--port", port), ("--http-port", http_port))  # a busy port: one line, before any model loads
    import torch

    from relayinfer.cloud.models.llama import check_weights_fit
    from relayinfer.protocol.model.model_file import resolve_model_path

    try:  # a bad --model (missing, corrupt) is reported where the model loads
        path = resolve_model_path(model)
    except RelayInferError:
        path = None
    try:
        try:  # the file's tensor types too, before any export or load
            check_weights_fit(weights, "cpu", torch.float32, model_path=path)
        except RelayInferError:
            pass
    except ValueError as e:
        fail(ValueError(f"--weights: {e}"))
    try:
        if transfer not in MODES:
            raise ValueError(f"--transfer {transfer!r}: choose contiguous or block-fixed")
        specs = [parse_scenario(s) for s in (scenario or ["chat:1:1:2000:300"])]
        from relayinfer.cloud.engine.torch_engine import TorchEngine
        from relayinfer.cloud.export import ensure_device_model

        engine = TorchEngine(model, device="cpu", threads=threads, weights=weights)
        model_dir = ensure_device_model(model) if export else None
        _warm_grammar(engine)
        svc = make_pd_service(engine, specs, InstanceConfig(kv_cache_bytes=kv_cache_mb << 20, transfer=transfer),
                              ray_address=ray_address, forwarding=forwarding, threads=threads, actor_cpus=actor_cpus,
                              spread=spread, ratio_control=ratio_control, prefix_routing=prefix_routing,
                              auth_token=token,
                              device_model_dir=model_dir, limits=limits, memory_bytes=memory_mb << 20)
    except (RelayInferError, ValueError) as e:
        fail(e)

    async def up():
        await svc.start(host, port, http_port, ssl=tls)
        groups = ", ".join(f"{g.name} {g.ratio}" for g in svc.llm.gateway.groups)
        s = "s" if tls else ""
        typer.echo(f"P/D service: ws{s}://{host}:{svc.ws_port}  http{s}://{host}:{svc.http_port}  groups {groups}  "
                   f"forwarding {forwarding}  KV {transfer}" + ("" if token else "  (no --token: open to anyone who "
                                                                "can connect)"), err=True)

    serve_for(svc, duration_s, up)


@bench_app.command("pd")
def bench_pd(
    parts: str = typer.Option("transfer,perf,sim", help="Comma list: transfer (KV hand-off 1k/4k/8k between two "
                              "Ray actors, real), perf (the engine's prefill and decode speeds here, real, fitted "
                              "for the simulator), sim (discrete-event, 8-64 instances, simulated), prefix (prefix hit rate of "
                              "multi-turn chats: one engine vs P/D with and without prefix-aware routing, real)."),
    out_dir: str = typer.Option("bench/results", help="Where pd-*.json and the plots go."),
    quick: bool = typer.Option(False, help="Smoke run: fewer sizes, requests and simulated instances."),
    seed: int = typer.Option(0),
    model: Optional[str] = typer.Option(None, help="GGUF file or installed model name (`relayinfer models`); "
                                        "default SmolLM2-135M-Instruct."),
):
    """P/D serving benchmark (bench/pd.py): transfer modes, the engine's speeds, simulation."""
    import shlex

    mod = bench_module("pd")
    try:
        _check_model(model)  # a bad --model fails here, before Ray starts
        res = mod.run([p.strip() for p in parts.split(",") if p.strip()], out_dir, quick=quick, seed=seed,
                      command=shlex.join(["relayinfer", *sys.argv[1:]]), model=model)
    except (RelayInferError, ValueError, OSError) as e:
        fail(e)
    print(json.dumps(res, indent=1, default=str))
    wrote(*(Path(out_dir) / f"pd-{part}.json" for part in res))


@bench_app.command("refine")
def bench_refine(
    lengths: str = typer.Option("128,192,256,384,512,768,1024,1536,2048", help="Comma list of prompt lengths (tokens)."),
    per_length: int = typer.Option(1, help="Chitchat prompts per length."),
    out: str = typer.Option("bench/results/refine.json", help="Results JSON (a PNG plot goes next to it)."),
    workers: int = typer.Option(1, help="Processes (one torch thread each)."),
    seed: int = typer.Option(0),
    model: Optional[str] = typer.Option(None, help="GGUF file or installed model name (`relayinfer models`); "
                                        "default SmolLM2-135M-Instruct."),
):
    """Prompt refinement scored on the refined prompt alone: attention vs recency vs random (bench/refine.py)."""
    import shlex
    from pathlib import Path

    mod = bench_module("refine")
    try:
        _check_model(model)  # a bad --model fails here, before the workers start
    except RelayInferError as e:
        fail(e)
    res = mod.bench_refine([int(x) for x in lengths.split(",") if x.strip()], per_length, out=out,
                           plot=str(Path(out).with_suffix(".png")), workers=workers, seed=seed,
                           command=shlex.join(["relayinfer", *sys.argv[1:]]), model=model)
    print(json.dumps(res["summary"], indent=1))
    wrote(out, Path(out).with_suffix(".png"))


_FORWARD = {"allow_extra_args": True, "ignore_unknown_options": True}


def wrote(*paths) -> None:
    """Say on stderr where a benchmark's results went (absolute paths of those that exist), as
    every `relayinfer bench` command ends."""
    for p in paths:
        if Path(p).exists():
            typer.echo(f"wrote {Path(p).resolve()}", err=True)


def _run_relay(args: list[str]) -> None:
    """Run `relayinfer relay ARGS` (sdk/relay_cli.py, loaded only now, after the cloud side it runs:
    it needs torch; its `bench` runs the driver bench/relay.py of a source checkout)."""
    mod = _need_cloud("`relayinfer relay`", "relayinfer.sdk.relay_cli", "relayinfer.cloud.relay.server")
    cmd = typer.main.get_command(mod.relay_app)
    _App.standalone(lambda: cmd.main(args=args, prog_name="relayinfer relay", standalone_mode=False), args)


@app.command("relay", context_settings=_FORWARD, add_help_option=False,
             help="GR relay: HSTU ranking with pre-inferred user prefixes (train, bench, serve; needs torch).")
def relay(ctx: typer.Context):
    _run_relay(list(ctx.args))


@bench_app.command("relay", context_settings=_FORWARD, add_help_option=False,
                   help="The GR relay cascade benchmark (same as `relayinfer relay bench`).")
def bench_relay(ctx: typer.Context):
    _run_relay(["bench", *ctx.args])


from relayinfer.sdk.patho_cli import bench_patho as _bench_patho, patho_app as _patho_app  # noqa: E402

app.add_typer(_patho_app, name="patho")
bench_app.command("patho", help="Pathology split screening on the real SVS (results in bench/results/).")(_bench_patho)


@app.command("models")
def models_cmd(
    model: Optional[list[str]] = typer.Option(None, "--model", help="Also describe this GGUF file (repeatable)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object per model."),
):
    """List the installed models (the names --model takes) and any --model files: architecture,
    file size, quantization, context length, layers and vocabulary."""
    from relayinfer.protocol.model.model_file import installed_models, model_summary

    try:
        rows = [model_summary(p, name) for name, p in installed_models().items()]
        rows += [model_summary(m) for m in model or []]
    except (RelayInferError, ValueError) as e:
        fail(e, as_json)
    if as_json:
        for r in rows:
            print(json.dumps(r))
        return
    head = ("name", "architecture", "size MB", "quantization", "context", "layers", "vocab", "path")
    table = [head] + [(r["name"], r["arch"], f"{r['size_bytes'] / 1e6:.0f}", r["quantization"].split(" (")[0],
                       str(r["context_length"]), str(r["n_layers"]), str(r["vocab_size"]), r["path"]) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(head) - 1)]
    for row in table:  # plain columns: the names --model takes stay whole at any terminal width (--json: all fields)
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1])


@app.command()
def calibrate(
    model: Optional[str] = typer.Option(None), threads: int = typer.Option(1),
    quantize: Optional[str] = typer.Option(None), refresh: bool = typer.Option(True),
):
    """Measure this device's prefill fit (a + b*n ms) and decode TPOT; cached for the settings algorithm."""
    from relayinfer.device.calibrate import calibrated
    from relayinfer.sdk.engines import load_engine

    try:
        prof = calibrated(load_engine("onnx", model, quantize, threads), refresh=refresh)
    except (RelayInferError, ValueError) as e:
        fail(e)
    print(json.dumps(prof.__dict__))


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
