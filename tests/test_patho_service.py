"""The slide service end to end on the real SVS: device coarse screen (ONNX) -> TileBatch frames over the
shared websocket protocol (token, fingerprint, limits) -> cloud encoder + ABMIL -> slide score, attention,
heatmap and report. The cloud encoder here is a 2-block random-init ViT (same code path as ViT-L/16)."""
import asyncio
import json

import numpy as np
import pytest
from PIL import Image

from relayinfer.cloud.patho.effnet import ensure_coarse_model
from relayinfer.cloud.patho.encoder import ViTEncoder
from relayinfer.cloud.patho.service import PathoService, PathoServiceThread, SlideScreener
from relayinfer.cloud.patho.vit import VIT_TINY_TEST
from relayinfer.device.slide import bundled_svs
from relayinfer.protocol.errors import RemoteError
from relayinfer.protocol.messages import Embeddings, Error, Tensor, TileBatch, encode
from relayinfer.protocol.patho import jpeg_encode, patho_fingerprint
from relayinfer.protocol.transport.ws import open_channel
from relayinfer.sdk.patho import screen_slide, write_heatmap


@pytest.fixture(scope="module")
def coarse():
    return ensure_coarse_model()                                        # exported once into the cache


@pytest.fixture(scope="module")
def cloud():
    svc = PathoService(SlideScreener(ViTEncoder(cfg=VIT_TINY_TEST, seed=0)), auth_token="s3cret",
                       max_tiles_per_slide=60, max_slides_per_session=2)
    with PathoServiceThread(svc) as running:
        yield running


