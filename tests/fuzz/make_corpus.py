"""Write the committed seed corpus: ``python tests/fuzz/make_corpus.py`` (overwrites tests/fuzz/corpus/).

Seeds per target (a few KB in all): every message type encoded (Tensor-carrying ones included),
stream-framed runs of them, a valid Hello (with and without token), truncated and oversized frames,
and the reproducers of bugs the fuzzers found (deep MessagePack nesting, unaddressable tensor shapes).
Session seeds start with the mode byte described in ``fuzz_server.py`` / ``fuzz_client.py``.
"""

from __future__ import annotations

import os
import shutil
import sys

import msgspec
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness as h  # noqa: E402
from relayinfer.protocol.framing import pack_frame  # noqa: E402
from relayinfer.protocol.messages import (  # noqa: E402
    PROTOCOL_VERSION, Cancel, Done, Embeddings, Error, ExtendBudget, Generate, Hello, KVTransfer, Ping, Pong,
    PreInfer, Rank, RefinedPrompt, Scores, Stop, Tensor, TileBatch, Token, Welcome, encode,
)

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")

SAMPLES = {
    "hello": Hello(protocol_version=PROTOCOL_VERSION, model_fingerprint=h.FP, token=h.TOKEN, client="fuzz"),
    "welcome": Welcome(protocol_version=PROTOCOL_VERSION, model_fingerprint=h.FP, server="s", session_id="x"),
    "generate": Generate(request_id="r1", prompt_ids=[1, 2, 3], max_new_tokens=8, temperature=0.7, top_p=0.9,
                         top_k=40, seed=7, cloud_budget=4, refine=0.5, stop_ids=[2]),
    "token": Token(request_id="r1", token_id=42, index=0, t_cloud_ms=1.5),
    "refined_prompt": RefinedPrompt(request_id="r1", kept_indices=[0, 2]),
    "extend_budget": ExtendBudget(request_id="r1", cloud_budget=6),
    "stop": Stop(request_id="r1", handoff_index=3),
    "cancel": Cancel(request_id="r1"),
    "done": Done(request_id="r1", reason="eos", cloud_tokens=3, prefill_ms=2.0),
    "error_request": Error(code="unknown_request", message="no r9", request_id="r9"),
    "error_connection": Error(code="overloaded", message="busy", retry_after_ms=500.0),
    "ping": Ping(nonce=1, t_ms=2.5),
    "pong": Pong(nonce=1, t_ms=2.5),
    "kv_transfer": KVTransfer(request_id="k", layer_start=0, num_tokens=2,
                              kv=Tensor.from_numpy(np.arange(8, dtype=np.float16).reshape(2, 4))),
    "pre_infer": PreInfer(request_id="p", user_id=1, item_ids=[4, 5], timestamps=[10, 20]),
    "rank": Rank(request_id="p", user_id=1, item_ids=[4], timestamps=[10], candidate_ids=[7, 8]),
    "scores": Scores(request_id="p", scores=Tensor.from_numpy(np.array([0.5, -1.0], np.float32)), prefix_source="hbm"),
    "tile_batch": TileBatch(request_id="t", slide_id="s", coords=[[0, 0], [4, 0]],
                            tiles=Tensor.from_numpy(np.zeros((2, 2, 2, 1), np.uint8))),
    "embeddings": Embeddings(request_id="t", embeddings=Tensor.from_numpy(np.array([[1, 0]], np.bool_))),
    "bfloat16": Embeddings(request_id="b", embeddings=Tensor(dtype="bfloat16", shape=[2], data=b"\xc0\x3f\x10\xc0")),
}
BODIES = {name: encode(msg) for name, msg in SAMPLES.items()}
CLIENT_MSGS = ["generate", "extend_budget", "stop", "cancel", "ping", "error_request", "tile_batch", "rank"]
SERVER_MSGS = ["token", "refined_prompt", "done", "ping", "error_request", "scores", "embeddings", "kv_transfer"]


def _raw(obj) -> bytes:
    return msgspec.msgpack.encode(obj)


def _stream(*bodies: bytes) -> bytes:
    return b"".join(pack_frame(b) for b in bodies)


