"""The cloud fine screen as a websocket service over the shared protocol (``protocol.transport.ws.serve``).

Same handshake, auth token, frame limits and TLS as the split service: the device's Hello carries
``patho_fingerprint(tile_px, mpp)`` (the tile geometry, see ``protocol/patho.py``) and the token.
Per slide (one ``request_id``), the device sends ``TileBatch`` frames of candidate tiles (raw pixels
or JPEG; or device features, scored by a separate ABMIL over the 1280-d device features), the last
one with ``last=True``. The cloud answers each batch with ``Embeddings`` (float16, one row per
tile), and the last one with the slide result too: ``slide_score`` (ABMIL), ``attention`` (one
weight per tile sent, summing to 1), ``encoder`` and ``weights`` ("random-init" unless weights
files were given).

Limits: ``max_tiles_per_slide`` tiles per request and ``max_slides_per_session`` open requests per
connection (more: Error BAD_REQUEST / OVERLOADED with the request id); a request's state is freed
at its last batch, on a per-request Error, or when the connection ends. ``max_sessions`` open
connections at most, counted at the websocket upgrade (more: a connection-level OVERLOADED with
``retry_after_ms``). One memory budget (``memory_bytes``, `protocol.transport.limits.MemoryBudget`) holds
every received batch while it is decoded and encoded (its frame, decoded tiles and embeddings) and
the embeddings each open slide keeps: a batch that does not fit gets Error OVERLOADED with
``retry_after_ms`` (the slide is refused; the device sends it again later). websockets queues at
most one further frame per connection (``max_queue=1``), so a connection holds at most about three
frames (the one processed, one queued, one arriving); connections are capped at accept
(`protocol.transport.limits.ConnectionGate`). One compute thread runs the
models (``torch.set_num_threads(threads)``), so batches of different devices queue in arrival order.
Malformed tiles (not JPEG, wrong size, mixed modes) get Error(BAD_REQUEST) naming what was wrong;
a refused request stays refused: its batches still in flight get Error(UNKNOWN_REQUEST), unencoded.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import ssl as _ssl
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from relayinfer.protocol.errors import ErrorCode
from relayinfer.protocol.transport.limits import Charge, ConnectionGate, ConnectionLimits, MemoryBudget
from relayinfer.protocol.messages import MAX_FRAME_BYTES, Embeddings, Error, Tensor, TileBatch
from relayinfer.protocol.patho import TILE_MPP, TILE_PX, jpeg_decode, patho_fingerprint
from relayinfer.protocol.validate import RULES, FieldError, check, check_ids
from relayinfer.protocol.transport.ws import ServerChannel, serve

from .encoder import TileEncoder
from .mil import ABMIL

__all__ = ["SlideScreener", "PathoService", "PathoServiceThread"]

log = logging.getLogger("relayinfer.patho")

DEVICE_FEATURE_DIM = 1280  # EfficientNet-Lite0 pooled features (cloud/patho/effnet.py)
MAX_ID_CHARS = 256  # slide_id length


class SlideScreener:
    """The models of the fine screen: a tile ``encoder`` and ABMIL heads over its embeddings and over
    the device's features. ``mil_weights`` / ``feature_mil_weights``: state dict files of trained heads;
    None = random initialisation (seed ``seed``), reported as "random-init"."""

    def __init__(self, encoder: TileEncoder, mil_weights: str | Path | None = None,
                 feature_mil_weights: str | Path | None = None, seed: int = 0) -> None:
        from relayinfer.protocol.model.model_file import file_sha256

        self.encoder = encoder
        torch.manual_seed(seed)
        self.mil, self.feature_mil = ABMIL(encoder.dim).eval(), ABMIL(DEVICE_FEATURE_DIM).eval()
        self.mil_id = self.feature_mil_id = "random-init"
        for head, path, attr in ((self.mil, mil_weights, "mil_id"), (self.feature_mil, feature_mil_weights, "feature_mil_id")):
            if path is not None:
                try:
                    head.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
                except Exception as e:
                    raise ValueError(f"cannot load ABMIL weights {path}: {str(e)[:200]}") from None
                setattr(self, attr, file_sha256(path))

    def weights(self, features: bool) -> str:
        """"random-init" if any model of the path is randomly initialised, else "encoder:<sha>,mil:<sha>"."""
        parts = [self.feature_mil_id] if features else [self.encoder.weights, self.mil_id]
        if "random-init" in parts:
            return "random-init"
        return ",".join(parts)

    def score(self, embeddings: np.ndarray, features: bool = False) -> tuple[float, np.ndarray]:
        """(slide score in [0, 1], attention float32 (N,)) of all tile embeddings (N, dim) of a slide."""
        head = self.feature_mil if features else self.mil
        with torch.inference_mode():
            s, a = head(torch.from_numpy(np.ascontiguousarray(embeddings, dtype=np.float32)))
        return float(s), a.numpy().astype(np.float32)


@dataclass
class _Slide:
    features: bool | None = None     # None until the first non-empty batch decides the mode
    chunks: list[np.ndarray] = field(default_factory=list)
    n: int = 0
    charges: list[Charge] = field(default_factory=list)  # the kept embeddings' bytes in the memory budget

    def free(self) -> None:
        """Drop the kept embeddings and give their bytes back to the budget."""
        self.chunks.clear()
        for c in self.charges:
            c.release()
        self.charges.clear()


class PathoService:
    """Websocket slide service (see the module docstring). ``auth_token``: required Hello token or None;
    ``tile_px``/``mpp``: tile geometry (the handshake fingerprint); ``threads``: torch threads of the
    compute thread; ``max_frame_bytes``: frame limit after the handshake (64 MiB: ~420 raw 224-px tiles);
    ``max_sessions``: open connections at most; ``memory_bytes``: the memory budget of held frames,
    tiles and embeddings (bytes); ``retry_after_ms``: the back-off hint of OVERLOADED (ms);
    ``limits``: connection limits (`protocol.transport.limits.ConnectionLimits`, default ones when None).
    Counters: ``stats`` (tiles, batches, slides, bytes received, encode seconds); ``budget`` (its
    ``used`` bytes are 0 when no slide is open)."""

    def __init__(self, screener: SlideScreener, auth_token: str | None = None, tile_px: int = TILE_PX,
                 mpp: float = TILE_MPP, max_tiles_per_slide: int = 20000, max_slides_per_session: int = 4,
                 max_frame_bytes: int = MAX_FRAME_BYTES, threads: int = 1, max_sessions: int = 16,
                 memory_bytes: int = 1 << 30, retry_after_ms: float = 5000.0,
                 limits: ConnectionLimits | None = None) -> None:
        self.screener, self.auth_token, self.tile_px, self.mpp = screener, auth_token, tile_px, mpp
        self.fingerprint = patho_fingerprint(tile_px, mpp)
        self.max_tiles_per_slide, self.max_slides_per_session = max_tiles_per_slide, max_slides_per_session
        self.max_frame_bytes = max_frame_bytes
        self.max_sessions, self.num_sessions, self.retry_after_ms = max_sessions, 0, retry_after_ms
        self.budget = MemoryBudget(memory_bytes)
        self.gate = ConnectionGate(limits)
        self.worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="patho-compute",
                                                            initializer=torch.set_num_threads, initargs=(threads,))
        self.stats = {"tiles": 0, "batches": 0, "slides": 0, "bytes_in": 0, "encode_s": 0.0}
        self._server = None
        self._ssl: _ssl.SSLContext | None = None
        self.port = 0
        self.host = "127.0.0.1"

    @property
    def url(self) -> str:
        """ws:// (or wss://) URL devices connect to."""
        return f"{'wss' if self._ssl else 'ws'}://{self.host}:{self.port}"

    async def start(self, host: str = "127.0.0.1", port: int = 0, ssl: _ssl.SSLContext | None = None) -> None:
        """Listen on host:port (0 = a free port, in ``self.port``); ``ssl`` serves wss://. Raises OSError if the port is taken."""
        self._ssl, self.host = ssl, host
        self._server = await serve(self.handle, host, port, expected_fingerprint=self.fingerprint,
                                   auth_token=self.auth_token, max_frame_bytes=self.max_frame_bytes,
                                   server="relayinfer-patho", ssl=ssl, admit=self._admit, release=self._release,
                                   gate=self.gate, max_queue=1)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Close the listener and every connection; stop the compute thread."""
        if self._server is not None:
            self._server.close()
            self.gate.close()
            await self._server.wait_closed()
            self._server = None
        self.worker.shutdown(wait=False, cancel_futures=True)

    def _admit(self) -> Error | None:
        """At the websocket upgrade: OVERLOADED when ``max_sessions`` connections are open, else count it."""
        if self.num_sessions >= self.max_sessions:
            return Error(code=ErrorCode.OVERLOADED.value, retry_after_ms=self.retry_after_ms,
                         message=f"the slide service holds its limit of {self.max_sessions} connections; retry "
                                 f"after {self.retry_after_ms:.0f} ms")
        self.num_sessions += 1
        return None

    def _release(self) -> None:
        self.num_sessions -= 1

    async def handle(self, channel: ServerChannel) -> None:
        """One device connection: TileBatch in, Embeddings (and errors) out."""
        slides: dict[str, _Slide] = {}
        try:
            await self._handle(channel, slides)
        finally:
            for st in slides.values():
                st.free()
            slides.clear()

    def _batch_bytes(self, msg: TileBatch) -> int:
        """Bytes a batch holds while it is processed: its frame's arrays, the decoded uint8 tiles
        (JPEG), the encoder's float32 input and the float16/float32 embeddings out."""
        n = len(msg.coords)
        frame = msg.tiles.nbytes + sum(map(len, msg.jpeg)) + (msg.features.nbytes if msg.features else 0)
        decoded = n * self.tile_px * self.tile_px * 3 * (1 if msg.jpeg else 0)
        encoder_in = 0 if msg.features else n * self.tile_px * self.tile_px * 3 * 4
        return frame + decoded + encoder_in + n * max(self.screener.encoder.dim, DEVICE_FEATURE_DIM) * 6

    async def _handle(self, channel: ServerChannel, slides: dict) -> None:
        refused: dict[str, None] = {}    # request ids refused on this connection (the last 256), in order
        async for msg in channel:
            if not isinstance(msg, TileBatch):
                rid = getattr(msg, "request_id", None)
                if rid is not None:
                    await channel.send(Error(code=ErrorCode.BAD_REQUEST.value, request_id=rid,
                                             message=f"the slide service does not handle {type(msg).__name__}"))
                continue
            self.stats["bytes_in"] += msg.tiles.nbytes + sum(map(len, msg.jpeg)) + (msg.features.nbytes if msg.features else 0)
            if msg.request_id in refused:    # batches already in flight when the slide was refused
                await channel.send(Error(code=ErrorCode.UNKNOWN_REQUEST.value, request_id=msg.request_id,
                                         message=f"slide request {msg.request_id!r} was refused already"))
                continue
            need = self._batch_bytes(msg)
            charge = self.budget.try_charge("patho_batch", need)
            try:
                if charge is None:
                    raise _Refused(ErrorCode.OVERLOADED, self.budget.refusal(f"a batch of {len(msg.coords)} tiles", need)
                                   + f"; retry after {self.retry_after_ms:.0f} ms", self.retry_after_ms)
                reply = await self._batch(slides, msg)
            except Exception as e:  # this slide ends (a fault while serving it: INTERNAL); the connection goes on
                if not isinstance(e, _Refused):
                    log.exception("slide request %s failed", msg.request_id)
                    e = _Refused(ErrorCode.INTERNAL, f"internal error while screening: {type(e).__name__}: {e}")
                st = slides.pop(msg.request_id, None)
                if st is not None:
                    st.free()
                refused[msg.request_id] = None
                if len(refused) > 256:
                    refused.pop(next(iter(refused)))
                reply = Error(code=e.code.value, message=e.message, request_id=msg.request_id,
                              retry_after_ms=e.retry_after_ms)
            finally:
                if charge is not None:
                    charge.release()
            del msg
            await channel.send(reply)

    async def _batch(self, slides: dict[str, _Slide], msg: TileBatch):
        st = slides.get(msg.request_id)
        if st is None:
            if len(slides) >= self.max_slides_per_session:
                raise _Refused(ErrorCode.OVERLOADED, f"{len(slides)} slides already open on this connection "
                                                     f"(max_slides_per_session {self.max_slides_per_session})")
            st = slides[msg.request_id] = _Slide()
        tiles, feats = self._decode(msg)
        n = len(msg.coords)
        if st.n + n > self.max_tiles_per_slide:
            raise _Refused(ErrorCode.BAD_REQUEST, f"slide {msg.slide_id!r} exceeds max_tiles_per_slide {self.max_tiles_per_slide}")
        if n:
            mode = feats is not None
            if st.features is not None and st.features != mode:
                raise _Refused(ErrorCode.BAD_REQUEST, "a slide's batches must all carry pixels or all carry features")
            st.features = mode
        loop = asyncio.get_running_loop()
        if n and feats is None:
            t0 = time.perf_counter()
            emb = await loop.run_in_executor(self.worker, self.screener.encoder.encode, tiles)
            self.stats["encode_s"] += time.perf_counter() - t0
        else:
            emb = feats if feats is not None else np.zeros((0, self.screener.encoder.dim), np.float32)
        if n:
            kept = self.budget.try_charge("patho_embeddings", emb.nbytes)
            if kept is None:
                raise _Refused(ErrorCode.OVERLOADED, self.budget.refusal(f"keeping {n} embeddings of slide "
                                                                         f"{msg.slide_id!r}", emb.nbytes)
                               + f"; retry after {self.retry_after_ms:.0f} ms", self.retry_after_ms)
            st.charges.append(kept)
            st.chunks.append(emb)
            st.n += n
            self.stats["tiles"] += n
        self.stats["batches"] += 1
        reply = Embeddings(request_id=msg.request_id, embeddings=Tensor.from_numpy(emb.astype(np.float16)))
        if not msg.last:
            return reply
        slides.pop(msg.request_id, None)
        if st.n == 0:
            raise _Refused(ErrorCode.BAD_REQUEST, f"slide {msg.slide_id!r} ended with no tile: nothing to score")
        try:
            allemb = np.concatenate(st.chunks)
            score, attn = await loop.run_in_executor(self.worker, self.screener.score, allemb, bool(st.features))
        finally:
            st.free()
        self.stats["slides"] += 1
        enc = "device-features (efficientnet-lite0)" if st.features else self.screener.encoder.name
        return Embeddings(request_id=msg.request_id, embeddings=reply.embeddings, slide_score=score,
                          attention=Tensor.from_numpy(attn), encoder=enc, weights=self.screener.weights(bool(st.features)))

    def _decode(self, msg: TileBatch) -> tuple[np.ndarray | None, np.ndarray | None]:
        """(tiles uint8 (N, px, px, 3), None) or (None, features float32 (N, 1280)); raises _Refused."""
        n = len(msg.coords)
        if any(len(c) != 2 for c in msg.coords):
            raise _Refused(ErrorCode.BAD_REQUEST, "coords must be [x, y] pairs")
        try:  # the shared rules (`protocol.validate`): level-0 pixel offsets, scores in [0, 1], finite features
            for i, c in enumerate(msg.coords):
                check_ids(f"coords[{i}]", c, RULES["coord"].hi, rule="coord")
            if msg.device_scores:
                if len(msg.device_scores) != n:
                    raise FieldError("device_scores", f"empty or one score per tile ({n})", msg.device_scores)
                for i, v in enumerate(msg.device_scores):
                    check("device_score", v, f"device_scores[{i}]")
            if len(msg.slide_id) > MAX_ID_CHARS:
                raise FieldError("slide_id", f"at most {MAX_ID_CHARS} characters", msg.slide_id[:MAX_ID_CHARS] + "...")
            if msg.features is not None and msg.features.dtype in ("float16", "float32") and \
                    not np.isfinite(msg.features.to_numpy()).all():
                raise FieldError("features", "finite numbers (no NaN or infinity)", "a tensor with non-finite values")
        except FieldError as e:
            raise _Refused(ErrorCode.BAD_REQUEST, str(e)) from None
        kinds = [k for k, present in (("tiles", msg.tiles.shape[:1] != [0] and msg.tiles.nbytes > 0),
                                      ("jpeg", bool(msg.jpeg)), ("features", msg.features is not None)) if present]
        if len(kinds) > 1:
            raise _Refused(ErrorCode.BAD_REQUEST, f"a TileBatch carries one of tiles, jpeg, features; got {', '.join(kinds)}")
        if msg.features is not None:
            f = msg.features.to_numpy()
            if msg.features.dtype not in ("float16", "float32") or f.shape != (n, DEVICE_FEATURE_DIM):
                raise _Refused(ErrorCode.BAD_REQUEST, f"features must be float16/32 ({n}, {DEVICE_FEATURE_DIM}), one row "
                                                      f"for each of the {n} coords; got {msg.features.dtype} {tuple(f.shape)}")
            return None, f.astype(np.float32)
        if msg.jpeg:
            if len(msg.jpeg) != n:
                raise _Refused(ErrorCode.BAD_REQUEST, f"{len(msg.jpeg)} JPEG tiles for {n} coords")
            try:
                return np.stack([jpeg_decode(b, self.tile_px) for b in msg.jpeg]), None
            except ValueError as e:
                raise _Refused(ErrorCode.BAD_REQUEST, str(e)) from None
        t = msg.tiles
        if n == 0:
            return np.zeros((0, self.tile_px, self.tile_px, 3), np.uint8), None
        if t.dtype != "uint8" or list(t.shape) != [n, self.tile_px, self.tile_px, 3]:
            raise _Refused(ErrorCode.BAD_REQUEST, f"a batch of {n} coords without jpeg or features needs tiles, uint8 "
                                                  f"[{n}, {self.tile_px}, {self.tile_px}, 3]; got tiles {t.dtype} {t.shape}")
        return t.to_numpy(), None


class _Refused(Exception):
    def __init__(self, code: ErrorCode, message: str, retry_after_ms: float | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.retry_after_ms = code, message, retry_after_ms


class PathoServiceThread:
    """Run a PathoService on its own event loop in a daemon thread (embedded cloud of ``patho screen``
    without ``--cloud``, tests, the benchmark). Context manager; stops the service on exit (bounded: 30 s)."""

    def __init__(self, service: PathoService, host: str = "127.0.0.1", port: int = 0, ssl: _ssl.SSLContext | None = None):
        self.service, self._args = service, (host, port, ssl)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="patho-service", daemon=True)

    def __enter__(self) -> PathoService:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.service.start(*self._args), self.loop).result(30)
        return self.service

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.service.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()
