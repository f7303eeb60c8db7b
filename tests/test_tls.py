"""TLS on both ports, with certificates made by `trustme` (a throw-away CA).

The same cloud configuration serves once over plain ws:// + http:// and once over wss:// +
https:// (token required on both). Over TLS with the CA: a split generation (mode split) gives the
same tokens as over ws://, the device-model download verifies, the `openai` client works with
httpx's `verify` set to the CA file. Without the CA, the certificate is refused quickly: split
falls back to the device with an error naming the certificate problem, cloud-only raises.
"""
from __future__ import annotations

import asyncio
import json
import logging
import shutil
import ssl
import subprocess
import sys
import urllib.error

import pytest

from relayinfer.cloud.engine.llm_engine import AsyncLLMEngine, LLMEngine
from relayinfer.cloud.serve.service import CloudService, ServiceThread
from relayinfer.device.profiles import DeviceProfile
from relayinfer.protocol.transport.security import client_context, server_context
from relayinfer.sdk import Client
from conftest import CloudFirstClient

trustme = pytest.importorskip("trustme")
openai = pytest.importorskip("openai")

TOKEN = "tls-test-token"
MODEL = "smollm2-135m-instruct"
SLOW_DEVICE = DeviceProfile("test-slow", prefill_ms_per_token=40.0)  # the cloud answers first
BUDGET, MAX_NEW = 8, 24


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """(ca.pem, cert.pem, key.pem, other-ca.pem) for 127.0.0.1 and localhost."""
    d = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    leaf.cert_chain_pems[0].write_to_path(str(d / "cert.pem"))
    for pem in leaf.cert_chain_pems[1:]:
        pem.write_to_path(str(d / "cert.pem"), append=True)
    leaf.private_key_pem.write_to_path(str(d / "key.pem"))
    trustme.CA().cert_pem.write_to_path(str(d / "other-ca.pem"))
    return d / "ca.pem", d / "cert.pem", d / "key.pem", d / "other-ca.pem"


def _service(torch_engine, device_model_dir) -> CloudService:
    llm = AsyncLLMEngine(LLMEngine(torch_engine, kv_cache_bytes=16 << 20))
    return CloudService(torch_engine, torch_engine.fingerprint, auth_token=TOKEN, device_model_dir=device_model_dir,
                        llm=llm, model_name=MODEL)


@pytest.fixture(scope="module")
def plain(torch_engine, device_model_dir):
    with ServiceThread(_service(torch_engine, device_model_dir)) as running:
        yield running


@pytest.fixture(scope="module")
def tls(torch_engine, device_model_dir, pki):
    _, cert, key, _ = pki
    with ServiceThread(_service(torch_engine, device_model_dir), ssl=server_context(cert, key)) as running:
        yield running


def _client(url, onnx_engine, **kw) -> Client:
    return CloudFirstClient(cloud_url=url, engine=onnx_engine, token=TOKEN, profile=SLOW_DEVICE, target_tpot_ms=30.0,
                  cloud_budget=BUDGET, connect_timeout_s=5.0, **kw)


def test_urls_name_the_scheme(plain, tls):
    assert plain.url.startswith("ws://127.0.0.1:") and plain.http_url.startswith("http://127.0.0.1:")
    assert tls.url == f"wss://127.0.0.1:{tls.ws_port}" and tls.http_url == f"https://127.0.0.1:{tls.http_port}"


def test_split_over_wss_equals_ws(plain, tls, onnx_engine, chat_prompt_ids, pki):
    ca = pki[0]
    over_ws = _client(plain.url, onnx_engine)
    over_wss = _client(tls.url, onnx_engine, ca=ca)
    assert over_wss.ssl is not None and over_ws.ssl is None
    for ids in chat_prompt_ids[:2]:
        a = over_ws.complete(ids, max_new_tokens=MAX_NEW)
        b = over_wss.complete(ids, max_new_tokens=MAX_NEW)
        assert b.mode == "split" and b.fault is None and b.cloud_tokens > 0 and b.device_tokens > 0
        assert a.mode == "split" and b.token_ids == a.token_ids
    c = over_wss.complete(chat_prompt_ids[0], max_new_tokens=MAX_NEW, mode="cloud-only")
    assert c.mode == "cloud-only" and c.token_ids == over_ws.complete(chat_prompt_ids[0], max_new_tokens=MAX_NEW,
                                                                        mode="cloud-only").token_ids


