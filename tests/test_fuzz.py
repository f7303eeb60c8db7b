"""Fuzzing of the protocol layer: regressions found by the fuzzers, the corpus replayed through each
harness, and a CI-sized atheris (libFuzzer) run of every target in a subprocess."""

from __future__ import annotations

import importlib
import os
import sys

# Imported on purpose: without atheris installed this file fails to collect (an error, not a skip).
import atheris  # noqa: F401
import msgspec
import numpy as np
import pytest

from relayinfer.protocol.errors import ErrorCode, ProtocolError
from relayinfer.protocol.messages import MAX_TENSOR_DIMS, Scores, Tensor, decode, encode

FUZZ_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fuzz")
sys.path.insert(0, FUZZ_DIR)

import _harness as h  # noqa: E402
import runner  # noqa: E402

HARNESSES = {t: importlib.import_module(f"fuzz_{t}") for t in runner.TARGETS}


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


# -- the harnesses on the committed corpus (fast, deterministic) -------------------------------------


def _corpus(target: str) -> list[tuple[str, bytes]]:
    d = os.path.join(FUZZ_DIR, "corpus", target)
    out = []
    for name in sorted(os.listdir(d)):
        with open(os.path.join(d, name), "rb") as f:
            out.append((name, f.read()))
    return out


def test_corpus_is_small_and_covers_every_message_type():
    from relayinfer.protocol.messages import MESSAGE_TYPES

    sizes = {t: sum(len(b) for _, b in _corpus(t)) for t in runner.TARGETS}
    assert all(0 < s < 32 * 1024 for s in sizes.values()), sizes
    decoded = set()
    for _, body in _corpus("decode"):
        try:
            decoded.add(type(decode(body)))
        except ProtocolError:
            pass
    assert decoded == set(MESSAGE_TYPES.values())


@pytest.mark.parametrize("target", runner.TARGETS)
def test_harness_accepts_every_seed_in_every_mode(target):
    one_input = HARNESSES[target].one_input
    n = 0
    for _name, data in _corpus(target):
        for variant in ([data] if target == "decode" else [bytes([m]) + data[1:] for m in range(8)]):
            one_input(variant)
            n += 1
    assert n >= {"decode": 30, "server": 100, "client": 60}[target]


def test_harness_follows_the_session_through_a_known_stream():
    """The seed 'hello then traffic' reaches OPEN and delivers every client message in order."""
    data = dict(_corpus("server"))["m1_hello_then_traffic"]
    server = h.new_server(stream=True, auth=False)
    events = server.receive_data(data[1:])
    kinds = [type(e).__name__ for e in events]
    assert kinds[0] == "HandshakeDone" and kinds.count("MessageReceived") == 7 and server.state is h.State.OPEN
    out = [decode(f[4:]) for f in server.data_to_send()]
    assert [type(m).__name__ for m in out] == ["Welcome", "Pong"]


@pytest.mark.parametrize("mutant", ["pong_nonce", "closed_session_answers", "error_twice"])
def test_harness_catches_a_broken_session(mutant, monkeypatch):
    """The properties are not vacuous: a session with a planted bug fails them on the seed corpus."""
    from relayinfer.protocol import session as S
    from relayinfer.protocol.messages import Ping, Pong

    if mutant == "pong_nonce":
        orig = S._Session._handle

        def broken(self, msg):
            if isinstance(msg, Ping) and self.state is S.State.OPEN:
                self._out.append(self._frame(Pong(nonce=msg.nonce + 1, t_ms=msg.t_ms)))
                return []
            return orig(self, msg)
        monkeypatch.setattr(S._Session, "_handle", broken)
    elif mutant == "closed_session_answers":
        orig = S._Session.receive_frame

        def broken(self, data):
            if self.state is S.State.CLOSED:
                self.state = S.State.OPEN
                try:
                    return orig(self, data)
                finally:
                    self.state = S.State.CLOSED
            return orig(self, data)
        monkeypatch.setattr(S._Session, "receive_frame", broken)
    else:
        orig = S._Session._violation

        def broken(self, code, message):
            v = orig(self, code, message)
            self._out.append(self._out[-1])
            return v
        monkeypatch.setattr(S._Session, "_violation", broken)
    failures = 0
    for _name, data in _corpus("server"):
        for m in range(8):
            try:
                HARNESSES["server"].one_input(bytes([m]) + data[1:])
            except AssertionError:
                failures += 1
    assert failures >= 10


