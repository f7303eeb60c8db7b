"""A ranking instance started here (127.0.0.1, a free port) tells its model fingerprint on GET /healthz
(the details only to an authorized caller, as `cloud serve`'s /healthz); a client connects with it and
ranks; another fingerprint is refused at the handshake in words. The README's relay client example is
run as written against such an instance."""
import asyncio
import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from relayinfer.cloud.relay.client import RelayClient, server_fingerprint, spawn_instance
from relayinfer.cloud.relay.latency import LatencyModel
from relayinfer.cloud.relay.train import default_checkpoint, load
from relayinfer.protocol.errors import RemoteError
from relayinfer.protocol.model.model_file import file_sha256

ROOT = Path(__file__).resolve().parents[1]
# every ranking request is at risk of the budget: the trigger pre-infers all of them
CFG = {"trigger": {"budget_ms": 100, "risk_fraction": 0.0, "token_rate": 1e6, "token_burst": 1e6}}
ITEMS, TIMES = [50, 172, 133, 204], [874965758, 874965900, 874966100, 874966500]


def _latency(d: Path) -> str:
    p = d / "latency.json"  # a fixed latency model: no timing run at start-up
    LatencyModel(full=[0.0, 0.1, 0.0, 0.0], prefix=[0.0, 0.09, 0.0], cached=[1.0, 0.0, 0.0]).to_json(p)
    return str(p)


@pytest.fixture(scope="module")
def instance(tmp_path_factory):
    d = tmp_path_factory.mktemp("relay-healthz")
    p = spawn_instance("i0", str(default_checkpoint()), _latency(d), CFG, lifetime_s=120, start_timeout_s=60)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def model():
    return load(default_checkpoint())[0]


def _get(url: str, token: str | None = None) -> tuple[int, str, dict]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.headers.get("Content-Type"), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type"), json.loads(e.read())


def _ref(model, items, times, cands) -> np.ndarray:
    return model.score(torch.tensor([items]), torch.tensor([times]), torch.tensor([len(items)]),
                       torch.tensor([cands])).detach().numpy()[0]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_healthz_names_the_fingerprint_and_a_client_ranks_with_it(instance, model):
    status, ctype, body = _get(f"http://127.0.0.1:{instance.port}/healthz")
    want = file_sha256(default_checkpoint())
    assert (status, ctype) == (200, "application/json")
    assert body == {"status": "ok", "model_fingerprint": want, "model": "hstu_ml100k.pt", "relay": True}
    fp = server_fingerprint(instance.url)
    assert fp == want == instance.fingerprint  # the same as the READY line's

    async def go():
        client = await RelayClient.connect({"i0": instance.url}, fp)
        try:
            return await client.rank(1, ITEMS, TIMES, [1, 98, 181])
        finally:
            await client.close()

    scores, source, inst = run(go())
    assert inst == "i0" and source == "recompute" and scores.dtype == np.float32
    np.testing.assert_allclose(scores, _ref(model, ITEMS, TIMES, [1, 98, 181]), rtol=1e-5, atol=1e-5)


def test_a_wrong_fingerprint_is_refused_in_words(instance):
    async def go():
        await RelayClient.connect({"i0": instance.url}, "0" * 64)

    with pytest.raises(RemoteError) as e:
        run(go())
    assert e.value.code.value == "fingerprint_mismatch"
    assert e.value.message == (f"model fingerprint mismatch: server has {instance.fingerprint[:16]}…, "
                               f"client sent {'0' * 16}…")
    assert server_fingerprint(instance.url) == instance.fingerprint  # the instance serves on


def test_fingerprint_read_errors_are_named():
    with pytest.raises(ValueError, match=r"url must be ws://HOST:PORT or wss://HOST:PORT, got 'http://x:1'"):
        server_fingerprint("http://x:1")
    import socket
    with socket.socket() as s:  # bound, never listening: nothing answers there
        s.bind(("127.0.0.1", 0))
        with pytest.raises(OSError):
            server_fingerprint(f"ws://127.0.0.1:{s.getsockname()[1]}", timeout_s=2)


def test_with_a_token_healthz_keeps_the_fingerprint_to_authorized_callers(tmp_path):
    p = spawn_instance("t0", str(default_checkpoint()), _latency(tmp_path), lifetime_s=60, start_timeout_s=60,
                       token="tk")
    try:
        assert _get(f"http://127.0.0.1:{p.port}/healthz") == (200, "application/json", {"status": "ok"})
        assert _get(f"http://127.0.0.1:{p.port}/healthz", "tk")[2]["model_fingerprint"] == p.fingerprint
        assert _get(f"http://127.0.0.1:{p.port}/stats")[0] == 401
        with pytest.raises(PermissionError, match=r"requires a bearer token \(none was given; pass token="):
            server_fingerprint(p.url)
        with pytest.raises(PermissionError, match=r"requires a bearer token \(the one given was refused"):
            server_fingerprint(p.url, token="nope")
        assert server_fingerprint(p.url, token="tk") == p.fingerprint
    finally:
        p.stop()


def readme_relay_example() -> str:
    """The Python block after the `relay-client-example` marker in README.md."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    m = re.search(r"<!-- relay-client-example -->\n```python\n(.*?)\n```", text, re.S)
    assert m, "README.md lost its relay client example (the marker and the python block after it)"
    return m.group(1)


def test_the_readme_relay_client_example_runs_as_written(instance, model, monkeypatch, capsys):
    code = readme_relay_example()
    assert "server_fingerprint(url)" in code and len(code.splitlines()) <= 20
    monkeypatch.setenv("RELAY_URL", instance.url)
    ns = {"__name__": "__main__"}
    exec(compile(code, "README.md", "exec"), ns)
    assert ns["fp"] == instance.fingerprint
    assert ns["source"] == "hbm"  # the trigger pre-infers every request here: ranked on the prefix
    np.testing.assert_allclose(ns["scores"], _ref(model, ns["items"], ns["times"], [1, 98, 181]),
                               rtol=1e-5, atol=1e-5)
    assert capsys.readouterr().out.startswith("hbm [")
