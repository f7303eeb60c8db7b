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
