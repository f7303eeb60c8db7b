"""atheris target: the frame decoder (``messages.decode``) and ``framing.FrameBuffer``.

One input is checked three ways: the whole input as one frame body through ``decode``; the input as
a length-prefixed byte stream through ``FrameBuffer`` with a small limit (1 KiB) and the default
limit (64 MiB), fed in CRC-derived chunks and compared with a reference parser; and every body the
buffer delivers through ``decode`` again. See ``_harness.check_decode`` / ``check_frame_buffer``
for the properties.

Run: ``python tests/fuzz/fuzz_decode.py [libFuzzer args] [corpus dirs]``;
import and call :func:`one_input` from tests.
"""

from __future__ import annotations

import contextlib
import os
import sys

import atheris

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

with atheris.instrument_imports(include=["relayinfer"]) if __name__ == "__main__" else contextlib.nullcontext():
    from relayinfer.protocol.messages import MAX_FRAME_BYTES

    import _harness as h


def one_input(data: bytes) -> None:
    """Check the decoder and the frame buffer on ``data``; raise ``AssertionError`` on a broken property."""
    with h.time_bound("fuzz_decode", data):
        h.check_decode(data)
        cuts = h.chunk_cuts(data, len(data))
        for limit in (h.LIMIT, MAX_FRAME_BYTES):
            for body in h.check_frame_buffer(data, limit, cuts):
                h.check_decode(body)


def main(argv: list[str]) -> None:
    """libFuzzer entry point: ``argv`` as for any libFuzzer binary."""
    atheris.Setup(argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