def test_screen_the_real_svs_end_to_end(cloud, coarse, tmp_path):
    seen = []
    r = screen_slide(bundled_svs(), cloud.url, coarse, token="s3cret", keep=0.5, batch_tiles=8,
                     threshold=0.5, progress=lambda stage, done, total: seen.append((stage, done, total)))
    assert r.tissue_tiles >= 30 and r.regions >= 6 and r.blurred_tiles == 0   # in-focus scan: nothing dropped
    assert r.candidate_regions == -(-r.regions // 2)                  # top half of the regions
    assert 0 < r.tiles_sent < r.tissue_tiles and len(r.tiles) == r.tiles_sent
    att = np.array([t["attention"] for t in r.tiles])
    assert att.sum() == pytest.approx(1.0, abs=1e-5) and (att > 0).all()
    assert 0 < r.slide_score < 1 and r.decision == ("positive" if r.slide_score >= 0.5 else "negative")
    assert r.random_weights and r.weights == "random-init" and r.device_head == "random-init"
    assert r.payload == "jpeg" and r.bytes_sent < r.tiles_sent * 224 * 224 * 3 / 3
    assert seen[-1] == ("cloud", r.tiles_sent, r.tiles_sent) and ("screen", r.regions, r.regions) in seen
    # the same tiles as raw pixels: same attention up to JPEG loss, ~8x the bytes
    raw = screen_slide(bundled_svs(), cloud.url, coarse, token="s3cret", keep=0.5, payload="raw")
    assert [(t["x"], t["y"]) for t in raw.tiles] == [(t["x"], t["y"]) for t in r.tiles]
    assert raw.bytes_sent > 4 * r.bytes_sent
    feats = screen_slide(bundled_svs(), cloud.url, coarse, token="s3cret", keep=0.5, payload="features")
    assert feats.encoder.startswith("device-features") and feats.bytes_sent < r.bytes_sent / 4
    write_heatmap(r, tmp_path / "heat.png")
    r.save(tmp_path / "report.json")
    img = np.asarray(Image.open(tmp_path / "heat.png"))
    thumb_glass = img[-5:, :5]                                         # bottom-left corner: glass, not tinted
    assert img.shape[:2] == (1024, 766) and thumb_glass.mean() > 200
    assert json.loads((tmp_path / "report.json").read_text())["tiles_sent"] == r.tiles_sent


def test_sdk_client_screens_slides_and_drops_out_of_focus_tiles(cloud, coarse):
    from relayinfer.sdk.patho import PathoClient

    client = PathoClient(cloud.url, token="s3cret", coarse_model=coarse)
    r = client.screen(bundled_svs(), payload="features", keep=1.0, blur_var=1500)
    assert r.candidate_regions == r.regions                             # keep=1: every region is a candidate
    assert r.blurred_tiles > 0 and r.tiles_sent + r.blurred_tiles == r.tissue_tiles   # smooth stroma tiles dropped
    with pytest.raises(ValueError, match="ws://HOST:PORT"):
        PathoClient("http://127.0.0.1:1", coarse_model=coarse)


def test_auth_and_tile_geometry_are_checked_at_the_handshake(cloud, coarse):
    with pytest.raises(RemoteError) as e:
        screen_slide(bundled_svs(), cloud.url, coarse, token="wrong")
    assert e.value.code.value == "unauthorized"
    with pytest.raises(RemoteError) as e:
        screen_slide(bundled_svs(), cloud.url, coarse, token="s3cret", mpp=1.0)     # tiles at 10x
    assert e.value.code.value == "fingerprint_mismatch"


def _exchange(url, msgs):
    async def run():
        ch = await open_channel(url, patho_fingerprint(), "s3cret")
        out = []
        try:
            for m in msgs:
                await ch.send(m)
                out.append(await asyncio.wait_for(ch.recv(), 30))
        finally:
            await ch.close()
        return out
    return asyncio.run(run())


def _empty():
    return Tensor.from_numpy(np.zeros((0, 224, 224, 3), np.uint8))


def test_a_slide_refused_mid_way_ends_the_screen_at_once(coarse):
    svc = PathoService(SlideScreener(ViTEncoder(cfg=VIT_TINY_TEST)), max_tiles_per_slide=3)
    with PathoServiceThread(svc) as small:
        with pytest.raises(RemoteError, match="max_tiles_per_slide 3") as e:
            screen_slide(bundled_svs(), small.url, coarse, batch_tiles=1, payload="features", timeout_s=120)
        assert e.value.code.value == "bad_request"
        assert svc.stats["tiles"] == 3                                   # nothing after the refusal was encoded


def test_bad_batches_get_named_errors_and_limits_hold(cloud):
    tile = np.full((224, 224, 3), 200, np.uint8)
    good = jpeg_encode(tile)
    out = _exchange(cloud.url, [
        TileBatch("a", "s", [[0, 0]], _empty(), jpeg=[b"not a jpeg"]),
        TileBatch("b", "s", [[0, 0]], _empty(), jpeg=[jpeg_encode(tile[:100, :100])]),
        TileBatch("c", "s", [[0, 0], [1, 1]], _empty(), jpeg=[good]),
        TileBatch("d", "s", [[0, 0]], Tensor.from_numpy(tile[None]), jpeg=[good]),
        TileBatch("e", "s", [[0, 0]] * 61, _empty(), jpeg=[good] * 61),
        TileBatch("f", "s", [], _empty(), last=True),
        TileBatch("g", "s", [[0, 0]], _empty(), jpeg=[good]),
        TileBatch("h", "s", [[0, 0]], _empty(), jpeg=[good]),
        TileBatch("i", "s", [[0, 0]], _empty(), jpeg=[good]),
        TileBatch("g", "s", [[0, 0]], _empty(), jpeg=[good], last=True),
    ])
    codes = [(m.request_id, m.code if isinstance(m, Error) else "ok") for m in out]
    assert codes == [("a", "bad_request"), ("b", "bad_request"), ("c", "bad_request"), ("d", "bad_request"),
                     ("e", "bad_request"), ("f", "bad_request"), ("g", "ok"), ("h", "ok"), ("i", "overloaded"),
                     ("g", "ok")]
    assert "not a readable JPEG" in out[0].message and "expected 224x224" in out[1].message
    assert "max_tiles_per_slide 60" in out[4].message and "no tile" in out[5].message
    last = out[-1]
    assert isinstance(last, Embeddings) and last.attention.to_numpy().tolist() == [0.5, 0.5]
    assert last.embeddings.shape == [1, 64] and last.weights == "random-init"
