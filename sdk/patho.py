"""Pathology split screening, device side end to end (torch-free): read a WSI, coarse-screen it with
ONNX Runtime, send candidate tiles to the cloud slide service in ``TileBatch`` frames over the shared
protocol (handshake, token, frame limits, TLS), and collect the slide score and per-tile attention.

    report = screen_slide("slide.svs", cloud_url="ws://127.0.0.1:8770", coarse_model=onnx_path)
    report.slide_score, report.attention; write_heatmap(report, "heat.png"); report.save("report.json")

Results carry ``random_weights`` (True when the cloud encoder, the ABMIL head or the device head is
a random initialisation: the scores then exercise the pipeline and mean nothing clinically).
"""
from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from relayinfer.device.screen import CoarseScreen, coarse_regions, payload_mode, select_candidates
from relayinfer.device.slide import SlideError, laplacian_variance, open_slide, tissue_mask
from relayinfer.protocol.errors import RelayInferError, RemoteError
from relayinfer.protocol.messages import MAX_FRAME_BYTES, Embeddings, Error, Tensor, TileBatch, encode
from relayinfer.protocol.patho import TILE_MPP, TILE_PX, jpeg_encode, patho_fingerprint

__all__ = ["PathoReport", "PathoClient", "screen_slide", "write_heatmap", "PAYLOADS"]

PAYLOADS = ("jpeg", "raw", "features", "auto")


