"""Wire messages: msgspec Structs in one tagged union, encoded as MessagePack.

Every message is a MessagePack map with a ``"type"`` key holding a short snake_case tag
(``{"type": "token", "request_id": "r1", ...}``). Fields with default values are omitted on the
wire. Decoding validates every field type; tensors travel as dtype name + shape + raw
little-endian bytes (never pickle).

Units: times are milliseconds (float), sizes are bytes, indices are 0-based token positions.
"""

from __future__ import annotations

import math
from typing import Union

import msgspec
import numpy as np

from .errors import ErrorCode, ProtocolError

__all__ = [
    "PROTOCOL_VERSION", "MAX_FRAME_BYTES", "HANDSHAKE_MAX_BYTES", "TENSOR_DTYPES", "MAX_TENSOR_DIMS",
    "Tensor", "Grammar", "Hello", "Welcome", "Generate", "Token", "RefinedPrompt", "ExtendBudget", "Stop",
    "Cancel", "Done", "Error", "Ping", "Pong", "KVTransfer", "PreInfer", "Rank", "Scores",
    "TileBatch", "Embeddings", "Message", "MESSAGE_TYPES", "encode", "decode", "bfloat16_to_float32",
]

PROTOCOL_VERSION = 1
"""Bumped on any incompatible change to the messages below."""

MAX_FRAME_BYTES = 64 * 1024 * 1024
"""Default largest frame (one encoded message) a connection accepts after the handshake, in bytes
(64 MiB: KV transfers and tile batches). Services size their own limit to their largest real
message (the split service: a Generate of a full context, `CloudService.max_frame_bytes`)."""
HANDSHAKE_MAX_BYTES = 4 * 1024
"""Largest frame accepted before the handshake (bytes): a Hello or Welcome is ~200 bytes."""

# dtype name -> little-endian numpy dtype of the raw bytes. bfloat16 travels as its raw 16-bit patterns.
TENSOR_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    "int8": np.dtype("i1"),
    "uint8": np.dtype("u1"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "bool": np.dtype("?"),
}

MAX_TENSOR_DIMS = 32
"""Most dimensions a Tensor may have (numpy 1.x's limit; numpy 2 allows 64), so that every tensor
accepted off the wire converts with ``to_numpy`` on any supported numpy."""

_MAX_ADDRESSABLE_BYTES = int(np.iinfo(np.intp).max)


