"""A ranking instance as its own process, serving PreInfer / Rank over the shared protocol.

    python -m relayinfer.cloud.relay.server --port 0 [--host H] [--baseline] [--parent-pid PID] [--lifetime-s S]
                                            [--threads 1] [--cpus 1,2] [--token T] [--certfile F --keyfile K]
                                            [--insecure-no-auth] [--max-connections N]
                                            [--max-connections-per-client N] [--header-timeout-s S]

Prints `READY <port> <fingerprint>` on stdout once listening. Messages (relayinfer.protocol):
PreInfer (fire-and-forget signal; answered only by an Error on bad input), Rank -> Scores
(prefix_source hbm|dram|recompute|none) or Error(BAD_REQUEST | OVERLOADED | INTERNAL); Ping is
answered by the protocol session; any other message with a request_id -> Error(BAD_REQUEST).
Plain HTTP on the same port: `GET /stats` returns the instance counters as JSON; `GET /healthz`
answers as `relayinfer cloud serve`'s does: 200 `{"status": "ok"}` for anyone, plus
`model_fingerprint` (the hex sha256 the Hello must carry), `model` (the checkpoint's file name) and
`relay` (false with --baseline) for an authorized caller (no `--token` set, or the right bearer token),
so a client reads the fingerprint there (`client.server_fingerprint`) instead of from the READY line.
The websocket handshake cannot tell it: a Hello with another fingerprint is refused
(FINGERPRINT_MISMATCH) before any Welcome is sent.
Auth and TLS as every server (`protocol.transport.security`): `--token` (default: the `RELAYINFER_TOKEN`
environment variable) is required in the Hello and as `Authorization: Bearer` on `/stats` (401
otherwise); `--certfile`/`--keyfile` serve wss:// and https://; a non-loopback `--host` without a
token exits 2 unless `--insecure-no-auth`. Connections are capped at accept (`protocol.transport.limits`).
One compute thread runs the model; ranking requests go before queued pre-inferences.
The process stops by itself when its parent dies, after --lifetime-s, or on SIGTERM/SIGINT; the stop is
bounded (`protocol.transport.lifecycle`: open connections and queued rankings get 15 s, then are cancelled;
a second signal cancels at once).
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import inspect
import itertools
import json
import logging
import os
import queue
import sys
import threading
import time
from pathlib import Path

import torch

from relayinfer.protocol.errors import ErrorCode, ProtocolError
from relayinfer.protocol.messages import Error, PreInfer, Rank, Scores, Tensor
from relayinfer.protocol.transport.lifecycle import DRAIN_S, STOP_SLACK_S, close_loop, stop_signals, wait_bounded
from relayinfer.protocol.transport.limits import ConnectionGate, ConnectionLimits
from relayinfer.protocol.model.model_file import file_sha256
from relayinfer.protocol.transport.security import (TOKEN_ENV, bearer_token, check_exposure, server_context,
    token_matches)
from relayinfer.protocol.transport.ws import ServerChannel, serve

log = logging.getLogger("relayinfer.relay")

MAX_QUEUE = 256  # requests waiting for the compute thread before OVERLOADED


def fingerprint(path: Path) -> str:
    """sha256 of the checkpoint file (the model fingerprint checked at the handshake)."""
    return file_sha256(path)


class Worker:
    """One compute thread with a priority queue (0 = rank, 1 = pre-infer), FIFO within a priority.
    A job returning a generator is stepped; between steps a waiting higher-priority job runs first
    (chunked pre-inference: a ranking request waits at most one attention chunk)."""

    def __init__(self):
        self.q: queue.PriorityQueue = queue.PriorityQueue()
        self.seq = itertools.count()
        self.busy_s = 0.0   # wall seconds the compute thread spent running jobs (GET /stats: worker_busy_s)
        self.cpu_s = 0.0    # CPU seconds of the compute thread in those jobs (worker_cpu_s); busy_s / cpu_s
                            # > 1 means the thread waited for a core (a shared machine)
        threading.Thread(target=self._run, daemon=True, name="relay-compute").start()

    def submit(self, prio: int, fn, prio_fn=None) -> concurrent.futures.Future:
        """Queue fn (or a function returning a generator). prio_fn() -> current priority of a
        generator job between steps (priority inheritance: a pre-inference a ranking waits on)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.q.put((prio, next(self.seq), fn, fut, prio_fn))
        return fut

    def _run(self):
        while True:
            prio, seq, fn, fut, prio_fn = self.q.get()
            if fut.cancelled():  # its request left while it waited (a cancelled await): nothing to run
                continue
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                out = fn() if callable(fn) else fn
                if inspect.isgenerator(out):
                    try:
                        while True:
                            next(out)
                            prio = prio_fn() if prio_fn else prio
                            if not self.q.empty() and self.q.queue[0][0] < prio:
                                self.q.put((prio, seq, out, fut, prio_fn))   # resume after the ranking
                                break
                    except StopIteration as done:
                        _settle(fut, result=done.value)
                else:
                    _settle(fut, result=out)
            except BaseException as e:  # reported to the awaiting request, never kills the thread
                log.warning("relay job failed: %s: %s", type(e).__name__, e)
                _settle(fut, error=e)
            self.busy_s += time.perf_counter() - t0
            self.cpu_s += time.thread_time() - c0


