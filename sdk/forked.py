"""A service in a forked child process, started and stopped over one pipe.

The child runs `serve(conn, *args)`: it sends one message when it is ready (what it serves, e.g.
its URLs), then waits on `conn` for the parent's "stop" (or the parent going away), may send one
last message (e.g. counters), and returns. The parent closes its copy of the child's pipe end right
after the fork, so a child that exits or dies shows up at once as the pipe's end, not as a wait
that runs to its bound. Benchmarks use it to keep a cloud or a link emulator off the measured
process's interpreter and core (`bench.split`, `sdk.linkem.LinkProxyProcess`).
"""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Callable
from typing import Any


class ForkedChild:
    """`serve(conn, *args)` in a forked daemon child named `name`.

    Fork before this process starts a thread or loads a model (a fork copies only the forking
    thread; a lock another thread held stays held in the child).

    Args:
        serve: the child's body, called as serve(conn, *args); see the module docstring.
        args: its arguments after the pipe end.
        name: the child process's name (shown by `ps` and in errors).
        start_timeout_s: how long `start` waits for the ready message (s).
    """

    def __init__(self, serve: Callable[..., None], args: tuple = (), *, name: str, start_timeout_s: float):
        ctx = multiprocessing.get_context("fork")
        self._conn, self._child_conn = ctx.Pipe()
        self._proc = ctx.Process(target=_child_main, args=(self._conn, serve, self._child_conn, *args), daemon=True,
                                 name=name)
        self.name = name
        self.start_timeout_s = start_timeout_s

    @property
    def pid(self) -> int | None:
        """The child's process id (None before `start`)."""
        return self._proc.pid

    def start(self) -> Any:
        """Fork the child and return its ready message.

        Raises:
            RuntimeError: the child exited before it was ready, or did not send a whole message
                within `start_timeout_s` (a message begun but not finished gets as long again);
                the child is stopped first.
        """
        if self._proc.pid is not None:
            raise RuntimeError(f"the {self.name} process was started already")
        self._proc.start()
        self._child_conn.close()  # the child holds its own copy; ours would hide the child's exit
        try:
            got, msg = self._recv(self.start_timeout_s)
            if got:
                return msg
        except (EOFError, OSError):
            self.stop(0.0)
            code = self._proc.exitcode
            raise RuntimeError(f"the {self.name} process exited before it was ready (exit code {code})") from None
        self.stop(0.0)
        raise RuntimeError(f"the {self.name} process did not start within {self.start_timeout_s:g} s")

    def stop(self, result_timeout_s: float = 30.0, grace_s: float = 10.0) -> Any | None:
        """Tell the child to stop and return its last message, or None when it sent none (it exited
        without one, or sent no whole message within `result_timeout_s`, or as long again once
        begun). The child is then joined, sent SIGTERM if it is still alive `grace_s` later and
        SIGKILL `grace_s` after that. Safe to call twice, and a no-op before `start`."""
        result = None
        if self._proc.pid is None:  # never started
            return None
        try:
            self._conn.send("stop")
            result = self._recv(result_timeout_s)[1]
        except (EOFError, OSError):
            pass
        for end in (None, self._proc.terminate, self._proc.kill):
            if end is not None and self._proc.is_alive():
                end()
            self._proc.join(grace_s)
        self._conn.close()
        return result

    def _recv(self, timeout_s: float) -> tuple[bool, Any]:
        """(True, the child's next message) when one starts within `timeout_s` and ends within as
        long again; else (False, None), the child killed when it stalled inside a message (its
        pipe end closes, which ends the read). EOFError / OSError: the pipe ended."""
        if not self._conn.poll(timeout_s):
            return False, None
        box: dict = {}

        def read():
            try:
                box["msg"] = self._conn.recv()
            except BaseException as e:  # handed to the caller's thread
                box["err"] = e

        reader = threading.Thread(target=read, name=f"{self.name}-recv", daemon=True)
        reader.start()
        reader.join(timeout_s)
        if reader.is_alive():  # a message begun and not finished: the child is stuck mid-write
            self._proc.kill()
            reader.join(5.0)
            return False, None
        if "err" in box:
            raise box["err"]
        return True, box["msg"]


def _child_main(parent_end, serve: Callable[..., None], conn, *args) -> None:
    """The child's entry: close its inherited copy of the parent's pipe end first, so that the
    parent's exit (however it ends) reaches `serve` as the pipe's end (`conn.poll` returns, `recv`
    raises EOFError), then run `serve(conn, *args)`."""
    parent_end.close()
    serve(conn, *args)