class _TensorError(ProtocolError, ValueError):
    """A bad tensor (BAD_FRAME). Also a ValueError, so that msgspec, decoding a frame, wraps it in
    a ValidationError whose message ends with the field's path (`- at $.tiles`): the Error the peer
    gets names the field that held the bad tensor."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.BAD_FRAME, message)


class Tensor(msgspec.Struct, frozen=True):
    """An n-d array as ``dtype`` name, ``shape`` (list of dims) and raw little-endian C-order ``data``.

    Allowed dtypes: float32, float16, bfloat16, int8, uint8, int32, int64, bool. bfloat16 is carried
    as its raw 16-bit patterns; :meth:`to_numpy` returns them as a ``uint16`` array (numpy has no
    bfloat16) and :func:`bfloat16_to_float32` widens them. Construction and decoding check that
    ``len(data) == prod(shape) * itemsize``, that there are at most ``MAX_TENSOR_DIMS`` dims and
    that numpy can address the shape (non-zero dims times itemsize fit ``intp``), and raise
    ``ProtocolError(BAD_FRAME)`` otherwise.
    """

    dtype: str
    shape: list[int]
    data: bytes

    def __post_init__(self) -> None:
        np_dtype = TENSOR_DTYPES.get(self.dtype)
        if np_dtype is None:
            raise _TensorError(f"tensor dtype {self.dtype!r} not allowed; use one of {', '.join(TENSOR_DTYPES)}")
        if len(self.shape) > MAX_TENSOR_DIMS:
            raise _TensorError(f"tensor has {len(self.shape)} dimensions; at most {MAX_TENSOR_DIMS} are allowed")
        if any(d < 0 for d in self.shape):
            raise _TensorError(f"tensor shape {self.shape} has a negative dimension")
        # numpy refuses a shape whose non-zero dims times the itemsize overflow intp, even when another dim is 0.
        if math.prod(d for d in self.shape if d) * np_dtype.itemsize > _MAX_ADDRESSABLE_BYTES:
            raise _TensorError(f"tensor shape {self.shape} is too large to address")
        expected = math.prod(self.shape) * np_dtype.itemsize
        if len(self.data) != expected:
            raise _TensorError(
                f"tensor data is {len(self.data)} bytes but {self.dtype} shape {self.shape} needs {expected} bytes",
            )
        if self.dtype == "bool" and self.data.translate(None, b"\x00\x01"):
            raise _TensorError("bool tensor data holds bytes other than 0 and 1")

    @classmethod
    def from_numpy(cls, arr: np.ndarray, dtype: str | None = None) -> "Tensor":
        """Pack a numpy array (any byte order / memory layout; converted to little-endian C order).

        ``dtype`` overrides the wire dtype name; only needed to send a ``uint16`` array of raw
        bfloat16 patterns as ``"bfloat16"``. An ``ml_dtypes.bfloat16`` array is recognised by name.
        Raises ``ProtocolError(BAD_FRAME)`` for a dtype outside the allowed set.
        """
        arr = np.asarray(arr)
        name = dtype or ("bfloat16" if arr.dtype.name == "bfloat16" else arr.dtype.name)
        wire = TENSOR_DTYPES.get(name)
        if wire is None:
            raise ProtocolError(ErrorCode.BAD_FRAME,
                                f"cannot send numpy dtype {arr.dtype} as {name!r}; allowed: {', '.join(TENSOR_DTYPES)}")
        if name == "bfloat16":
            if arr.dtype.name != "bfloat16" and not (arr.dtype.kind == "u" and arr.dtype.itemsize == 2):
                raise ProtocolError(ErrorCode.BAD_FRAME, f"bfloat16 needs raw uint16 patterns, got {arr.dtype}")
            if arr.dtype.kind != "u":
                arr = np.ascontiguousarray(arr).view(np.uint16)
        elif arr.dtype.kind != wire.kind or arr.dtype.itemsize != wire.itemsize:
            raise ProtocolError(ErrorCode.BAD_FRAME, f"numpy dtype {arr.dtype} does not match wire dtype {name!r}")
        data = np.ascontiguousarray(arr, dtype=wire).tobytes()
        return cls(dtype=name, shape=list(arr.shape), data=data)

    def to_numpy(self) -> np.ndarray:
        """Read-only numpy view of ``data`` (no copy); ``uint16`` raw patterns for bfloat16."""
        return np.frombuffer(self.data, dtype=TENSOR_DTYPES[self.dtype]).reshape(self.shape)

    @property
    def nbytes(self) -> int:
        """Size of ``data`` in bytes."""
        return len(self.data)


def bfloat16_to_float32(bits: np.ndarray) -> np.ndarray:
    """Widen raw bfloat16 patterns (uint16 array, e.g. from ``Tensor.to_numpy``) to float32, exactly."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


class Grammar(msgspec.Struct, frozen=True):
    """A structured-output constraint: every answer token stays inside it (`protocol.model.grammar`).

    ``kind``: ``json_schema`` (``spec`` is the JSON text of a JSON Schema), ``regex`` (``spec`` a
    regular expression the whole answer matches) or ``lark`` (``spec`` a grammar in llguidance's
    Lark dialect). Cloud and device compile the same text with the same engine (llguidance), so
    the device masks its own tokens as the cloud masked its."""

    kind: str
    spec: str


class _Msg(msgspec.Struct, tag_field="type", omit_defaults=True):
    """Base of all wire messages (not itself a message)."""


# -- handshake --------------------------------------------------------------------------------------

class Hello(_Msg, tag="hello"):
    """Client -> server, first frame. ``model_fingerprint``: hash of the model file the client runs;
    ``token``: auth token if the server requires one; ``client``: free-form name/version."""

    protocol_version: int
    model_fingerprint: str
    token: Union[str, None] = None
    client: str = ""


class Welcome(_Msg, tag="welcome"):
    """Server -> client, accepts a Hello. ``session_id`` identifies the connection in server logs;
    ``device_model_url``: where the device model of ``model_fingerprint`` is served
    (``http(s)://HOST:PORT/v1/device-model``, its files listed at ``.../manifest``), "" when the
    server serves none. A server that serves one also accepts a Hello with an empty
    ``model_fingerprint`` (a device without the model asking where to get it): it answers this
    Welcome and closes the session (1000)."""

    protocol_version: int
    model_fingerprint: str
    server: str = ""
    session_id: str = ""
    device_model_url: str = ""