def _settle(fut: concurrent.futures.Future, result=None, error: BaseException | None = None) -> None:
    """Resolve `fut` unless its awaiting request cancelled it meanwhile (then the result is dropped)."""
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


def _json_response(connection, status: int, body: dict):
    """A plain-HTTP answer on the websocket port: `body` as one line of JSON, Content-Type application/json."""
    resp = connection.respond(status, json.dumps(body) + "\n")
    del resp.headers["Content-Type"]  # respond() sets text/plain; a Headers object adds rather than replaces
    resp.headers["Content-Type"] = "application/json"
    return resp


def make_handler(inst, worker: Worker):
    """The per-connection protocol handler of a RankingInstance."""
    async def handle_rank(channel: ServerChannel, msg: Rank):
        try:
            if worker.q.qsize() >= MAX_QUEUE:
                raise OverflowError("ranking instance overloaded")
            job = inst.running_job(msg.user_id, msg.item_ids, msg.timestamps)
            if job is not None:   # its prefix is half-way: the worker finishes it first, then we rank on it
                job.boosted = True
                await asyncio.to_thread(job.event.wait, 60)
            fut = worker.submit(0, lambda: inst.rank(msg.user_id, msg.item_ids, msg.timestamps, msg.candidate_ids,
                                                         msg.request_ts))
            scores, source = await asyncio.wrap_future(fut)
            reply = Scores(request_id=msg.request_id, scores=Tensor.from_numpy(scores), prefix_source=source)
        except ValueError as e:
            reply = Error(code=ErrorCode.BAD_REQUEST.value, message=str(e), request_id=msg.request_id)
        except OverflowError as e:
            reply = Error(code=ErrorCode.OVERLOADED.value, message=str(e), request_id=msg.request_id)
        except Exception as e:
            reply = Error(code=ErrorCode.INTERNAL.value, message=f"{type(e).__name__}: {e}", request_id=msg.request_id)
        try:
            await channel.send(reply)
        except Exception:
            pass  # client gone

    async def handler(channel: ServerChannel):
        tasks = set()
        async for msg in channel:
            if isinstance(msg, PreInfer):
                try:
                    _, job = inst.submit_pre_infer(msg.user_id, msg.item_ids, msg.timestamps)
                    if job is not None:
                        worker.submit(1, job.steps, job.priority)
                except ValueError as e:
                    await channel.send(Error(code=ErrorCode.BAD_REQUEST.value, message=str(e), request_id=msg.request_id))
            elif isinstance(msg, Rank):
                t = asyncio.create_task(handle_rank(channel, msg))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            else:
                what = f"ranking instance does not handle {type(msg).__name__}"
                rid = getattr(msg, "request_id", None)
                if rid is None:   # connection-level: serve() answers with an Error frame and closes
                    raise ProtocolError(ErrorCode.BAD_REQUEST, what)
                await channel.send(Error(code=ErrorCode.BAD_REQUEST.value, message=what, request_id=rid))
        for t in list(tasks):
            await t
    return handler


