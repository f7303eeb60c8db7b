"""`relayinfer patho serve | screen | calibrate` as a user runs them (the service in its own process,
the 2-block test ViT so the case stays short; the CLI path is the same for ViT-L/16)."""
import json
import os
import subprocess
import sys
import time

import pytest
from PIL import Image
from typer.testing import CliRunner

from relayinfer.cloud.patho.effnet import ensure_coarse_model
from relayinfer.device.slide import bundled_svs
from relayinfer.sdk.cli import app

BIN = os.path.join(os.path.dirname(sys.executable), "relayinfer")


@pytest.fixture(scope="module")
def served():
    model = ensure_coarse_model()
    proc = subprocess.Popen([BIN, "patho", "serve", "--port", "0", "--arch", "vit-tiny-test", "--token", "tk",
                             "--duration-s", "240"], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        t_end, line = time.monotonic() + 120, ""
        while time.monotonic() < t_end and "patho service:" not in line:
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                break
        assert "patho service: ws://127.0.0.1:" in line and "RANDOM WEIGHTS" in line, line
        yield line.split()[2], model
    finally:
        proc.terminate()
        proc.wait(10)


def test_screen_writes_heatmap_and_report(served, tmp_path):
    url, model = served
    cal = tmp_path / "cal.csv"
    cal.write_text("score,label\n" + "\n".join(f"{i / 10},{int(i >= 5)}" for i in range(10)))
    r = CliRunner().invoke(app, ["patho", "calibrate", str(cal), "--target", "0.8", "--out", str(tmp_path / "cal.json")])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "cal.json").read_text())["threshold"] == 0.6   # 4 of 5 positives >= 0.6
    r = CliRunner().invoke(app, ["patho", "screen", str(bundled_svs()), "--cloud", url, "--token", "tk",
                                 "--coarse-model", str(model), "--calibration", str(tmp_path / "cal.json"),
                                 "--out-dir", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert "RANDOM WEIGHTS" in r.output and "tiles sent" in r.output
    rep = json.loads((tmp_path / "cmu_small_region.svs.report.json").read_text())
    assert rep["threshold"] == 0.6 and rep["decision"] in ("positive", "negative")
    assert rep["random_weights"] and rep["tiles_sent"] == len(rep["tiles"]) > 0
    assert Image.open(tmp_path / "cmu_small_region.svs.heatmap.png").size == (766, 1024)


@pytest.mark.parametrize("args,message", [
    (["--payload", "png"], "unknown --payload 'png'"),
    (["--threshold", "0.5", "--calibration", "x.json"], "not both"),
    (["--calibration", "/nonexistent.json"], "not a calibration JSON"),
])
def test_bad_screen_options_exit_2(served, args, message):
    url, model = served
    r = CliRunner().invoke(app, ["patho", "screen", str(bundled_svs()), "--cloud", url, "--coarse-model", str(model), *args])
    assert r.exit_code == 2 and message in r.output


def test_bad_slide_and_token_exit_2(served, tmp_path):
    url, model = served
    (tmp_path / "x.svs").write_text("text")
    r = CliRunner().invoke(app, ["patho", "screen", str(tmp_path / "x.svs"), "--cloud", url, "--token", "tk",
                                 "--coarse-model", str(model)])
    assert r.exit_code == 2 and "not a whole-slide image" in r.output
    r = CliRunner().invoke(app, ["patho", "screen", str(bundled_svs()), "--cloud", url, "--coarse-model", str(model)])
    assert r.exit_code == 2 and "requires an auth token" in r.output
    r = CliRunner().invoke(app, ["patho", "serve", "--port", "0", "--arch", "vit-h"])
    assert r.exit_code == 2 and "unknown --arch 'vit-h'" in r.output
