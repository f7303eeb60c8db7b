"""`relayinfer relay ...` and `bench patho` from the command line. Where the benches write: by default
under the working directory (bench/results/, as every `relayinfer bench` command), or --out; either
way the command ends by naming the absolute path it wrote. The drivers' measurements are replaced by
a stand-in that writes what it is given (the real runs take minutes). `relay serve --checkpoint`:
a bad file exits 2 by name before anything listens; a good one reaches the instance process."""
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from relayinfer.sdk.cli import app
from relayinfer.sdk.cli_common import bench_module


@pytest.fixture
def driver(monkeypatch):
    """bench.relay / bench.patho with `run` replaced: it records its arguments and writes the JSON
    where it is told, as the real run does."""
    calls = []

    def relay_run(out_json, quick=False, live=True, log=print, shape="trained", timings=None):
        calls.append({"out": out_json, "quick": quick, "live": live, "shape": shape})
        out_json.parent.mkdir(parents=True, exist_ok=True)
        out_json.write_text(json.dumps({"shape": shape}))
        log("table")
        return {}

    def patho_run(out="bench/results/patho.json", encoder_tiles=8, quick=False, keep=0.5, command="", log=print):
        calls.append({"out": out, "quick": quick, "encoder_tiles": encoder_tiles})
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({"command": command}))
        return {"summary": {"tiles": 1}}

    monkeypatch.setattr(bench_module("relay"), "run", relay_run)
    monkeypatch.setattr(bench_module("patho"), "run", patho_run)
    return calls


def _wrote(output: str) -> Path:
    last = [ln for ln in output.splitlines() if ln.strip()][-1]
    assert last.startswith("wrote /"), output
    return Path(last[len("wrote "):])


@pytest.mark.parametrize("cmd", [["relay", "bench"], ["bench", "relay"]])
def test_relay_bench_writes_under_the_working_directory_and_says_where(cmd, driver, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, [*cmd, "--quick", "--no-live"])
    assert r.exit_code == 0, r.output
    path = _wrote(r.output)
    assert path == tmp_path / "bench" / "results" / "relay.json" and json.loads(path.read_text()) == {"shape": "trained"}
    assert driver == [{"out": path, "quick": True, "live": False, "shape": "trained"}]


def test_relay_bench_out_and_shape(driver, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["relay", "bench", "--shape", "production"])
    assert r.exit_code == 0, r.output
    assert _wrote(r.output) == tmp_path / "bench" / "results" / "relay_production.json"
    r = CliRunner().invoke(app, ["bench", "relay", "--out", "mine/r.json"])  # relative to the working directory
    assert r.exit_code == 0, r.output
    assert _wrote(r.output) == tmp_path / "mine" / "r.json" and (tmp_path / "mine" / "r.json").is_file()
    assert [c["out"].name for c in driver] == ["relay_production.json", "r.json"]


def test_relay_bench_refuses_a_bad_out_or_shape_by_name(driver, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["relay", "bench", "--out", str(tmp_path)])
    assert r.exit_code == 2 and f"error: --out {tmp_path}: is a directory" in r.output, r.output
    r = CliRunner().invoke(app, ["relay", "bench", "--shape", "huge"])
    assert r.exit_code == 2 and "error: --shape 'huge': choose trained or production" in r.output, r.output
    assert driver == []  # refused before the driver runs


def test_patho_bench_says_where_it_wrote(driver, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["bench", "patho", "--quick"])
    assert r.exit_code == 0, r.output
    path = _wrote(r.stderr)  # stdout stays one JSON document (the summary)
    assert path == tmp_path / "bench" / "results" / "patho.json" and path.is_file()
    assert json.loads(r.stdout) == {"tiles": 1}
    r = CliRunner().invoke(app, ["bench", "patho", "--out", "p/x.json"])
    assert r.exit_code == 0, r.output
    assert _wrote(r.stderr) == tmp_path / "p" / "x.json" and (tmp_path / "p" / "x.json").is_file()
    assert [c["out"] for c in driver] == [str(tmp_path / "bench" / "results" / "patho.json"), str(tmp_path / "p" / "x.json")]


def test_relay_serve_checkpoint_is_checked_then_passed_on(tmp_path, monkeypatch):
    import shutil

    import relayinfer.cloud.relay.server as server
    from relayinfer.cloud.relay.train import default_checkpoint

    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    r = CliRunner().invoke(app, ["relay", "serve", "--port", "0", "--checkpoint", str(tmp_path / "junk.pt")])
    assert r.exit_code == 2 and f"error: --checkpoint {tmp_path / 'junk.pt'}: not an HSTU checkpoint" in r.stderr, r.output
    r = CliRunner().invoke(app, ["relay", "serve", "--port", "0", "--checkpoint", str(tmp_path / "none.pt")])
    assert r.exit_code == 2 and f"error: --checkpoint {tmp_path / 'none.pt'}: no such file" in r.stderr, r.output
    mine = shutil.copy(default_checkpoint(), tmp_path / "mine.pt")
    seen = []
    monkeypatch.setattr(server, "main", seen.append)  # the instance process's entry point: its argv
    r = CliRunner().invoke(app, ["relay", "serve", "--port", "0", "--checkpoint", str(mine)])
    assert r.exit_code == 0, r.output
    argv = seen[0]
    assert argv[argv.index("--checkpoint") + 1] == str(mine) and argv[argv.index("--port") + 1] == "0"