async def amain(args) -> None:
    """Load the checkpoint and latency model, serve until stopped (see the module docstring)."""
    from relayinfer.cloud.relay.instance import InstanceConfig, RankingInstance
    from relayinfer.cloud.relay.latency import LatencyModel, measure
    from relayinfer.cloud.relay.train import default_checkpoint, load
    torch.set_num_threads(args.threads)
    model, _ = load(Path(args.checkpoint) if args.checkpoint else default_checkpoint())
    if not Path(args.latency).exists():   # fit the trigger's latency model on this machine once
        LatencyModel.fit(measure(model, [128, 256, 512, 1024, 2048], [100], repeats=2)).to_json(Path(args.latency))
    latency = LatencyModel.from_json(Path(args.latency))
    cfg = InstanceConfig(**json.loads(args.config)) if args.config else InstanceConfig()
    if isinstance(cfg.trigger, dict):
        from relayinfer.cloud.relay.trigger import TriggerConfig
        cfg.trigger = TriggerConfig(**cfg.trigger)
    cfg.relay = not args.baseline
    inst, worker = RankingInstance(model, latency, cfg), Worker()
    ck = Path(args.checkpoint) if args.checkpoint else default_checkpoint()
    fp = fingerprint(ck)

    def process_request(connection, request):
        authorized = not args.token or token_matches(bearer_token(request.headers.get("Authorization")), args.token)
        if request.path == "/healthz":  # public; the details (the fingerprint among them) only when authorized
            return _json_response(connection, 200, {"status": "ok", **({"model_fingerprint": fp, "model": ck.name,
                                                                        "relay": cfg.relay} if authorized else {})})
        if request.path == "/stats":
            if not authorized:
                resp = _json_response(connection, 401, {"error": {"code": ErrorCode.UNAUTHORIZED.value,
                                                                  "message": "send the instance token as "
                                                                  "'Authorization: Bearer <token>'"}})
                resp.headers["WWW-Authenticate"] = 'Bearer realm="relayinfer"'
                return resp
            return _json_response(connection, 200, {**inst.stats(), "pid": os.getpid(), "relay": cfg.relay,
                                                    "worker_busy_s": worker.busy_s, "worker_cpu_s": worker.cpu_s,
                                                    "cpus": sorted(os.sched_getaffinity(0))})
        return None

    loop = asyncio.get_running_loop()
    stop = loop.create_future()
    main = asyncio.current_task()

    def on_stop(name: str) -> None:
        if stop.done():  # a second signal: stop waiting for the open connections
            main.cancel()
        else:
            stop.set_result(name)

    installed = stop_signals(loop, on_stop)
    gate = ConnectionGate(ConnectionLimits(args.max_connections, args.max_connections_per_client,
                                           args.header_timeout_s))
    server = await serve(make_handler(inst, worker), args.host, args.port, expected_fingerprint=fp,
                         auth_token=args.token or None, gate=gate, process_request=process_request,
                         server="relay-instance", **({"ssl": args.ssl} if args.ssl is not None else {}))
    try:
        port = server.sockets[0].getsockname()[1]
        print(f"READY {port} {fp}", flush=True)
        t_end = time.monotonic() + args.lifetime_s
        while not stop.done() and time.monotonic() < t_end:
            if args.parent_pid and os.getppid() != args.parent_pid:
                break  # parent died: we were re-parented
            await asyncio.wait([stop], timeout=0.5)
    finally:  # bounded: open connections get the close handshake, queued rankings the drain, then cancelled
        server.close()
        gate.close()
        await wait_bounded(server.wait_closed(), DRAIN_S + STOP_SLACK_S, "connections did not end")
        for sig in installed:
            loop.remove_signal_handler(sig)


