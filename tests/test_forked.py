"""`sdk.forked.ForkedChild`: ready message, last message, and a child that dies or stays silent."""

import os
import time

import pytest

from relayinfer.sdk.forked import ForkedChild


def _serve_pid_then_count(conn, start: int) -> None:
    conn.send(os.getpid())
    n = start
    while conn.poll(5) and conn.recv() != "stop":
        n += 1
    conn.send({"count": n})


def _serve_nothing_last(conn) -> None:
    conn.send("ready")
    conn.poll(30)


def _die_before_ready(conn) -> None:
    os._exit(3)


def _never_ready(conn) -> None:
    conn.poll(30)  # sends nothing; leaves when told to stop


def test_ready_and_last_message_cross_the_pipe():
    child = ForkedChild(_serve_pid_then_count, (41,), name="counter", start_timeout_s=10)
    pid = child.start()
    assert pid == child.pid != os.getpid()
    assert child.stop() == {"count": 41}
    assert not child._proc.is_alive()
    assert child.stop() is None  # a second stop: the pipe is gone, nothing to return


def test_a_child_without_a_last_message_stops_without_waiting_out_the_bound():
    child = ForkedChild(_serve_nothing_last, name="quiet", start_timeout_s=10)
    assert child.start() == "ready"
    t0 = time.monotonic()
    assert child.stop(result_timeout_s=20) is None
    assert time.monotonic() - t0 < 10  # the child's exit ends the wait (the parent closed its copy of the pipe end)
    assert child._proc.exitcode == 0


def test_a_child_that_dies_before_ready_is_an_error_at_once():
    child = ForkedChild(_die_before_ready, name="doomed", start_timeout_s=20)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"the doomed process exited before it was ready \(exit code 3\)"):
        child.start()
    assert time.monotonic() - t0 < 10


def test_a_child_that_never_gets_ready_is_stopped_after_the_bound():
    child = ForkedChild(_never_ready, name="slow", start_timeout_s=0.5)
    with pytest.raises(RuntimeError, match=r"the slow process did not start within 0.5 s"):
        child.start()
    assert not child._proc.is_alive()


def _ignore_sigterm(conn) -> None:
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn.send("ready")
    time.sleep(60)


@pytest.mark.parametrize("serve", [_ignore_sigterm, "_ready_then_half_a_last_message"])
def test_a_stuck_child_is_stopped_in_bounded_time(serve):
    """A child that ignores "stop" and SIGTERM is killed (SIGKILL); one stalled inside its last
    message does not block `stop` in recv: both end within a few seconds, with no last message."""
    serve = globals()[serve] if isinstance(serve, str) else serve
    child = ForkedChild(serve, name="stuck", start_timeout_s=10)
    assert child.start() == "ready"
    t0 = time.monotonic()
    assert child.stop(result_timeout_s=0.5, grace_s=0.5) is None
    assert time.monotonic() - t0 < 10 and child._proc.exitcode == -9  # killed: it would not end by itself


def test_stop_before_start_is_a_no_op_and_start_twice_is_an_error():
    child = ForkedChild(_serve_pid_then_count, (0,), name="counter", start_timeout_s=10)
    t0 = time.monotonic()
    assert child.stop() is None and time.monotonic() - t0 < 1  # nothing queued for a later start
    assert isinstance(child.start(), int)
    with pytest.raises(RuntimeError, match="started already"):
        child.start()
    assert child.stop() == {"count": 0}


PARENT = """
import os, sys, time
from relayinfer.sdk.forked import ForkedChild

def serve(conn):
    conn.send(os.getpid())
    conn.poll(60)  # returns at once when the parent goes: the pipe's end

child = ForkedChild(serve, name="orphan", start_timeout_s=10)
print(child.start(), flush=True)
os.kill(os.getpid(), 9)  # the parent dies without stopping it
"""


def test_the_child_stops_when_its_parent_is_killed():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", PARENT], capture_output=True, text=True, timeout=60)
    assert out.returncode == -9
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        raise AssertionError(f"the child {pid} outlived its killed parent by 10 s")


def _half_a_message(conn) -> None:
    import struct

    os.write(conn.fileno(), struct.pack("!i", 1000) + b"only part of it")  # a 1000-byte message, 15 sent
    time.sleep(60)


def test_a_child_stalled_inside_its_ready_message_is_an_error_in_bounded_time():
    """A child that writes the start of its ready message and hangs: start fails within about
    twice start_timeout_s (not forever in recv), the child killed."""
    child = ForkedChild(_half_a_message, name="half", start_timeout_s=1)
    t = time.monotonic()
    with pytest.raises(RuntimeError, match="the half process did not start within 1 s"):
        child.start()
    assert time.monotonic() - t < 10
    assert not child._proc.is_alive()


def _ready_then_half_a_last_message(conn) -> None:
    import struct

    conn.send("ready")
    conn.recv()  # "stop"
    os.write(conn.fileno(), struct.pack("!i", 1000) + b"part")
    time.sleep(60)
