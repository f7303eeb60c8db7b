"""One auth and TLS policy for every server (`cloud serve`, `pd serve`, `relay serve`, `patho serve`):
a non-loopback --host without a token exits 2 before anything binds (unless --insecure-no-auth);
relay serve requires its token (Hello and GET /stats) and starts on a fresh HOME; the local Ray
listens on loopback only."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from typer.testing import CliRunner

from relayinfer.protocol.transport import ws as proto_ws
from relayinfer.protocol.errors import ErrorCode, RemoteError
from relayinfer.protocol.transport.security import check_exposure
from relayinfer.sdk.cli import app

SERVERS = [["cloud", "serve", "--port", "0", "--http-port", "0"], ["pd", "serve", "--port", "0", "--http-port", "0"],
           ["relay", "serve", "--port", "0"], ["patho", "serve", "--port", "0"]]


@pytest.mark.parametrize("cmd", SERVERS, ids=lambda c: c[0])
@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.7"])
def test_non_loopback_without_token_exits_2_before_binding(cmd, host, monkeypatch, nothing_loads):
    res = CliRunner().invoke(app, cmd + ["--host", host])
    assert res.exit_code == 2, res.output
    out = res.output + (res.stderr if res.stderr_bytes is not None else "")
    assert f"--host {host} listens beyond this machine" in out and "--token" in out and "--insecure-no-auth" in out


@pytest.fixture
def nothing_loads(monkeypatch):
    """No token in the environment; loading a model or encoder, starting Ray or looking at a port
    fails the test: the policy under test comes before all of them."""
    import relayinfer.cloud.patho.encoder as patho_encoder
    import relayinfer.cloud.pd.ray_pool as ray_pool
    import relayinfer.cloud.relay.server as relay_server
    import relayinfer.sdk.checks as checks
    from relayinfer.cloud.engine.torch_engine import TorchEngine

    def loaded(what):
        return lambda *a, **k: pytest.fail(f"{what} before the exposure check")
    monkeypatch.delenv("RELAYINFER_TOKEN", raising=False)
    monkeypatch.setattr(TorchEngine, "__init__", loaded("a model was loaded"))  # refused before any model,
    monkeypatch.setattr(patho_encoder, "ViTEncoder", loaded("patho serve loaded its encoder"))
    monkeypatch.setattr(relay_server, "main", loaded("relay serve loaded its model"))
    monkeypatch.setattr(ray_pool, "start_ray", loaded("Ray was started"))  # Ray
    monkeypatch.setattr(checks, "check_ports_free", loaded("a port was looked at"))  # or port


def test_exposure_rule():
    check_exposure("127.0.0.1", None)
    check_exposure("::1", None)
    check_exposure("0.0.0.0", "t")
    check_exposure("0.0.0.0", None, insecure_no_auth=True)
    for host in ("0.0.0.0", "", "10.1.2.3", "example.com", "127.1", "::ffff:10.0.0.1"):
        with pytest.raises(ValueError, match="--insecure-no-auth"):
            check_exposure(host, None)
    for token in ("", " ", "\t\n"):  # a token nobody can present over HTTP: refused on every host
        for host in ("127.0.0.1", "0.0.0.0"):
            with pytest.raises(ValueError, match="--token .* is empty"):
                check_exposure(host, token)


@pytest.mark.parametrize("cmd", SERVERS, ids=lambda c: c[0])
def test_blank_token_exits_2_on_every_server(cmd, nothing_loads):
    res = CliRunner().invoke(app, cmd + ["--token", " "])
    assert res.exit_code == 2, res.output
    assert "is empty" in res.output + (res.stderr if res.stderr_bytes is not None else "")


def test_pd_serve_checks_its_tls_files_first(tmp_path):
    res = CliRunner().invoke(app, ["pd", "serve", "--port", "0", "--http-port", "0", "--certfile", str(tmp_path / "x.pem")])
    assert res.exit_code == 2 and "--certfile and --keyfile go together" in res.output + res.stderr
    res = CliRunner().invoke(app, ["pd", "serve", "--port", "0", "--http-port", "0", "--certfile",
                                   str(tmp_path / "x.pem"), "--keyfile", str(tmp_path / "k.pem")])
    assert res.exit_code == 2 and "no such file" in res.output + res.stderr


def _fresh_env(home) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RELAYINFER_CACHE", "XDG_CACHE_HOME", "RELAYINFER_TOKEN")}
    env["HOME"] = str(home)
    env["OMP_NUM_THREADS"] = "1"
    return env


def test_relay_serve_needs_its_token_and_starts_on_a_fresh_home(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "relayinfer.sdk.cli", "relay", "serve", "--port", "0",
                             "--token", "s3cret"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_fresh_env(home))
    try:
        t_end, line = time.monotonic() + 600, ""
        while time.monotonic() < t_end and proc.poll() is None:
            line = proc.stdout.readline()
            if line.startswith("READY"):
                break
        assert line.startswith("READY"), f"no READY (rc {proc.poll()}): {proc.stderr.read()[-2000:]}"
        _, port, fp = line.split()
        assert (home / ".cache" / "relayinfer" / "relay" / "latency.json").is_file()  # fitted once, written
        url = f"http://127.0.0.1:{port}/stats"
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url, timeout=30)
        assert e.value.code == 401 and e.value.headers["WWW-Authenticate"].startswith("Bearer")
        assert json.loads(e.value.read())["error"]["code"] == "unauthorized"
        ok = urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": "Bearer s3cret"}), timeout=30)
        assert "pid" in json.loads(ok.read())

        async def hello(token):
            ch = await proto_ws.open_channel(f"ws://127.0.0.1:{port}", fp, token)
            await ch.close()

        for wrong in (None, "nope"):
            with pytest.raises(RemoteError) as e:
                asyncio.run(asyncio.wait_for(hello(wrong), 30))
            assert e.value.code is ErrorCode.UNAUTHORIZED
        asyncio.run(asyncio.wait_for(hello("s3cret"), 30))
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_local_ray_kwargs_bind_loopback_without_dashboard():
    from relayinfer.cloud.pd.ray_pool import ray_init_kwargs

    kw, env = ray_init_kwargs(None, num_cpus=2)
    assert kw["_node_ip_address"] == "127.0.0.1" and kw["include_dashboard"] is False and kw["num_cpus"] == 2
    assert kw["address"] is None and env == {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    kw, env = ray_init_kwargs("auto")  # joining a cluster: Ray's own addresses, still no dashboard
    assert "_node_ip_address" not in kw and kw["include_dashboard"] is False and env == {} and kw["address"] == "auto"


RAY_PROBE = r"""
import json, sys, time
import psutil
from relayinfer.cloud.pd.ray_pool import start_ray
import ray
start_ray(None, num_cpus=1)
time.sleep(2)
addrs = set()
for p in [psutil.Process()] + psutil.Process().children(recursive=True):
    try:
        addrs |= {c.laddr.ip for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
    except psutil.Error:
        pass
print(json.dumps({"node_ip": ray._private.worker._global_node.node_ip_address, "listen": sorted(addrs)}))
ray.shutdown()
"""


@pytest.mark.slow
def test_local_ray_listens_on_loopback_only(tmp_path):
    out = subprocess.run([sys.executable, "-c", RAY_PROBE], capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["node_ip"] == "127.0.0.1"
    assert got["listen"] and all(a in ("127.0.0.1", "::ffff:127.0.0.1") for a in got["listen"]), got