def add_server_arguments(p: argparse.ArgumentParser) -> None:
    """Auth, TLS and connection-limit options (the same as every server's; see the module docstring)."""
    defaults = ConnectionLimits()
    p.add_argument("--token", default=os.environ.get(TOKEN_ENV) or None,
                   help=f"bearer token clients must present (default: ${TOKEN_ENV}; none: no auth)")
    p.add_argument("--certfile", default=None, help="PEM certificate chain: serve wss:// and https:// (with --keyfile)")
    p.add_argument("--keyfile", default=None, help="PEM private key of --certfile")
    p.add_argument("--insecure-no-auth", action="store_true",
                   help="allow a non-loopback --host without a token (anyone who can connect is served)")
    p.add_argument("--max-connections", type=int, default=defaults.max_connections,
                   help=f"open connections at most (default {defaults.max_connections}); more get 503")
    p.add_argument("--max-connections-per-client", type=int, default=defaults.max_connections_per_client,
                   help=f"open connections per client address at most (default {defaults.max_connections_per_client})")
    p.add_argument("--header-timeout-s", type=float, default=defaults.header_timeout_s,
                   help=f"seconds for the opening handshake and the Hello, each (default {defaults.header_timeout_s})")


def check_server_arguments(p: argparse.ArgumentParser, args):
    """Apply the start-up policy (exit 2 via `p.error` naming the option); returns the server
    ssl.SSLContext of --certfile/--keyfile, or None."""
    try:
        check_exposure(args.host, args.token, args.insecure_no_auth)
        ConnectionLimits(args.max_connections, args.max_connections_per_client, args.header_timeout_s)
    except ValueError as e:
        p.error(str(e).replace("max_connections_per_client", "--max-connections-per-client")
                .replace("max_connections", "--max-connections").replace("header_timeout_s", "--header-timeout-s"))
    if (args.certfile is None) != (args.keyfile is None):
        p.error("--certfile and --keyfile go together: give both (TLS) or neither")
    if args.certfile is None:
        return None
    try:
        return server_context(args.certfile, args.keyfile)
    except ValueError as e:
        p.error(str(e))


def main(argv=None) -> None:
    """Command-line entry point."""
    from relayinfer.cloud.relay.train import checkpoint_path
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--host", default="127.0.0.1", help="listen address (a Ray-placed instance on another node "
                                                       "listens on its node's address)")
    p.add_argument("--checkpoint", default="", help="model checkpoint (default: the shipped ML-100K one)")
    p.add_argument("--latency", default=str(checkpoint_path().with_name("latency.json")))
    p.add_argument("--config", default="", help="InstanceConfig as JSON")
    p.add_argument("--baseline", action="store_true", help="disable the relay (full inference always)")
    p.add_argument("--parent-pid", type=int, default=0)
    p.add_argument("--lifetime-s", type=float, default=3600.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cpus", default="", help="comma-separated CPU ids to pin the process to (default: not pinned)")
    add_server_arguments(p)
    args = p.parse_args(argv)
    args.ssl = check_server_arguments(p, args)
    try:
        args.cpus = [int(c) for c in args.cpus.split(",") if c.strip()]
    except ValueError:
        p.error(f"--cpus must be comma-separated CPU ids, got {args.cpus!r}")
    if args.cpus:
        try:   # pinned before torch starts its threads (the benchmark gives each instance its own core)
            os.sched_setaffinity(0, args.cpus)
        except OSError as e:
            p.error(f"--cpus {args.cpus}: cannot pin to them ({e})")
    loop = asyncio.new_event_loop()
    try:  # not asyncio.run: it would wait for leftover tasks and executor threads without a bound
        loop.run_until_complete(amain(args))
    except (KeyboardInterrupt, asyncio.CancelledError):  # a second signal
        pass
    finally:
        close_loop(loop)


if __name__ == "__main__":
    main(sys.argv[1:])
