"""atheris target: the server session core (``ServerSession``), frame mode and ``stream=True``.

Input: ``data[0]`` is a mode byte — bit 0: stream framing (``receive_data`` in CRC-derived chunks)
instead of one ``receive_frame`` per frame; bit 1: a valid Hello is fed first, so the fuzzed frames
reach the OPEN state; bit 2: the server requires an auth token. ``data[1:]`` is a length-prefixed
frame stream (see ``_harness``). Every call's events, state, close error and ``data_to_send()``
output are compared with ``_harness.SessionModel``: nothing raises, a closed session stays closed
and silent, a ``ProtocolViolation`` leaves exactly one Error frame (decoding to that error) last in
the output, Pings are answered with the matching Pong, per-input time under 1 s.

Run: ``python tests/fuzz/fuzz_server.py [libFuzzer args] [corpus dirs]``;
import and call :func:`one_input` from tests.
"""

from __future__ import annotations

import contextlib
import os
import sys

import atheris

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

with atheris.instrument_imports(include=["relayinfer"]) if __name__ == "__main__" else contextlib.nullcontext():
    from relayinfer.protocol.session import HandshakeDone, State

    import _harness as h

STREAM, AFTER_HELLO, AUTH = 1, 2, 4
"""Mode-byte bits."""


def one_input(data: bytes) -> None:
    """Drive a fresh ServerSession with ``data``; raise ``AssertionError`` on a broken property."""
    if not data:
        return
    mode, payload = data[0], data[1:]
    stream, auth = bool(mode & STREAM), bool(mode & AUTH)
    with h.time_bound("fuzz_server", data):
        server = h.new_server(stream, auth)
        model = h.SessionModel("server", server, auth_token=h.TOKEN if auth else None)
        if mode & AFTER_HELLO:
            hello = h.hello_body(h.TOKEN if auth else None)
            step = model.step(hello)
            assert step[0] == ("done",)
            if stream:
                events = server.receive_data(len(hello).to_bytes(4, "big") + hello)
            else:
                events = server.receive_frame(hello)
            assert [type(e) for e in events] == [HandshakeDone] and server.state is State.OPEN
            h.check_call(server, events, [step], State.OPEN)
        if stream:
            h.run_stream(server, model, payload, h.chunk_cuts(data, len(payload)))
        else:
            h.run_frames(server, model, h.split_frames(payload))


def main(argv: list[str]) -> None:
    """libFuzzer entry point: ``argv`` as for any libFuzzer binary."""
    atheris.Setup(argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