# -- CI-sized libFuzzer runs -------------------------------------------------------------------------

CI_RUNS = 20000
CI_SECONDS = 20


@pytest.mark.parametrize("target", runner.TARGETS)
def test_atheris_ci_run(target, tmp_path):
    """Each target runs under libFuzzer for CI_RUNS inputs or CI_SECONDS, from a copy of the corpus."""
    res = runner.run_target(target, str(tmp_path), seconds=CI_SECONDS, runs=CI_RUNS, timeout_s=10,
                            max_segments=1)
    if res.findings:
        f = res.findings[0]
        pytest.fail(f"{target}: libFuzzer {f.kind}; reproducer {f.artifact}: {f.data}\n{f.detail}")
    print(f"{target}: {res.executed} inputs in {res.seconds} s, cov {res.cov}, ft {res.ft}")
    assert res.segments == 1 and res.crashes == res.timeouts == res.ooms == 0
    # either all CI_RUNS inputs ran, or libFuzzer stopped at the time limit after a real amount of work
    assert res.executed == CI_RUNS or (res.executed >= 1000 and res.seconds >= CI_SECONDS - 1), res
    assert res.cov and res.cov > 20 and res.ft and res.ft >= res.cov, res
    assert res.corpus_units and res.corpus_units >= 5


CRASH_LOG = """INFO: seed corpus: files: 1 min: 2b max: 2b total: 2b rss: 40Mb
#2	INITED cov: 7 ft: 9 corp: 1/2b exec/s: 0 rss: 40Mb
#57	NEW    cov: 8 ft: 10 corp: 2/4b lim: 4 exec/s: 0 rss: 41Mb L: 2/2 MS: 1 ChangeByte-

 === Uncaught Python exception: ===
AssertionError: planted
Traceback (most recent call last):
  File "/tmp/crash_t.py", line 4, in one
AssertionError: planted

==6463== ERROR: libFuzzer: fuzz target exited
artifact_prefix='{d}/'; Test unit written to {d}/crash-06d9
stat::number_of_executed_units: 443625
stat::peak_rss_mb:              40
"""


def test_parse_output_reports_a_crash_with_its_reproducer(tmp_path):
    (tmp_path / "crash-06d9").write_bytes(b"AB")
    stats = runner.parse_output(CRASH_LOG.format(d=tmp_path))
    assert (stats.executed, stats.cov, stats.ft, stats.corpus_units, stats.peak_rss_mb) == (443625, 8, 10, 2, 40)
    f = stats.finding
    assert f.kind == "crash" and f.artifact == f"{tmp_path}/crash-06d9" and f.data == "b'AB'"
    assert f.detail.startswith("=== Uncaught Python exception") and "planted" in f.detail
    timeout = runner.parse_output("#10\tpulse  cov: 3 ft: 4 corp: 1/1b exec/s: 5 rss: 50Mb\n"
                                  "==1== ERROR: libFuzzer: timeout after 2 seconds\n")
    assert timeout.finding.kind == "timeout" and timeout.executed == 10
    oom = runner.parse_output("==1== ERROR: libFuzzer: out-of-memory (used: 2100Mb; exceeds: 2048Mb)\n")
    assert oom.finding.kind == "oom"
    assert runner.parse_output("#20000\tDONE   cov: 55 ft: 229 corp: 59/12429b lim: 1239 exec/s: 6666 rss: 65Mb\n"
                               "Done 20000 runs in 3 second(s)\n").finding is None
