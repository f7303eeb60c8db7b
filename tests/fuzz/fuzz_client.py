"""atheris target: the client session core (``ClientSession``) answering arbitrary Welcome bytes.

Input: ``data[0]`` bit 0 selects stream framing; ``data[1:]`` is a length-prefixed frame stream
(see ``_harness``) fed to a ClientSession after ``start()`` (its Hello is checked to decode). The
first frame plays the server's answer to the Hello, later ones the server's traffic; events, state
and output are compared with ``_harness.SessionModel`` (same properties as ``fuzz_server``).

Run: ``python tests/fuzz/fuzz_client.py [libFuzzer args] [corpus dirs]``;
import and call :func:`one_input` from tests.
"""

from __future__ import annotations

import contextlib
import os
import sys

import atheris

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

with atheris.instrument_imports(include=["relayinfer"]) if __name__ == "__main__" else contextlib.nullcontext():
    from relayinfer.protocol.messages import Hello, decode

    import _harness as h

STREAM = 1
"""Mode-byte bit."""


def one_input(data: bytes) -> None:
    """Drive a fresh ClientSession with ``data``; raise ``AssertionError`` on a broken property."""
    if not data:
        return
    stream, payload = bool(data[0] & STREAM), data[1:]
    with h.time_bound("fuzz_client", data):
        client = h.new_client(stream)
        hello = client.start()
        assert isinstance(decode(hello[4:] if stream else hello), Hello)
        model = h.SessionModel("client", client)
        if stream:
            h.run_stream(client, model, payload, h.chunk_cuts(data, len(payload)))
        else:
            h.run_frames(client, model, h.split_frames(payload))


def main(argv: list[str]) -> None:
    """libFuzzer entry point: ``argv`` as for any libFuzzer binary."""
    atheris.Setup(argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