# -- P/D-Device token stream -----------------------------------------------------------------------

class Generate(_Msg, tag="generate"):
    """Device -> cloud: start a generation.

    ``prompt_ids``: token ids of the full prompt; ``max_new_tokens``: cap on generated tokens;
    sampling: ``temperature`` (0 = greedy), ``top_p`` (1 = off), ``top_k`` (0 = off), ``seed``;
    ``cloud_budget``: max tokens the cloud streams (None = to the end); ``refine``: keep ratio in
    (0, 1] for prompt refinement (None = off); ``stop_ids``: token ids that end generation;
    ``presence_penalty`` / ``frequency_penalty`` / ``repetition_penalty`` / ``min_tokens`` /
    ``logit_bias`` ([token id, bias] pairs, bias in [-100, 100]): as in
    ``protocol.model.decoding.SamplingParams`` (defaults: off), so both sides sample the same answer.
    ``kv_from``: None, or ask for the KV hand-off: right after the first ``Token`` the cloud sends
    ``KVTransfer`` pieces with the KV of prompt tokens [kv_from, len(prompt_ids) - 1) (fp16; the
    device already holds the first ``kv_from``, e.g. from the previous turn of a conversation, and
    prefills the last prompt token itself for its logits). Not combined with ``refine``.
    ``kv_rate``: None (as fast as the connection takes them), or the average rate (bytes/s) at
    which the cloud sends those pieces, in pieces of about 20 ms of it, so that the request's tokens
    are not queued on the link behind the transfer; refused (bad_request) without ``kv_from``.
    ``kv_wire``: the pieces' format, ``"float16"`` or ``"int8"`` (one float16 scale per layer, K/V,
    head and token: 52 % of the float16 bytes for a 64-wide head; ``protocol.kvhandoff.KV_WIRES``); only float16 without ``kv_from``.
    ``grammar``: None, or a ``Grammar`` the answer must follow (structured output: a JSON schema,
    regex or Lark grammar); the cloud masks the tokens it samples and the device, after the
    hand-off, feeds its matcher the cloud's tokens and masks its own, so the whole answer follows it.
    """

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Union[int, None] = None
    cloud_budget: Union[int, None] = None
    refine: Union[float, None] = None
    stop_ids: list[int] = []
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    kv_from: Union[int, None] = None
    logit_bias: list[tuple[int, float]] = []
    kv_rate: Union[float, None] = None
    grammar: Union[Grammar, None] = None
    kv_wire: str = "float16"


class Token(_Msg, tag="token"):
    """Cloud -> device: one generated token. ``index``: 0-based position in the generated answer;
    ``t_cloud_ms``: cloud wall-clock milliseconds since the Generate was received;
    ``cached_tokens`` (first token only, omitted when 0): prompt tokens whose KV the cloud reused
    (prefix cache or the session's previous turn) instead of prefilling them; ``finish_reason``
    (omitted when None): set on the token that ends the answer, as the sampler decided it ("eos",
    "stop" for a stop id or stop string, "length" for max_tokens); a device reads it instead of
    re-deriving the end."""

    request_id: str
    token_id: int
    index: int
    t_cloud_ms: float
    cached_tokens: int = 0
    finish_reason: Union[str, None] = None


class RefinedPrompt(_Msg, tag="refined_prompt"):
    """Cloud -> device: indices (0-based, ascending) of the prompt tokens worth keeping for the device prefill."""

    request_id: str
    kept_indices: list[int]


class ExtendBudget(_Msg, tag="extend_budget"):
    """Device -> cloud: raise the cloud budget to ``cloud_budget`` tokens in total (device is slower than planned)."""

    request_id: str
    cloud_budget: int


class Stop(_Msg, tag="stop"):
    """Device -> cloud: the device generates from generated index ``handoff_index`` on; cloud frees the request."""

    request_id: str
    handoff_index: int


class Cancel(_Msg, tag="cancel"):
    """Either way: abandon the request (the user went away)."""

    request_id: str


