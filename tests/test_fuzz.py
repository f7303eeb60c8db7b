"""Fuzzing of the protocol layer: regressions found by the fuzzers, the corpus replayed through each
harness, and a CI-sized atheris (libFuzzer) run of every target in a subprocess."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from relayinfer.protocol.errors import ErrorCode, ProtocolError
from relayinfer.protocol.messages import MAX_TENSOR_DIMS, Scores, Tensor, decode, encode


# -- regressions: inputs that once broke the decoder's contract -------------------------------------

def _scores(shape, data=b"", dtype="uint8") -> bytes:
    return msgspec.msgpack.encode({"type": "scores", "request_id": "r", "prefix_source": "x",
                                   "scores": {"dtype": dtype, "shape": shape, "data": data}})


@pytest.mark.parametrize("frame", [
    b"\x82\xa4type\xa6cancel\xaarequest_id" + b"\x91" * 1200 + b"\xc0",  # nested inside a known field
    b"\x83\xa4type\xa6cancel\xaarequest_id\xa1r\xa1x" + b"\x91" * 1200 + b"\xc0",  # inside an unknown field
    b"\x91" * 5000,  # not even a map
], ids=["known-field", "unknown-field", "bare-array"])
def test_deep_nesting_is_bad_frame_not_recursion_error(frame):
    # was: RecursionError escaped decode() and ServerSession.receive_frame()
    with pytest.raises(ProtocolError, match="nested too deeply|not a message map") as exc:
        decode(frame)
    assert exc.value.code is ErrorCode.BAD_FRAME


@pytest.mark.parametrize("shape, data, match", [
    ([1] * 40, b"a", "tensor has 40 dimensions; at most 32 are allowed"),
    ([1] * 100, b"a", "tensor has 100 dimensions"),
    ([2**32, 2**32, 0], b"", r"too large to address"),
    ([0, 2**64 - 1], b"", r"too large to address"),
])
def test_tensor_that_numpy_cannot_build_is_bad_frame(shape, data, match):
    # was: decode() accepted these and Tensor.to_numpy() then raised ValueError in the receiver
    with pytest.raises(ProtocolError, match=match) as exc:
        decode(_scores(shape, data))
    assert exc.value.code is ErrorCode.BAD_FRAME


def test_tensor_limits_keep_every_accepted_tensor_convertible():
    edge = decode(_scores([0, 2**63 - 1])).scores  # itemsize 1: exactly addressable, still empty
    assert edge.to_numpy().shape == (0, 2**63 - 1)
    t = decode(_scores([1] * MAX_TENSOR_DIMS, b"\x07")).scores
    assert t.to_numpy().ndim == 32 and t.to_numpy().item() == 7
    with pytest.raises(ProtocolError, match="too large to address"):
        decode(_scores([0, 2**62], dtype="int32"))  # 4 * 2**62 bytes overflow intp although it is empty
    with pytest.raises(ProtocolError, match="33 dimensions"):
        Tensor.from_numpy(np.zeros([1] * 33, np.uint8))
    assert decode(encode(Scores("r", Tensor.from_numpy(np.zeros([1] * 32, np.int8)), "x"))).scores.shape == [1] * 32