@pytest.mark.parametrize("which", ["system CAs", "another CA"])
def test_unknown_certificate_falls_back_fast(tls, onnx_engine, chat_prompt_ids, pki, which):
    ca = None if which == "system CAs" else pki[3]
    c = _client(tls.url, onnx_engine, ca=ca)
    device_only = c.complete(chat_prompt_ids[0], max_new_tokens=MAX_NEW, mode="device-only")
    res = c.complete(chat_prompt_ids[0], max_new_tokens=MAX_NEW)  # the handshake fails: no wait for a timeout
    assert res.mode == "device-only" and res.fault == "cloud-unreachable"
    assert "CERTIFICATE_VERIFY_FAILED" in res.error and "SSLCertVerificationError" in res.error
    assert res.token_ids == device_only.token_ids
    with pytest.raises(ssl.SSLCertVerificationError):
        c.complete(chat_prompt_ids[0], max_new_tokens=4, mode="cloud-only")


def test_verify_false_connects_with_a_warning(tls, onnx_engine, chat_prompt_ids, caplog):
    caplog.set_level(logging.WARNING, logger="relayinfer.security")
    c = _client(tls.url, onnx_engine, verify=False)
    assert any("verification is OFF" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    res = c.complete(chat_prompt_ids[1], max_new_tokens=MAX_NEW, mode="cloud-only")
    assert res.mode == "cloud-only" and len(res.token_ids) > 0


def test_plain_client_on_the_tls_port_is_refused(tls, onnx_engine, chat_prompt_ids):
    res = _client(tls.url.replace("wss://", "ws://"), onnx_engine).complete(chat_prompt_ids[0], max_new_tokens=4)
    assert res.mode == "device-only" and res.fault == "cloud-unreachable"


def test_device_model_download_over_https(tls, pki, tmp_path, device_model_dir):
    from relayinfer.device.fetch import download_device_model
    from relayinfer.device.onnx_engine import OnnxEngine

    ca = pki[0]
    with pytest.raises(urllib.error.URLError) as e:
        download_device_model(tls.http_url, tmp_path / "no", token=TOKEN, files=("config.json",), timeout_s=30)
    assert isinstance(e.value.reason, ssl.SSLCertVerificationError)
    d = download_device_model(tls.http_url, tmp_path / "dl", token=TOKEN, ca=ca, timeout_s=120)
    manifest = json.loads((device_model_dir / "manifest.json").read_text())["files"]
    assert json.loads((d / "manifest.json").read_text())["files"] == manifest
    assert OnnxEngine(d).fingerprint == tls.fingerprint


def test_openai_client_over_https(tls, pki):
    ca = pki[0]

    async def main():
        good = openai.AsyncOpenAI(base_url=f"{tls.http_url}/v1", api_key=TOKEN, max_retries=0, timeout=60,
                                  http_client=openai.DefaultAsyncHttpx2Client(
                                      verify=ssl.create_default_context(cafile=str(ca))))
        bad = openai.AsyncOpenAI(base_url=f"{tls.http_url}/v1", api_key=TOKEN, max_retries=0, timeout=60)
        try:
            r = await good.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                                   max_tokens=3, temperature=0)
            with pytest.raises(openai.APIConnectionError):
                await bad.models.list()
            return r
        finally:
            await good.close()
            await bad.close()

    r = asyncio.run(main())
    assert r.usage.completion_tokens == 3


def test_start_refuses_bad_tls_arguments(torch_engine, pki, tmp_path):
    ca, cert, key, _ = pki
    svc = CloudService(torch_engine, torch_engine.fingerprint)
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate\n")
    other_key = tmp_path / "other-key.pem"
    trustme.CA().issue_cert("127.0.0.1").private_key_pem.write_to_path(str(other_key))
    for kw, msg in ((dict(keyfile=key), "keyfile given without certfile"),
                    (dict(certfile=cert, keyfile=key, ssl=server_context(cert, key)), "not both"),
                    (dict(certfile=bad, keyfile=key), "not a PEM certificate chain"),
                    (dict(certfile=cert, keyfile=tmp_path / "missing.pem"), "no such file"),
                    (dict(certfile=cert, keyfile=other_key), "does not match the certificate")):
        with pytest.raises(ValueError, match=msg):
            asyncio.run(svc.start(**kw))
    assert svc.ws_port is None  # nothing was bound
    with pytest.raises(ValueError, match="no such file"):
        client_context(tmp_path / "missing-ca.pem")


def test_cli_cloud_serve_checks_the_tls_files(pki, tmp_path):
    _, cert, key, _ = pki
    exe = [shutil.which("relayinfer") or f"{sys.prefix}/bin/relayinfer"]
    for args, msg in ((["--certfile", str(cert)], "--certfile and --keyfile go together"),
                      (["--keyfile", str(key)], "--certfile and --keyfile go together"),
                      (["--certfile", str(cert), "--keyfile", str(tmp_path / "nope.pem")], "no such file")):
        out = subprocess.run(exe + ["cloud", "serve", "--port", "0", "--http-port", "0", *args], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 2, out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and msg in lines[0]