@dataclass
class PathoReport:
    """Result of screening one slide. Sizes in bytes, times in seconds, coordinates in level-0 pixels.

    ``blurred_tiles``: candidate tiles not sent, their Laplacian variance below ``blur_var``.
    ``tiles``: one dict per tile sent: x, y, size, device_score (its region's), attention (cloud ABMIL
    weight, sums to 1 over the tiles sent). ``decision``: "positive"/"negative" against ``threshold``
    when one is given, else None. ``bytes_sent``: encoded TileBatch frames device -> cloud."""

    slide: str
    dimensions: list[int]
    mpp: float
    tile_px: int
    tile_mpp: float
    tissue_tiles: int
    regions: int
    candidate_regions: int
    tiles_sent: int
    blurred_tiles: int
    payload: str
    bytes_sent: int
    slide_bytes: int
    device_head: str
    encoder: str
    weights: str
    random_weights: bool
    slide_score: float
    threshold: float | None
    decision: str | None
    times: dict
    tiles: list[dict] = field(default_factory=list)
    calibration: dict | None = None

    def to_dict(self) -> dict:
        """Plain dict (JSON-ready)."""
        return asdict(self)

    def save(self, path: str | os.PathLike) -> None:
        """Write the JSON report (to a temporary name, then renamed: never half-written)."""
        p = Path(path)
        tmp = p.with_name(p.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        os.replace(tmp, p)


def screen_slide(path: str | os.PathLike, cloud_url: str, coarse_model: str | os.PathLike, *, token: str | None = None,
                 slide_mpp: float | None = None, mpp: float = TILE_MPP, tile_px: int = TILE_PX, region_tiles: int = 4,
                 keep: float = 0.5, device_threshold: float = 0.5, min_tissue: float = 0.25, blur_var: float = 50.0,
                 batch_tiles: int = 16,
                 payload: str = "jpeg", link_mbps: float | None = None, jpeg_quality: int = 90,
                 threshold: float | None = None, calibration: dict | None = None, ca: str | None = None,
                 verify: bool = True, threads: int = 1, timeout_s: float = 600.0,
                 progress: Callable[[str, int, int], None] | None = None) -> PathoReport:
    """Screen one slide (see the module docstring). ``progress(stage, done, total)`` is called per
    region screened ("screen") and per tile answered by the cloud ("cloud").

    ``payload``: "jpeg" (tiles as JPEG, ``jpeg_quality``), "raw" (uint8 pixels), "features" (device
    features, scored by the cloud's feature ABMIL), or "auto" (``payload_mode(link_mbps, ...)``).
    ``blur_var``: candidate tiles whose Laplacian variance (grey levels²) is lower are dropped as
    out of focus. ``threshold``: decision threshold on the slide score (e.g. from ``sdk.patho_calibration``).
    ``timeout_s`` bounds the whole exchange with the cloud. Raises SlideError for a bad slide or model,
    ValueError for a bad argument, RemoteError / ChannelClosed / OSError / TimeoutError from the cloud.
    """
    if payload not in PAYLOADS:
        raise ValueError(f"unknown payload {payload!r}; choose from {', '.join(PAYLOADS)}")
    if batch_tiles < 1:
        raise ValueError(f"batch_tiles must be >= 1, got {batch_tiles}")
    screen = CoarseScreen(coarse_model, threads=threads)   # a bad model file fails before any connection
    args = (path, screen, slide_mpp, mpp, tile_px, region_tiles, keep, device_threshold, min_tissue, blur_var,
            batch_tiles, payload, link_mbps, jpeg_quality, progress)
    return asyncio.run(asyncio.wait_for(_screen(cloud_url, token, ca, verify, args, threshold, calibration), timeout_s))


def _prepare(path, screen, slide_mpp, mpp, tile_px, region_tiles, keep, device_threshold, min_tissue, blur_var,
             batch_tiles, payload, link_mbps, jpeg_quality, progress) -> dict:
    """The device's work before sending: tissue mask, coarse screen of the regions, reading the
    candidate tiles and packing them into TileBatch keyword sets (runs in a worker thread)."""
    t0 = time.perf_counter()
    with open_slide(path, slide_mpp) as slide:
        mask, scale = tissue_mask(slide)
        regions, fine = coarse_regions(slide, mask, scale, mpp, tile_px, region_tiles, min_tissue)
        if not fine:
            raise SlideError(f"no tissue found in {path} (no {tile_px}-px tile at {mpp} µm/px with "
                             f">= {min_tissue:.0%} tissue)")
        t_mask = time.perf_counter()
        scores = np.empty(len(regions), np.float32)
        for i, r in enumerate(regions):
            _, s = screen.run(slide.read(r.spec.x, r.spec.y, r.spec.size, screen.tile_px)[None])
            scores[i] = r.score = float(s[0])
            if progress:
                progress("screen", i + 1, len(regions))
        t_screen = time.perf_counter()
        cand = select_candidates(scores, device_threshold, keep)
        sent = [(t, regions[i].score) for i in cand for t in regions[i].tiles]
        tiles = [slide.read(t.x, t.y, t.size, tile_px) for t, _ in sent]
        sharp = [laplacian_variance(t) >= blur_var for t in tiles]     # out-of-focus tiles are not sent
        sent = [st for st, ok in zip(sent, sharp) if ok]
        if not sent:
            raise SlideError(f"every candidate tile of {path} is blurred (Laplacian variance < {blur_var})")
        tiles = np.stack([t for t, ok in zip(tiles, sharp) if ok])
        t_read = time.perf_counter()
        info = dict(dimensions=list(slide.dimensions), mpp=slide.mpp)
    mode = payload_mode(link_mbps, len(sent)) if payload == "auto" else payload
    feats = screen.run(tiles)[0] if mode == "features" else None
    batches = []
    for i in range(0, len(sent), batch_tiles):
        chunk = slice(i, i + batch_tiles)
        kw = dict(coords=[[t.x, t.y] for t, _ in sent[chunk]], device_scores=[s for _, s in sent[chunk]])
        if mode == "raw":
            kw["tiles"] = Tensor.from_numpy(tiles[chunk])
        else:
            kw["tiles"] = Tensor.from_numpy(np.zeros((0, tile_px, tile_px, 3), np.uint8))
            if mode == "jpeg":
                kw["jpeg"] = [jpeg_encode(t, jpeg_quality) for t in tiles[chunk]]
            else:
                kw["features"] = Tensor.from_numpy(feats[chunk].astype(np.float16))
        batches.append(kw)
    t_pack = time.perf_counter()
    return dict(info, fine=len(fine), regions=len(regions), cand=int(len(cand)), sent=sent, mode=mode,
                blurred=len(sharp) - len(sent),
                batches=batches, times={"tissue_s": t_mask - t0, "screen_s": t_screen - t_mask,
                                        "read_s": t_read - t_screen, "pack_s": t_pack - t_read})


async def _screen(url, token, ca, verify, args, threshold, calibration) -> PathoReport:
    """Handshake first (a refused token or tile geometry fails before the slide is read), then the
    device work in a thread, then the batches (the next sent while the cloud encodes the previous:
    at most 2 in flight), then the report."""
    from relayinfer.protocol.transport.security import context_for_url
    from relayinfer.protocol.transport.ws import open_channel

    path, screen, tile_px, mpp, progress = args[0], args[1], args[4], args[3], args[-1]
    t0 = time.perf_counter()
    ssl = context_for_url(url, ca, verify)
    channel = await open_channel(url, patho_fingerprint(tile_px, mpp), token, client="relayinfer-patho-device",
                                 max_frame_bytes=MAX_FRAME_BYTES, **({"ssl": ssl} if ssl is not None else {}))
    try:
        prep = await asyncio.to_thread(_prepare, *args)
        t_send = time.perf_counter()
        result, nbytes = await _exchange(channel, str(path), prep["batches"], len(prep["sent"]), progress)
    finally:
        await channel.close()
    t_end = time.perf_counter()
    sent = prep["sent"]
    attn = result.attention.to_numpy().astype(float)
    if len(attn) != len(sent):
        raise RemoteError("internal", f"the cloud returned {len(attn)} attention weights for {len(sent)} tiles")
    random_weights = result.weights == "random-init" or screen.head == "random-init"
    return PathoReport(
        slide=str(path), dimensions=prep["dimensions"], mpp=prep["mpp"], tile_px=tile_px, tile_mpp=mpp,
        tissue_tiles=prep["fine"], regions=prep["regions"], candidate_regions=prep["cand"], tiles_sent=len(sent),
        blurred_tiles=prep["blurred"],
        payload=prep["mode"], bytes_sent=nbytes, slide_bytes=Path(path).stat().st_size, device_head=screen.head,
        encoder=result.encoder, weights=result.weights, random_weights=random_weights,
        slide_score=float(result.slide_score), threshold=threshold,
        decision=None if threshold is None else ("positive" if result.slide_score >= threshold else "negative"),
        times={**prep["times"], "cloud_s": t_end - t_send, "total_s": t_end - t0},
        tiles=[{"x": t.x, "y": t.y, "size": t.size, "device_score": round(s, 6), "attention": float(a)}
               for (t, s), a in zip(sent, attn)],
        calibration=calibration)


async def _exchange(channel, slide_id, batches, n_tiles, progress) -> tuple[Embeddings, int]:
    """Send the TileBatch frames of one slide; return (the result Embeddings, bytes sent)."""
    rid = uuid.uuid4().hex[:12]
    window = asyncio.Semaphore(2)
    result: list[Embeddings] = []
    done, nbytes = 0, 0

    async def reader():
        nonlocal done
        async for msg in channel:
            if isinstance(msg, Error):
                raise RemoteError(msg.code, msg.message, msg.request_id)
            if isinstance(msg, Embeddings) and msg.request_id == rid:
                window.release()
                done += msg.embeddings.shape[0]
                if progress:
                    progress("cloud", done, n_tiles)
                if msg.slide_score is not None:
                    result.append(msg)
                    return

    task = asyncio.create_task(reader())
    try:
        for i, kw in enumerate(batches):
            msg = TileBatch(request_id=rid, slide_id=slide_id, last=i == len(batches) - 1, **kw)
            acquire = asyncio.ensure_future(window.acquire())
            await asyncio.wait({acquire, task}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():               # the cloud refused the slide (or closed): stop sending at once
                acquire.cancel()
                break
            nbytes += len(encode(msg))
            await channel.send(msg)
        await task
    finally:
        task.cancel()
    if not result:
        raise RemoteError("internal", "the cloud closed the slide without a result")
    return result[0], nbytes


def _colormap(v: np.ndarray) -> np.ndarray:
    """Viridis-like colours (uint8 (n, 3)) for values in [0, 1] (5 anchors of matplotlib's viridis)."""
    anchors = np.array([[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]], np.float64)
    x = np.clip(v, 0, 1) * (len(anchors) - 1)
    i = np.minimum(x.astype(int), len(anchors) - 2)
    f = (x - i)[:, None]
    return np.rint(anchors[i] * (1 - f) + anchors[i + 1] * f).astype(np.uint8)


def write_heatmap(report: PathoReport, out: str | os.PathLike, max_px: int = 1024, alpha: float = 0.55) -> None:
    """PNG of the slide thumbnail (longest side ``max_px``) with each tile sent coloured by its attention
    (min-max normalised over the tiles sent; viridis: dark = lowest, yellow = highest), blended at ``alpha``. Written to a
    temporary name, then renamed."""
    from PIL import Image, ImageDraw

    with open_slide(report.slide, report.mpp) as slide:
        thumb = Image.fromarray(slide.thumbnail(max_px)).convert("RGBA")
        k = thumb.size[0] / slide.dimensions[0]
    att = np.array([t["attention"] for t in report.tiles], np.float64)
    span = att.max() - att.min() if att.size else 0.0
    colours = _colormap((att - att.min()) / span if span > 0 else np.ones_like(att))
    layer = Image.new("RGBA", thumb.size, (0, 0, 0, 0))
    draw = ImageDraw.Draw(layer)
    for t, c in zip(report.tiles, colours):
        x0, y0 = t["x"] * k, t["y"] * k
        draw.rectangle([x0, y0, x0 + t["size"] * k - 1, y0 + t["size"] * k - 1], fill=(*map(int, c), int(255 * alpha)))
    img = Image.alpha_composite(thumb, layer).convert("RGB")
    if report.random_weights:
        ImageDraw.Draw(img).text((4, 4), "RANDOM WEIGHTS: not a diagnosis", fill=(200, 0, 0))
    p = Path(out)
    tmp = p.with_name(p.name + f".tmp{os.getpid()}.png")
    img.save(tmp)
    os.replace(tmp, p)


class PathoClient:
    """The SDK entry of pathology screening: a slide service, its token and TLS trust, and the device's
    coarse-screen model, kept for many slides.

        client = PathoClient("ws://127.0.0.1:8770", token="...", coarse_model="coarse.onnx")
        report = client.screen("slide.svs", threshold=0.31)
        write_heatmap(report, "heat.png")

    (Not a method of ``Client``, whose constructor loads the LLM device engine a slide scanner does not need.)
    ``coarse_model`` None = the cached export (needs torch once to make it). Keyword arguments of
    ``screen`` are those of :func:`screen_slide`. Raises ValueError for a cloud_url that is not ws(s)://,
    else as :func:`screen_slide`.
    """

    def __init__(self, cloud_url: str, token: str | None = None, coarse_model: str | os.PathLike | None = None,
                 ca: str | None = None, verify: bool = True, threads: int = 1) -> None:
        if not str(cloud_url).lower().startswith(("ws://", "wss://")):
            raise ValueError(f"cloud_url must be ws://HOST:PORT or wss://HOST:PORT of `relayinfer patho serve`, got {cloud_url!r}")
        self.cloud_url, self.token, self.ca, self.verify, self.threads = cloud_url, token, ca, verify, threads
        if coarse_model is None:
            try:
                from relayinfer.cloud.patho.effnet import ensure_coarse_model
            except ImportError:
                raise SlideError("no coarse_model given and torch is not installed to export one") from None
            coarse_model = ensure_coarse_model()
        self.coarse_model = Path(coarse_model)

    def screen(self, path: str | os.PathLike, **kw) -> PathoReport:
        """Screen one slide; returns its PathoReport."""
        return screen_slide(path, self.cloud_url, self.coarse_model, token=self.token, ca=self.ca, verify=self.verify,
                            threads=self.threads, **kw)
