"""`relayinfer bench patho --quick` on the real SVS (the 2-block test ViT): the driver runs, writes its JSON
and plots, and the byte counts are ordered as the split intends. Marked slow (~30 s, two cores)."""
import json
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_patho_quick_writes_results_and_plots(tmp_path):
    run = runpy.run_path(str(ROOT / "bench" / "patho.py"))["run"]
    out = tmp_path / "patho.json"
    res = run(out=str(out), encoder_tiles=4, quick=True, command="relayinfer bench patho --quick", log=lambda m: None)
    saved = json.loads(out.read_text())
    assert saved["command"] == "relayinfer bench patho --quick" and saved["quick"] is True
    b = res["bytes"]
    assert b["split_features"] < b["split_jpeg"] < b["all_tissue_jpeg"] < b["all_tissue_raw"]
    assert res["split_run"]["tiles_sent"] < res["slide_info"]["tissue_tiles"] == 54
    for link in ("wifi", "lte"):
        m = res["modelled_e2e"][link]
        assert m["all_cloud"]["upload_s"] > m["split"]["upload_s"] > 0 and m["all_device"]["upload_s"] == 0
    assert (tmp_path / "patho-bytes.png").stat().st_size > 0 and (tmp_path / "patho-e2e.png").stat().st_size > 0