class Done(_Msg, tag="done"):
    """Cloud -> device: the cloud stream ended. ``reason``: "eos", "length", "stop", "budget" or "cancel";
    ``cloud_tokens``: tokens the cloud sent; ``prefill_ms``: cloud prefill time in milliseconds;
    ``cached_tokens``: prompt tokens whose KV the cloud reused from an earlier request (prefix
    cache or the session's previous turn) instead of prefilling them."""

    request_id: str
    reason: str
    cloud_tokens: int
    prefill_ms: float
    cached_tokens: int = 0


class Error(_Msg, tag="error"):
    """Either way: something failed. ``code``: an ``ErrorCode`` value; ``request_id``: the request it
    concerns, or None for a connection-level error (the sender closes the connection after it);
    ``retry_after_ms``: with OVERLOADED, how long the sender asks the peer to wait before trying
    again (ms; a device runs device-only meanwhile), else None."""

    code: str
    message: str
    request_id: Union[str, None] = None
    retry_after_ms: Union[float, None] = None


class Ping(_Msg, tag="ping"):
    """Either way: liveness / RTT probe. ``t_ms``: sender's clock in milliseconds; the peer echoes both in a Pong."""

    nonce: int
    t_ms: float


class Pong(_Msg, tag="pong"):
    """Answer to a Ping with the same ``nonce`` and ``t_ms`` (RTT = now - t_ms on the pinger's clock)."""

    nonce: int
    t_ms: float


# -- P/D-Serve, RelayGR, pathology ----------------------------------------------------------------

class KVTransfer(_Msg, tag="kv_transfer"):
    """Prefill -> decode instance: KV cache of ``num_tokens`` prompt tokens, layers from ``layer_start`` on, in one tensor.

    One meaning everywhere (``protocol.kvhandoff.kv_part_messages`` writes them, ``kv_parts`` reads
    them): ``kv`` is [layers, 2 (K, V), kv_heads, num_tokens, head_dim] of token positions
    [token_start, token_start + num_tokens); ``block_index`` -1: the whole KV in this one message;
    >= 0: part ``block_index`` of ``num_blocks`` consecutive parts.

    P/D hand-off (``relayinfer.cloud.pd.kv``): the dtype of the prefill's cache, token_start 0;
    block-fixed mode sends one part per KV block. Cloud -> device KV hand-off (answer to
    ``Generate.kv_from``): float16 (or int8 with ``scale`` when ``Generate.kv_wire`` asks for
    it), cut by tokens into pieces of at most the cloud's piece size (1 MiB by default), in token
    order, interleaved with other frames; none after the device's Stop or Cancel
    (docs/PROTOCOL.md); keys after RoPE: layer i's K and V are the ONNX past-KV inputs [1,
    kv_heads, tokens, head_dim]. ``scale``: None, or with an int8 ``kv`` its float16 scales
    [layers, 2, kv_heads, num_tokens, 1]: the values are ``kv * scale``.
    """

    request_id: str
    layer_start: int
    kv: Tensor
    num_tokens: int
    block_index: int = -1
    num_blocks: int = 1
    token_start: int = 0
    scale: Union[Tensor, None] = None


class PreInfer(_Msg, tag="pre_infer"):
    """Retrieval -> ranking instance: compute and keep the user-prefix KV cache. ``timestamps`` in seconds, one per item."""

    request_id: str
    user_id: int
    item_ids: list[int]
    timestamps: list[int]


class Rank(_Msg, tag="rank"):
    """Ranking request: user history (``item_ids``, ``timestamps`` in seconds) and the ``candidate_ids`` to score.
    ``request_ts``: the request time in seconds (the candidates' time); None means the last history event's time."""

    request_id: str
    user_id: int
    item_ids: list[int]
    timestamps: list[int]
    candidate_ids: list[int]
    request_ts: Union[int, None] = None


class Scores(_Msg, tag="scores"):
    """Answer to Rank: one score per candidate. ``prefix_source``: "hbm", "dram", "recompute" or "none"."""

    request_id: str
    scores: Tensor
    prefix_source: str


class TileBatch(_Msg, tag="tile_batch"):
    """Device -> cloud: candidate tiles of a slide. ``coords``: [x, y] level-0 pixel offsets per tile;
    ``tiles``: N x H x W x C uint8 (shape [0, H, W, C] when the tiles travel otherwise).

    Pathology screening (defaults keep older senders valid): ``jpeg``: the N tiles as JPEG files
    instead of raw pixels; ``features``: device features (N x D float16/float32) instead of pixels;
    ``device_scores``: the device's coarse-screen score per tile; ``last``: no more tiles for this
    ``request_id`` (may carry none): the cloud answers with the slide result.
    """

    request_id: str
    slide_id: str
    coords: list[list[int]]
    tiles: Tensor
    jpeg: list[bytes] = []
    features: Union[Tensor, None] = None
    device_scores: list[float] = []
    last: bool = False


