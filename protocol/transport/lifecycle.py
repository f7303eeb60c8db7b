"""Running a server process until it is told to stop, with a shutdown that always ends (torch-free).

`run_server(svc, up, duration_s)` is what every `serve` command runs (`cloud serve`, `pd serve`,
`patho serve`; `relay serve` uses `stop_signals` and `close_loop` around its own wait):

* SIGINT and SIGTERM are handled on the event loop: the server stops and the process exits 0. A
  second signal while it stops cancels what is left at once.
* `svc.health()` (when the service has it) is polled every `poll_s`: a reason (not None) means the
  service cannot go on (its engine or its P/D pool failed): one line on stderr, then the process
  stops and exits `EXIT_FAILED` (3), so a supervisor restarts it.
* `svc.stop()` gets `drain_s` + `STOP_SLACK_S` seconds; then it is cancelled. Every task left on
  the loop is cancelled and waited for at most `CANCEL_WAIT_S`, and the loop's default executor is
  not waited for (asyncio.run would wait for its threads without a bound).
"""
from __future__ import annotations

import asyncio
import logging
import signal
import sys

log = logging.getLogger("relayinfer.serve")

EXIT_FAILED = 3       # exit code of a server that cannot go on (its engine or P/D pool failed)
DRAIN_S = 5.0         # seconds open requests get to finish after SIGINT/SIGTERM
STOP_SLACK_S = 10.0   # on top of drain_s for svc.stop() (engine thread join, listener close)
CANCEL_WAIT_S = 2.0   # wait for cancelled leftover tasks (s)


def stop_signals(loop: asyncio.AbstractEventLoop, on_stop) -> list[int]:
    """Call `on_stop(signal name)` on SIGINT/SIGTERM (on the loop); returns the signals installed
    (none outside the main thread)."""
    done = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_stop, sig.name)
            done.append(sig)
        except (ValueError, RuntimeError, NotImplementedError):  # not the main thread / no signals here
            pass
    return done


async def wait_bounded(aw, seconds: float, what: str) -> bool:
    """Await `aw` for at most `seconds` (the bounded end of a stop). On the bound, log one warning
    naming `what` ("<what> within N s of the stop; cancelled") and return False; a cancellation
    (a second signal) also ends the wait. True when `aw` finished in time."""
    try:
        await asyncio.wait_for(aw, seconds)
        return True
    except asyncio.TimeoutError:
        log.warning("%s within %.0f s of the stop; cancelled", what, seconds)
    except asyncio.CancelledError:
        pass
    return False


def close_loop(loop: asyncio.AbstractEventLoop, wait_s: float = CANCEL_WAIT_S) -> None:
    """Cancel every task left on `loop`, wait for them at most `wait_s` s, close async generators
    (bounded too) and the loop, without waiting for its default executor's threads."""
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for t in tasks:
        t.cancel()
    if tasks:
        loop.run_until_complete(asyncio.wait(tasks, timeout=wait_s))
        left = [t for t in tasks if not t.done()]
        if left:
            log.warning("%d tasks did not end within %.0f s of their cancellation", len(left), wait_s)
    try:
        loop.run_until_complete(asyncio.wait_for(loop.shutdown_asyncgens(), wait_s))
    except (asyncio.TimeoutError, Exception):  # pragma: no cover - a generator that will not close
        pass
    executor = getattr(loop, "_default_executor", None)
    if executor is not None:  # its threads finish their current call on their own; nothing waits for them
        executor.shutdown(wait=False, cancel_futures=True)
        loop._default_executor = None
    loop.close()


async def _serve(svc, up, duration_s: float | None, drain_s: float, poll_s: float) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    main = asyncio.current_task()

    def on_stop(name: str) -> None:
        if stop.is_set():  # a second signal: stop waiting for the drain
            log.warning("%s again: cancelling the shutdown", name)
            main.cancel()
            return
        log.info("%s: stopping (open requests get %.0f s)", name, drain_s)
        stop.set()

    installed = stop_signals(loop, on_stop)
    code = 0
    try:
        await up()
    except BaseException:
        for sig in installed:
            loop.remove_signal_handler(sig)
        raise
    try:
        health = getattr(svc, "health", None)
        t_end = None if not duration_s else loop.time() + duration_s
        while not stop.is_set():
            wait = poll_s if t_end is None else min(poll_s, t_end - loop.time())
            if wait <= 0:
                break
            try:
                await asyncio.wait_for(stop.wait(), wait)
            except asyncio.TimeoutError:
                pass
            why = health() if callable(health) else None
            if why is not None:
                print(f"error: {why}; exiting with code {EXIT_FAILED}", file=sys.stderr, flush=True)
                code = EXIT_FAILED
                break
    finally:
        await wait_bounded(svc.stop(), drain_s + STOP_SLACK_S, "the server did not stop")
        for sig in installed:
            loop.remove_signal_handler(sig)
    return code


def run_server(svc, up, duration_s: float | None = None, drain_s: float = DRAIN_S, poll_s: float = 0.5) -> int:
    """Run `up()` (a coroutine function that starts `svc`), then serve until SIGINT/SIGTERM,
    `duration_s` seconds, or `svc.health()` naming a reason; stop `svc` (bounded, see the module
    docstring). Returns the exit code: 0, or `EXIT_FAILED` when the service failed."""
    loop = asyncio.new_event_loop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(_serve(svc, up, duration_s, drain_s, poll_s))
    except (KeyboardInterrupt, asyncio.CancelledError):  # no handler installed, or a second signal
        return 0
    finally:
        close_loop(loop)
        asyncio.set_event_loop(None)
