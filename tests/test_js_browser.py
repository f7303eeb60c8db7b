"""The browser build of the TypeScript device client (clients/js/web: onnxruntime-web WASM, the
page's WebSocket, Cache Storage) on the demo page `cloud serve --web` serves, in headless Chromium
driven by puppeteer-core: one chitchat prompt through the chat box, a split answer (a slow-device
profile and a cloud budget make the hand-off deterministic) equal to the Python device-only greedy
answer token for token. Skipped without node, clients/js/node_modules, the built page
(`npm run build:web` in clients/js) or /usr/bin/chromium. RELAYINFER_SCREENSHOT=1 rewrites the
committed clients/js/web/screenshot.png.
RELAYINFER_BROWSER_BENCH=1 also prints the page's decode tok/s (128 tokens x 3, as bench/decode.ts; the
figures kept are in clients/js/bench/result-browser.json)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from urllib.parse import urlencode

import pytest

JS = Path(__file__).resolve().parent.parent / "clients" / "js"
WEB = JS / "web" / "dist"
NODE = shutil.which("node")
CHROMIUM = "/usr/bin/chromium"
pytestmark = [
    pytest.mark.skipif(NODE is None, reason="node is not installed (the JS client needs Node >= 20)"),
    pytest.mark.skipif(not (JS / "node_modules" / "puppeteer-core").is_dir(),
                       reason="clients/js/node_modules (with puppeteer-core) is missing: run `npm ci` in clients/js"),
    pytest.mark.skipif(not (WEB / "app.js").is_file(),
                       reason="the page is not built: run `npm run build:web` in clients/js (writes clients/js/web/dist)"),
    pytest.mark.skipif(not os.access(CHROMIUM, os.X_OK), reason=f"{CHROMIUM} is missing (Debian's chromium package)"),
]

MAX_NEW = 24
BUDGET = 8
# The page's slow-device profile: prefill at 100 ms a token (a ~48-token prompt: ~5 s), so the cloud
# streams first even on a loaded 2-core machine. A device whose prefill ends before the cloud's first
# token answers alone (device-only, hand-off 0): right for the client, not what this test is about.
PACE_MS = 100


@pytest.fixture(scope="module")
def cloud(torch_engine, device_model_dir):
    from relayinfer.cloud.serve.service import CloudService, ServiceThread

    svc = CloudService(torch_engine, torch_engine.fingerprint, device_model_dir=device_model_dir, step_delay_ms=20.0,
                       max_frame_bytes=1 << 20)
    svc.http.web_dir = WEB  # as `cloud serve --web`
    with ServiceThread(svc) as running:  # 127.0.0.1, free ports (never 8765)
        from relayinfer.sdk import Client

        # the engine's first request (cold caches, lazy allocations) is not the page's
        warm = Client(cloud_url=running.url).complete([1, 9690, 198, 19556], max_new_tokens=2, mode="cloud-only")
        assert warm.fault is None and len(warm.token_ids) == 2, warm
        yield running


@pytest.fixture(scope="module")
def fp32_engine(model_path, device_model_dir):
    """The Python device on model.fp32.onnx, the file the page runs on WASM (MatMulNBits, the
    default file's kernel, is ~8x slower there; see clients/js/web/src/client.ts)."""
    from relayinfer.cloud.export import ensure_device_model
    from relayinfer.device.onnx_engine import OnnxEngine

    assert ensure_device_model(model_path, "fp32") == device_model_dir
    return OnnxEngine(device_model_dir, quantize="fp32", threads=1)


def test_browser_page_split_equals_python_device(cloud, fp32_engine, onnx_engine, tokenizer, tmp_path):
    """The page loads the cloud's device model into onnxruntime-web, the prompt typed in the chat box
    gets cloud tokens, then device tokens (hand-off at the cloud's count), and the answer equals the
    Python device's device-only greedy answer on the same ONNX file; the page shows both kinds of
    token."""
    from relayinfer.sdk import Client
    from relayinfer.sdk.datasets import chitchat_prompt

    messages = chitchat_prompt(2)  # one user turn, typed into the chat box
    assert len(messages) == 1 and messages[0]["role"] == "user"
    prompt = messages[0]["content"]
    ids = tokenizer.encode_chat(messages)
    reference = Client(engine=fp32_engine, mode="device-only").complete(ids, max_new_tokens=MAX_NEW).token_ids
    default_file = Client(engine=onnx_engine, mode="device-only").complete(ids, max_new_tokens=MAX_NEW).token_ids
    q = urlencode({"mode": "split", "max": MAX_NEW, "budget": BUDGET, "pace": PACE_MS, "tpot": 1})
    url = f"{cloud.http_url}/web/?{q}"
    # the committed clients/js/web/screenshot.png is rewritten only on request (a test leaves the tree clean)
    shot = JS / "web" / "screenshot.png" if os.environ.get("RELAYINFER_SCREENSHOT") == "1" else tmp_path / "page.png"
    args = [NODE, str(JS / "web" / "drive.mjs"), "--url", url, "--prompt", prompt, "--screenshot", str(shot),
            "--chromium", CHROMIUM, "--timeout-ms", "200000"]
    bench = os.environ.get("RELAYINFER_BROWSER_BENCH") == "1"
    if bench:
        args += ["--bench", "128"]
    t0 = time.monotonic()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=JS,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=300 if bench else 240)  # page boot: 27-32 s loaded, 99 s in the suite beside two busy processes
    finally:
        if proc.poll() is None:  # the driver and its chromium
            os.killpg(proc.pid, 9)
            proc.wait(10)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    assert lines, f"no answer from the page driver (rc {proc.returncode}): {err[-3000:]}"
    o = json.loads(lines[-1])
    assert proc.returncode == 0 and not o.get("error"), o
    r = o["result"]
    print(f"browser: ready in {o['boot']['ready_ms']} ms (session {o['boot']['load_ms']:.0f} ms, "
          f"{o['boot']['threads']} thread), {r['mode']}: hand-off {r['handoff_index']}, cloud {r['cloud_tokens']}, "
          f"device {r['device_tokens']}, ttft {r['ttft_ms']:.0f} ms, {time.monotonic() - t0:.1f} s in all")
    print(f"the page ran {o['boot']['onnx']}; Python device-only answers on it and on the default file "
          f"{'agree' if reference == default_file else 'differ'}")
    assert o["boot"]["fingerprint"] == cloud.fingerprint and o["boot"]["onnx"] == "model.fp32.onnx"
    assert r["token_ids"] == reference and o["token_ids_attr"] == reference
    assert r["fault"] is None, f"fault {r['fault']}: {r['error']}"
    assert r["mode"] == "split", r
    assert r["cloud_tokens"] > 0 and r["device_tokens"] > 0
    assert r["handoff_index"] == r["cloud_tokens"] <= BUDGET
    assert o["spans"] == {"cloud": r["cloud_tokens"], "device": r["device_tokens"]}
    assert shot.is_file() and shot.stat().st_size > 10_000
    if bench:
        b = o["bench"]
        print(f"browser decode: {b['tok_s_median']:.1f} tok/s median of {b['tok_s']} ({b['tokens']} tokens, "
              f"{b['threads']} thread, {b['onnx']})")