class Embeddings(_Msg, tag="embeddings"):
    """Cloud -> device: one embedding row per tile of the matching TileBatch.

    With the answer to a ``last`` TileBatch (defaults otherwise): ``slide_score`` in [0, 1] (the
    MIL score of the whole slide), ``attention`` (float32, one weight per tile of the request in the
    order sent, summing to 1), ``encoder`` (name) and ``weights`` ("random-init" or the sha256 of
    the weights files) so a result from random weights is never mistaken for a trained one.
    """

    request_id: str
    embeddings: Tensor
    slide_score: Union[float, None] = None
    attention: Union[Tensor, None] = None
    encoder: str = ""
    weights: str = ""


Message = Union[
    Hello, Welcome, Generate, Token, RefinedPrompt, ExtendBudget, Stop, Cancel, Done, Error, Ping, Pong,
    KVTransfer, PreInfer, Rank, Scores, TileBatch, Embeddings,
]
"""The tagged union of every wire message."""

MESSAGE_TYPES: dict[str, type] = {cls.__struct_config__.tag: cls for cls in Message.__args__}
"""Tag ("type" value) -> message class."""

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


class _TypeOnly(msgspec.Struct):
    type: Union[str, None] = None


_type_decoder = msgspec.msgpack.Decoder(_TypeOnly)


def encode(msg: Message) -> bytes:
    """Encode one message to a MessagePack frame body. Raises TypeError for a non-message object."""
    if not isinstance(msg, _Msg):
        raise TypeError(f"not a protocol message: {type(msg).__name__}")
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    """Decode one frame body into a message, validating every field.

    Raises ``ProtocolError`` with ``BAD_FRAME`` (not msgpack, truncated, trailing bytes, nested too
    deeply, wrong field types, bad tensor) or ``UNKNOWN_MESSAGE`` (valid msgpack map whose "type" is
    not a known tag).
    """
    try:
        return _decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise _explain(data, exc) from None
    except msgspec.DecodeError as exc:
        where = _undecodable_field(data)
        raise ProtocolError(ErrorCode.BAD_FRAME, f"frame of {len(data)} bytes is not valid MessagePack: {exc}"
                            + (f" (in field `{where}`)" if where else "")) from None
    except RecursionError:  # msgspec raises it for MessagePack nested past the interpreter's recursion limit
        raise ProtocolError(ErrorCode.BAD_FRAME, f"frame of {len(data)} bytes is nested too deeply") from None


def _undecodable_field(data: bytes) -> str | None:
    """The top-level field whose value does not decode (a string that is not UTF-8, say) in a
    frame that is otherwise a map with string keys; None when the map itself is broken."""
    try:
        fields = msgspec.msgpack.decode(data, type=dict[str, msgspec.Raw])
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
    for name, raw in fields.items():
        try:
            msgspec.msgpack.decode(raw)
        except (msgspec.DecodeError, RecursionError):
            return name[:64]
    return None


def _explain(data: bytes, exc: msgspec.ValidationError) -> ProtocolError:
    """Turn a validation failure into UNKNOWN_MESSAGE (unknown tag) or BAD_FRAME (bad fields)."""
    try:
        tag = _type_decoder.decode(data).type
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return ProtocolError(ErrorCode.BAD_FRAME, f"frame is not a message map with a string 'type': {exc}")
    if tag is None:
        return ProtocolError(ErrorCode.BAD_FRAME, "frame has no 'type' field")
    if tag not in MESSAGE_TYPES:
        return ProtocolError(ErrorCode.UNKNOWN_MESSAGE,
                             f"unknown message type {tag[:64]!r} (protocol version {PROTOCOL_VERSION})")
    detail = str(exc).replace(f"[{ErrorCode.BAD_FRAME.value}] ", "", 1)  # a `_TensorError` inside: its text alone
    return ProtocolError(ErrorCode.BAD_FRAME, f"invalid {tag!r} message: {detail}")
