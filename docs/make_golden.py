"""Write the golden frames of docs/golden/ (overwrites them): ``.venv/bin/python docs/make_golden.py``.

For each example ``NAME`` (see docs/PROTOCOL.md, section "Golden frames"):

* ``NAME.msgpack``: the exact frame body (one MessagePack map; one websocket binary message), or
  ``NAME.frames``: a length-prefixed byte stream of several frames (4-byte big-endian length + body each);
* ``NAME.json``: the decoded message as JSON (the same keys as on the wire, fields equal to their
  default omitted, ``bytes`` as base64 strings; tensors as ``{"dtype", "shape", "data"}``); for a
  ``.frames`` file a JSON array of messages;
* ``index.json``: every example with its file names, message type(s) and what it shows.

``tests/test_protocol_docs.py`` checks that this script's output equals the committed files, that
encoding each JSON gives exactly the committed bytes and that decoding the bytes gives the JSON.
Values are realistic but shrunk where a real message would be large (KV caches, tile features).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import msgspec
import numpy as np

from relayinfer.protocol.framing import pack_frame
from relayinfer.protocol.messages import (
    PROTOCOL_VERSION, Cancel, Done, Embeddings, Error, ExtendBudget, Generate, Grammar, Hello, KVTransfer, Ping, Pong,
    PreInfer, Rank, RefinedPrompt, Scores, Stop, Tensor, TileBatch, Token, Welcome, encode,
)

GOLDEN = Path(__file__).resolve().parent / "golden"
FP = hashlib.sha256(b"SmolLM2-135M-Instruct.Q4_1.gguf (example)").hexdigest()  # stands for a model file's sha256
RID = "5f3a9c0e21b4"  # request ids: the device uses 12 hex digits of a uuid4
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2, 198, 1, 4093, 198, 20855, 549, 563, 260, 8382, 30,
          2, 198, 1, 520, 9531, 198]  # a short chat-template prompt (SmolLM2 token ids; 1 = <|im_start|>, 2 = <|im_end|>)


def _rng_f16(shape, seed):
    """Deterministic float16 values k/32 in [-1.5, 1.5] (exact in float16, no RNG stream to drift)."""
    n = int(np.prod(shape))
    return (((np.arange(n) * 37 + seed * 11) % 97 - 48) / 32).astype(np.float16).reshape(shape)


def examples() -> dict[str, tuple[str, list, bool]]:
    """name -> (what it shows, messages, stream-framed)."""
    kv = _rng_f16((2, 2, 1, 3, 4), 1)  # [layers, K/V, kv_heads, tokens, head_dim], shrunk from SmolLM2's [30, 2, 3, n, 64]
    feats = _rng_f16((2, 1280), 2)  # device features of 2 tiles (EfficientNet-Lite0, 1280-d)
    attn = np.array([0.62, 0.38], np.float32)
    one = lambda what, msg: (what, [msg], False)  # noqa: E731
    return {
        "hello": one("device -> cloud, first frame: version, model fingerprint, auth token, client name",
                     Hello(PROTOCOL_VERSION, FP, token="s3cret-token", client="relayinfer-device")),
        "hello_no_token": one("Hello to a server without a token: token (None) and client ('') omitted",
                              Hello(PROTOCOL_VERSION, FP)),
        "welcome": one("cloud -> device: handshake accepted",
                       Welcome(PROTOCOL_VERSION, FP, server="relayinfer-cloud", session_id="9b1e4c7d02a35f68")),
        "generate": one("device -> cloud: start a split request, seeded sampling, planned cloud budget, stop id",
                        Generate(RID, PROMPT, 256, temperature=0.2, top_p=0.9, seed=1234, cloud_budget=24,
                                 stop_ids=[2])),
        "generate_greedy": one("Generate with every optional field at its default (greedy, no budget, no refinement)",
                               Generate(RID, PROMPT, 64)),
        "generate_refine_penalties": one("Generate with prompt refinement (keep ratio 0.5), top_k and penalties",
                                         Generate(RID, PROMPT, 128, temperature=0.7, top_p=0.95, top_k=40, seed=7,
                                                  cloud_budget=None, refine=0.5, stop_ids=[2, 0],
                                                  presence_penalty=0.5, frequency_penalty=0.25,
                                                  repetition_penalty=1.1, min_tokens=4)),
        "generate_kv_handoff": one("Generate asking for the KV hand-off of every prompt token but the last, paced at "
                                   "2.7 MB/s (0.75 of a measured 3.6 MB/s link)",
                                   Generate(RID, PROMPT, 256, cloud_budget=40, kv_from=0, kv_rate=2.7e6)),
        "generate_json_schema": one("Generate with structured output: the answer is JSON under a schema (cloud and "
                                    "device mask with the same grammar)",
                                    Generate(RID, PROMPT, 128, cloud_budget=16, grammar=Grammar(
                                        "json_schema", '{"type":"object","properties":{"city":{"type":"string"}},'
                                        '"required":["city"],"additionalProperties":false}'))),
        "token": one("cloud -> device: generated token at answer index 0, 41.7 ms after the Generate arrived",
                     Token(RID, 504, 0, 41.66)),
        "refined_prompt": one("cloud -> device, right after the first token: prompt indices the device prefills",
                              RefinedPrompt(RID, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 15, 16, 18, 20, 21,
                                                  22, 23, 24, 25])),
        "extend_budget": one("device -> cloud: raise the cloud budget to 40 tokens in total", ExtendBudget(RID, 40)),
        "stop": one("device -> cloud: the device generates from answer index 17 on", Stop(RID, 17)),
        "cancel": one("either way: abandon the request", Cancel(RID)),
        "done_stop": one("cloud -> device: stream ended after a Stop (18 tokens sent, 38.2 ms prefill)",
                         Done(RID, "stop", 18, 38.2)),
        "done_budget": one("cloud -> device: the cloud budget is spent; the device takes over",
                           Done(RID, "budget", 24, 52.75)),
        "error_overloaded_connection": one(
            "connection-level Error (no request_id) sent instead of a Welcome: max sessions reached; closes",
            Error("overloaded", "the server holds its limit of 256 device sessions; retry after 5000 ms",
                  retry_after_ms=5000.0)),
        "error_overloaded_request": one(
            "request-level Error: the session already runs its limit of requests; the connection stays open",
            Error("overloaded", "this session already runs 4 requests, the limit per session; retry after 5000 ms",
                  RID, 5000.0)),
        "error_unauthorized": one("handshake refused: wrong token (connection-level; closes, websocket code 1008)",
                                  Error("unauthorized", "auth token rejected")),
        "error_prompt_too_long": one("request-level Error refusing a Generate",
                                     Error("prompt_too_long", "prompt too long: 8100 prompt tokens + 256 new tokens "
                                           "exceed the context length of 8192 tokens", RID)),
        "ping": one("either way: liveness / RTT probe (t_ms: the sender's clock)", Ping(7, 183204.5)),
        "pong": one("answer to the Ping with the same nonce and t_ms", Pong(7, 183204.5)),
        "kv_transfer": one("prefill -> decode instance: contiguous KV of 3 tokens, float16 "
                           "[layers 2, K/V 2, kv_heads 1, tokens 3, head_dim 4]",
                           KVTransfer("pd-17", 0, Tensor.from_numpy(kv), 3)),
        "kv_transfer_block": one("block-fixed KV: block 1 of 2 (tokens 16..18 of 19, block size 16)",
                                 KVTransfer("pd-17", 0, Tensor.from_numpy(kv), 19, block_index=1, num_blocks=2)),
        "pre_infer": one("retrieval -> ranking instance: pre-compute a user's prefix KV (timestamps in s)",
                         PreInfer("pre-41", 196, [242, 302, 377, 51], [881250949, 881251520, 881252201, 881253100])),
        "rank": one("ranking request: history and 3 candidates at request time request_ts",
                    Rank("rank-41", 196, [242, 302, 377, 51], [881250949, 881251520, 881252201, 881253100],
                         [346, 474, 265], request_ts=881260000)),
        "scores": one("answer to Rank: float32 score per candidate, prefix found in HBM",
                      Scores("rank-41", Tensor.from_numpy(np.array([0.8125, -0.25, 1.5], np.float32)), "hbm")),
        "tile_batch_features": one("device -> cloud: 2 tiles as device features (float16 [2, 1280]), pixels "
                                   "not sent (tiles uint8 [0, 224, 224, 3]), coarse scores",
                                   TileBatch("slide-a1", "TCGA-A1-0001", [[10752, 4480], [11200, 4480]],
                                             Tensor.from_numpy(np.zeros((0, 224, 224, 3), np.uint8)),
                                             features=Tensor.from_numpy(feats), device_scores=[0.91, 0.47])),
        "tile_batch_last": one("device -> cloud: the last batch of the slide, carrying no tile",
                               TileBatch("slide-a1", "TCGA-A1-0001", [],
                                         Tensor.from_numpy(np.zeros((0, 224, 224, 3), np.uint8)), last=True)),
        "embeddings": one("cloud -> device: float16 embedding rows of a batch (shrunk to 2 x 8)",
                          Embeddings("slide-a1", Tensor.from_numpy(_rng_f16((2, 8), 3)))),
        "embeddings_last": one("answer to the last TileBatch: slide score, attention per tile, encoder, weights",
                               Embeddings("slide-a1", Tensor.from_numpy(np.zeros((0, 1280), np.float16)),
                                          slide_score=0.873, attention=Tensor.from_numpy(attn),
                                          encoder="device-features (efficientnet-lite0)", weights="random-init")),
        "stream_split_tail": ("byte-stream framing: Token, Token, Done, each preceded by its 4-byte big-endian length",
                              [Token(RID, 504, 0, 41.66), Token(RID, 3465, 1, 63.1), Done(RID, "eos", 2, 38.2)], True),
    }


def to_json(msg) -> object:
    """The message as plain JSON data (the wire keys, bytes as base64)."""
    return json.loads(msgspec.json.encode(msg))


def render() -> dict[str, bytes]:
    """file name -> content of every golden file."""
    files: dict[str, bytes] = {}
    index = []
    for name, (what, msgs, stream) in examples().items():
        kind = "frames" if stream else "msgpack"
        if stream:
            body = b"".join(pack_frame(encode(m)) for m in msgs)
            data = [to_json(m) for m in msgs]
        else:
            body, data = encode(msgs[0]), to_json(msgs[0])
        files[f"{name}.{kind}"] = body
        files[f"{name}.json"] = (json.dumps(data, indent=2, ensure_ascii=False) + "\n").encode()
        index.append({"name": name, "bytes": f"{name}.{kind}", "json": f"{name}.json",
                      "framing": "stream" if stream else "body",
                      "types": [type(m).__struct_config__.tag for m in msgs], "what": what})
    files["index.json"] = (json.dumps({"protocol_version": PROTOCOL_VERSION, "examples": index}, indent=2,
                                      ensure_ascii=False) + "\n").encode()
    return files


def main() -> int:
    GOLDEN.mkdir(exist_ok=True)
    files = render()
    for old in GOLDEN.iterdir():
        if old.suffix in (".msgpack", ".frames", ".json") and old.name not in files:
            old.unlink()
    for name, content in files.items():
        (GOLDEN / name).write_bytes(content)
    print(f"wrote {len(files)} files to {GOLDEN}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