def regression_bodies() -> dict[str, bytes]:
    """Frame bodies that once escaped the decoder's contract (see tests/test_fuzz.py)."""
    deep = b"\x82\xa4type\xa6cancel\xaarequest_id" + b"\x91" * 1200 + b"\xc0"
    def scores(shape, data=b""):
        return _raw({"type": "scores", "request_id": "r", "prefix_source": "x",
                     "scores": {"dtype": "uint8", "shape": shape, "data": data}})
    return {
        "regress_deep_nesting": deep,
        "regress_deep_unknown_field": b"\x83\xa4type\xa6cancel\xaarequest_id\xa1r\xa1x" + b"\x91" * 1200 + b"\xc0",
        "regress_tensor_40_dims": scores([1] * 40, b"a"),
        "regress_tensor_unaddressable": scores([2**32, 2**32, 0]),
        "regress_tensor_dim_u64_max": scores([0, 2**64 - 1]),
    }


def seeds() -> dict[str, dict[str, bytes]]:
    """``{target: {file name: bytes}}`` for every target."""
    hello_plain = encode(Hello(protocol_version=PROTOCOL_VERSION, model_fingerprint=h.FP, client="fuzz"))
    reg = regression_bodies()
    decode_seeds = {f"msg_{n}": b for n, b in BODIES.items()}
    decode_seeds.update(reg)
    decode_seeds.update({
        "stream_client": _stream(*(BODIES[n] for n in ["hello"] + CLIENT_MSGS[:4])),
        "stream_server": _stream(*(BODIES[n] for n in ["welcome"] + SERVER_MSGS[:4])),
        "truncated_generate": BODIES["generate"][:-3],
        "truncated_stream": _stream(BODIES["token"])[:-2],
        "oversized_header": (h.LIMIT + 1).to_bytes(4, "big") + b"\x00" * 8,
        "max_header": b"\xff\xff\xff\xff",
        "unknown_type": _raw({"type": "launch", "x": 1}),
        "no_type": _raw({"request_id": "r"}),
        "bad_tensor_len": _raw({"type": "scores", "request_id": "r", "prefix_source": "x",
                                "scores": {"dtype": "float32", "shape": [2], "data": b"\0" * 7}}),
    })
    server_seeds = {}
    for mode in (0, 1):  # frame / stream, from the start
        server_seeds[f"m{mode}_hello_then_traffic"] = bytes([mode]) + _stream(
            hello_plain, *(BODIES[n] for n in CLIENT_MSGS))
        server_seeds[f"m{mode | 4}_auth_hello"] = bytes([mode | 4]) + _stream(BODIES["hello"], BODIES["cancel"])
        server_seeds[f"m{mode}_generate_first"] = bytes([mode]) + _stream(BODIES["generate"])
    for mode in (2, 3):  # after a valid Hello
        server_seeds[f"m{mode}_client_traffic"] = bytes([mode]) + _stream(*(BODIES[n] for n in CLIENT_MSGS))
        server_seeds[f"m{mode}_hello_again"] = bytes([mode]) + _stream(BODIES["ping"], hello_plain)
        server_seeds[f"m{mode}_connection_error"] = bytes([mode]) + _stream(
            BODIES["cancel"], BODIES["error_connection"], BODIES["ping"])
        server_seeds[f"m{mode}_oversized"] = bytes([mode]) + _stream(BODIES["ping"]) + (h.LIMIT + 1).to_bytes(4, "big")
        server_seeds[f"m{mode}_deep"] = bytes([mode]) + _stream(reg["regress_deep_nesting"])
        server_seeds[f"m{mode}_garbage"] = bytes([mode]) + _stream(b"GET / HTTP/1.1\r\n\r\n", BODIES["cancel"])
    client_seeds = {}
    for mode in (0, 1):
        client_seeds[f"m{mode}_welcome_then_traffic"] = bytes([mode]) + _stream(
            BODIES["welcome"], *(BODIES[n] for n in SERVER_MSGS))
        client_seeds[f"m{mode}_overloaded"] = bytes([mode]) + _stream(BODIES["error_connection"])
        client_seeds[f"m{mode}_token_first"] = bytes([mode]) + _stream(BODIES["token"])
        client_seeds[f"m{mode}_wrong_version"] = bytes([mode]) + _stream(
            encode(Welcome(protocol_version=PROTOCOL_VERSION + 1, model_fingerprint=h.FP)))
        client_seeds[f"m{mode}_welcome_twice"] = bytes([mode]) + _stream(BODIES["welcome"], BODIES["welcome"])
    return {"decode": decode_seeds, "server": server_seeds, "client": client_seeds}


def main() -> None:
    """Rewrite ``corpus/<target>/`` from :func:`seeds` and print the sizes."""
    for target, files in seeds().items():
        d = os.path.join(CORPUS, target)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        for name, data in files.items():
            with open(os.path.join(d, name), "wb") as f:
                f.write(data)
        print(f"{target}: {len(files)} seeds, {sum(map(len, files.values()))} bytes")


if __name__ == "__main__":
    main()
