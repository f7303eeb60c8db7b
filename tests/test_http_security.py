"""One auth policy for both ports.

A real `CloudService` with `auth_token` set (batching engine, OpenAI API, exported device model) on
loopback: every HTTP route but `/healthz` answers 401 in OpenAI's error shape (with
`WWW-Authenticate: Bearer`) to a missing or wrong `Authorization: Bearer` token and serves the
right one; `/healthz` tells anyone only that it is alive; `/metrics` opens with `metrics_public`;
the websocket Hello, the device-model download and the `openai` client follow the same token.
"""
from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest

from relayinfer.cloud.engine.llm_engine import AsyncLLMEngine, LLMEngine
from relayinfer.cloud.serve.service import CloudService, ServiceThread
from relayinfer.protocol.transport import ws as proto_ws
from relayinfer.protocol.errors import ErrorCode, RemoteError
from relayinfer.protocol.transport.security import bearer_token, token_matches

openai = pytest.importorskip("openai")

TOKEN = "s3cret-token-for-tests"
MODEL = "smollm2-135m-instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2, "temperature": 0}
COMP = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}
# route, method, body, status with the right token
ROUTES = [
    ("/metrics", "GET", None, 200),
    ("/v1/device-model/manifest", "GET", None, 200),
    ("/v1/device-model", "GET", None, 200),
    ("/v1/device-model/config.json", "GET", None, 200),
    ("/v1/models", "GET", None, 200),
    ("/v1/chat/completions", "POST", CHAT, 200),
    ("/v1/completions", "POST", COMP, 200),
    ("/v1/no-such-route", "GET", None, 404),
]
AUTH = {"none": None, "wrong": f"Bearer {TOKEN}x", "right": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def cloud(torch_engine, device_model_dir):
    llm = AsyncLLMEngine(LLMEngine(torch_engine, kv_cache_bytes=16 << 20))
    svc = CloudService(torch_engine, torch_engine.fingerprint, auth_token=TOKEN, device_model_dir=device_model_dir,
                       llm=llm, model_name=MODEL)
    with ServiceThread(svc) as running:
        yield running


def call(svc, path: str, method: str = "GET", body: dict | None = None, authorization: str | None = None):
    """(status, headers, body bytes; the ONNX file is not read) of one request."""
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if authorization is not None:
        headers["Authorization"] = authorization
    req = urllib.request.Request(f"{svc.http_url}{path}", method=method, headers=headers,
                                 data=None if body is None else json.dumps(body).encode())
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers, b"" if path == "/v1/device-model" else r.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.headers, e.read()


@pytest.mark.parametrize("auth", list(AUTH))
@pytest.mark.parametrize("path,method,body,ok", ROUTES, ids=[r[0] for r in ROUTES])
def test_every_route_needs_the_token(cloud, path, method, body, ok, auth):
    status, headers, data = call(cloud, path, method, body, AUTH[auth])
    if auth != "right":
        assert status == 401
        assert headers["WWW-Authenticate"].startswith("Bearer")
        err = json.loads(data)["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == "invalid_api_key" and err["param"] is None
        assert err["message"] == ("Incorrect API key provided" if auth == "wrong" else
                                  "Missing API key: send the service token as 'Authorization: Bearer <token>'")
        assert set(json.loads(data)) == {"error"}
        return
    assert status == ok
    if path == "/metrics":
        assert b"relayinfer_engine_requests_total" in data and b"relayinfer_active_sessions" in data
    elif path == "/v1/device-model/manifest":
        assert "model.gguf.onnx" in json.loads(data)["files"]
    elif path == "/v1/device-model":
        assert len(headers["X-Content-SHA256"]) == 64
    elif path == "/v1/models":
        assert [m["id"] for m in json.loads(data)["data"]] == [MODEL]
    elif path.endswith("completions"):
        assert json.loads(data)["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("auth", list(AUTH))
def test_healthz_says_only_alive_without_the_token(cloud, auth):
    status, _, data = call(cloud, "/healthz", authorization=AUTH[auth])
    body = json.loads(data)
    assert status == 200 and body["status"] == "ok"
    if auth == "right":
        assert body["model_fingerprint"] == cloud.fingerprint and body["model"] == MODEL
        assert (body["device"], body["dtype"]) == ("cpu", "float32")
        assert body["engine"]["kv_blocks_total"] > 0 and body["engine"]["running"] == 0
    else:
        assert body == {"status": "ok"}


@pytest.mark.parametrize("authorization,ok", [
    (f"bearer {TOKEN}", True), (f"BEARER   {TOKEN}  ", True), (f"Basic {TOKEN}", False), (TOKEN, False),
    ("Bearer ", False), (f"Bearer {TOKEN[:-1]}", False), (f"Bearer {TOKEN} extra", False)])
def test_authorization_header_forms(cloud, authorization, ok):
    status, _, _ = call(cloud, "/v1/models", authorization=authorization)
    assert status == (200 if ok else 401)


def test_token_helpers():
    assert bearer_token("Bearer abc") == "abc" and bearer_token("bearer  abc ") == "abc"
    assert bearer_token(None) is None and bearer_token("Basic abc") is None and bearer_token("Bearer") is None
    assert token_matches("abc", "abc") and not token_matches("abd", "abc") and not token_matches(None, "abc")
    assert not token_matches("ab", "abc") and token_matches("é", "é")


def test_metrics_public(torch_engine):
    svc = CloudService(torch_engine, torch_engine.fingerprint, auth_token=TOKEN, metrics_public=True)
    with ServiceThread(svc) as running:
        status, _, data = call(running, "/metrics")
        assert status == 200 and b"relayinfer_active_sessions" in data
        assert call(running, "/v1/device-model/manifest")[0] == 401
        assert json.loads(call(running, "/healthz")[2]) == {"status": "ok"}


def test_websocket_uses_the_same_token(cloud):
    async def main():
        out = {}
        for name, tok in (("none", None), ("wrong", TOKEN + "x")):
            with pytest.raises(RemoteError) as e:
                await proto_ws.open_channel(cloud.url, cloud.fingerprint, tok, open_timeout=10)
            out[name] = e.value.code
        ch = await proto_ws.open_channel(cloud.url, cloud.fingerprint, TOKEN, open_timeout=10)
        out["right"] = ch.welcome is not None
        await ch.close()
        return out

    out = asyncio.run(main())
    assert out == {"none": ErrorCode.UNAUTHORIZED, "wrong": ErrorCode.UNAUTHORIZED, "right": True}


def test_device_model_download_sends_the_token(cloud, tmp_path, device_model_dir):
    from relayinfer.device.fetch import download_device_model

    small = ("config.json", "tokenizer_meta.json")
    for tok in (None, TOKEN + "x"):
        with pytest.raises(RemoteError) as e:
            download_device_model(cloud.http_url, tmp_path / "dl", files=small, token=tok, timeout_s=30)
        assert e.value.code == ErrorCode.UNAUTHORIZED and "HTTP 401" in e.value.message
    d = download_device_model(cloud.http_url, tmp_path / "dl", files=small, token=TOKEN, timeout_s=30)
    for name in small:
        assert (d / name).read_bytes() == (device_model_dir / name).read_bytes()


def test_openai_client_needs_the_key(cloud):
    async def main():
        base = f"{cloud.http_url}/v1"
        bad = openai.AsyncOpenAI(base_url=base, api_key=TOKEN + "x", max_retries=0, timeout=60)
        good = openai.AsyncOpenAI(base_url=base, api_key=TOKEN, max_retries=0, timeout=60)
        try:
            with pytest.raises(openai.AuthenticationError) as e:
                await bad.chat.completions.create(**CHAT)
            with pytest.raises(openai.AuthenticationError):
                await bad.models.list()
            r = await good.chat.completions.create(**CHAT)
            return e.value, r
        finally:
            await bad.close()
            await good.close()

    err, r = asyncio.run(main())
    assert err.status_code == 401 and err.body["code"] == "invalid_api_key"
    assert r.usage.completion_tokens == 2 and r.choices[0].message.content is not None
