"""The TypeScript device client (clients/js, npm `relayinfer-device`) against a real Python cloud on
loopback: the tokenizer, greedy and seeded sampled answers equal to the Python device's token for
token (device-only and split), a split run that hands off, a cloud stopped mid-answer, and the
sampling settings the JS device does not apply refused by name. Skipped without `node` or `clients/js/node_modules`
(run `npm ci` in clients/js)."""
from __future__ import annotations

import json
import os
import selectors
import shutil
import subprocess
import time
from pathlib import Path

import pytest

JS = Path(__file__).resolve().parent.parent / "clients" / "js"
NODE = shutil.which("node")
pytestmark = [
    pytest.mark.skipif(NODE is None, reason="node is not installed (the JS client needs Node >= 20)"),
    pytest.mark.skipif(not (JS / "node_modules").is_dir(), reason="clients/js/node_modules is missing: run `npm ci` in clients/js"),
]

MAX_NEW = 24
BUDGET = 8


@pytest.fixture(scope="module")
def cli():
    """clients/js built (tsc) once; the path of its CLI."""
    subprocess.run([NODE, str(JS / "node_modules" / "typescript" / "bin" / "tsc"), "-p", str(JS)],
                   check=True, timeout=180, capture_output=True)
    return JS / "dist" / "src" / "cli.js"


@pytest.fixture(scope="module")
def prompts():
    from relayinfer.sdk.datasets import chitchat_prompt

    return [chitchat_prompt(i) for i in range(3)]


def _cloud(torch_engine, device_model_dir, step_delay_ms: float):
    from servers import split_cloud

    return split_cloud(torch_engine, device_model_dir, step_delay_ms)  # 127.0.0.1, free ports (never 8765)


@pytest.fixture(scope="module")
def cloud(torch_engine, device_model_dir):
    with _cloud(torch_engine, device_model_dir, 20.0) as running:
        yield running


@pytest.fixture(scope="module")
def js_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("js-cache")


@pytest.fixture(scope="module")
def reference(onnx_engine, tokenizer, prompts):
    """The Python device's greedy answers (device-only)."""
    from relayinfer.sdk import Client

    c = Client(engine=onnx_engine, mode="device-only")
    return [c.complete(tokenizer.encode_chat(p), max_new_tokens=MAX_NEW).token_ids for p in prompts]


def run_js(cli, tmp_path, prompts, *args, timeout_s: float = 240.0) -> list[dict]:
    f = tmp_path / f"prompts-{time.monotonic_ns()}.json"
    f.write_text(json.dumps(prompts))
    r = subprocess.run([NODE, str(cli), "--prompts", str(f), *map(str, args)], capture_output=True, text=True,
                       timeout=timeout_s)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(line) for line in r.stdout.splitlines() if line.strip()]


def test_js_fetches_model_and_tokenizes_as_python(cli, cloud, js_cache, tmp_path, tokenizer, prompts, torch_engine):
    """The JS client asks the cloud where its device model is (empty-fingerprint Hello), downloads and
    verifies it, and its tokenizer gives the Python tokenizer's prompt ids."""
    extra = ["Write a haiku about the sea.", "émoji 🤖 <|im_end|> 12345  x\n\ny"]
    out = run_js(cli, tmp_path, prompts + extra, "--cloud", cloud.url, "--cache", js_cache, "--tokenize-only")
    assert [o["prompt_ids"] for o in out] == [tokenizer.encode_chat(p) for p in prompts + extra]
    manifest = json.loads(next(js_cache.rglob("manifest.json")).read_text())
    assert manifest["model_fingerprint"] == torch_engine.fingerprint


def test_js_greedy_equals_python_device(cli, cloud, js_cache, tmp_path, prompts, reference):
    """Device-only greedy answers of onnxruntime-node == the Python device's, token for token, and the
    split answers (cloud first, then the device) too."""
    dev = run_js(cli, tmp_path, prompts, "--cloud", cloud.url, "--cache", js_cache, "--mode", "device-only",
                 "--max-new", MAX_NEW, "--tpot", 1)
    assert [r["token_ids"] for r in dev] == reference
    assert all(r["mode"] == "device-only" and r["cloud_tokens"] == 0 for r in dev)
    split = run_js(cli, tmp_path, prompts, "--cloud", cloud.url, "--cache", js_cache, "--max-new", MAX_NEW,
                   "--tpot", 1, "--budget", BUDGET, "--prefill-ms-per-token", 40)
    assert [r["token_ids"] for r in split] == reference


def test_js_split_hands_off(cli, cloud, js_cache, tmp_path, prompts, reference):
    """A device slower at prefill than the cloud (100 ms a token: seconds for the prompt, so the cloud's
    first token comes first on a loaded machine too) gets the first tokens from the cloud and takes
    over: cloud_tokens > 0, device_tokens > 0, hand-off index = cloud tokens."""
    (r,) = run_js(cli, tmp_path, prompts[2:], "--cloud", cloud.url, "--cache", js_cache, "--max-new", MAX_NEW,
                  "--tpot", 1, "--budget", BUDGET, "--prefill-ms-per-token", 100)
    assert r["mode"] == "split" and r["fault"] is None, r
    assert r["cloud_tokens"] > 0 and r["device_tokens"] > 0
    assert r["handoff_index"] == r["cloud_tokens"] <= BUDGET
    assert r["token_ids"] == reference[2] and r["ttft_ms"] > 0
    print(f"split: handoff_index {r['handoff_index']}, cloud {r['cloud_tokens']}, device {r['device_tokens']}, "
          f"ttft {r['ttft_ms']:.0f} ms")


def test_js_cloud_killed_mid_answer(cli, torch_engine, device_model_dir, js_cache, tmp_path, prompts, reference):
    """The cloud stops while it streams the answer (no budget, a slow device still prefilling): the
    device finishes alone from the tokens it received, and the answer is still the greedy one."""
    f = tmp_path / "one.json"
    f.write_text(json.dumps(prompts[2:]))
    svc = _cloud(torch_engine, device_model_dir, 150.0)
    running = svc.__enter__()
    stopped = False
    proc = subprocess.Popen([NODE, str(cli), "--prompts", str(f), "--cloud", running.url, "--cache", str(js_cache),
                             "--max-new", str(MAX_NEW), "--tpot", "1", "--prefill-ms-per-token", "100", "--events"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        deadline, lines, cloud_seen = time.monotonic() + 120, [], 0
        while time.monotonic() < deadline:
            if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                break
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(json.loads(line))
            ev = lines[-1].get("event")
            if ev and ev["source"] == "cloud":
                cloud_seen += 1
                if cloud_seen == 2 and not stopped:  # mid-answer: stop the cloud (closes every session)
                    svc.__exit__(None, None, None)
                    stopped = True
            if "token_ids" in lines[-1]:
                break
        assert proc.wait(timeout=60) == 0, proc.stderr.read()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if not stopped:
            svc.__exit__(None, None, None)
    assert stopped, f"the cloud never streamed 2 tokens: {lines[-3:]}"
    r = lines[-1]
    assert r["fault"] == "connection-lost", r
    assert r["cloud_tokens"] >= 2 and r["device_tokens"] > 0
    assert r["token_ids"] == reference[2] and r["finish_reason"] in ("eos", "length")
    print(f"cloud stopped: cloud {r['cloud_tokens']}, device {r['device_tokens']}, fault {r['fault']}")


def test_js_refused_handshake_goes_device_only(cli, torch_engine, device_model_dir, tmp_path, prompts, reference):
    """A cloud that requires a token the device does not send refuses the Hello (unauthorized): the
    JS device answers alone (device-only, fault cloud-refused) with the same greedy answer."""
    from relayinfer.cloud.serve.service import CloudService, ServiceThread

    svc = CloudService(torch_engine, torch_engine.fingerprint, auth_token="s3cret", device_model_dir=device_model_dir)
    with ServiceThread(svc) as running:
        (r,) = run_js(cli, tmp_path, prompts[:1], "--cloud", running.url, "--model-dir", device_model_dir,
                      "--max-new", MAX_NEW, "--tpot", 1)
    assert r["mode"] == "device-only" and r["fault"] == "cloud-refused", r
    assert "unauthorized" in r["error"]
    assert r["cloud_tokens"] == 0 and r["token_ids"] == reference[0]


def test_js_unit_tests_pass(cli):
    """The client's own node:test suite (clients/js/test: every golden frame decodes to its JSON and
    re-encodes to its bytes, the handshake and request state machine against a scripted server)."""
    r = subprocess.run([NODE, "--test", str(JS / "dist" / "test")], capture_output=True, text=True, timeout=180,
                       cwd=JS)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    passed = [int(line.split()[-1]) for line in r.stdout.splitlines() if line.startswith("# pass")]
    assert passed and passed[0] >= 40 and "# fail 0" in r.stdout


SEEDED = dict(temperature=0.8, top_p=0.9, top_k=40, seed=1234)
SEEDED_ARGS = ["--temperature", 0.8, "--top-p", 0.9, "--top-k", 40, "--seed", 1234]


@pytest.fixture(scope="module")
def seeded_reference(onnx_engine, tokenizer, prompts):
    """The Python device's seeded sampled answers (device-only, T 0.8, top_p 0.9, top_k 40, seed 1234)."""
    from relayinfer.sdk import Client

    c = Client(engine=onnx_engine, mode="device-only")
    return [c.complete(tokenizer.encode_chat(p), max_new_tokens=MAX_NEW, **SEEDED).token_ids for p in prompts]


def test_js_seeded_sampling_equals_python_device(cli, cloud, js_cache, tmp_path, prompts, seeded_reference, reference):
    """Seeded sampling (numpy's SeedSequence + PCG64 per answer position, decoding.sample's softmax,
    top-k, top-p in float64): the JS device-only answers == the Python device's token for token, and
    a split answer (the cloud's first tokens, then the JS device) continues them exactly."""
    assert seeded_reference != reference  # really sampled, not greedy
    dev = run_js(cli, tmp_path, prompts, "--cloud", cloud.url, "--cache", js_cache, "--mode", "device-only",
                 "--max-new", MAX_NEW, "--tpot", 1, *SEEDED_ARGS)
    assert [r["token_ids"] for r in dev] == seeded_reference
    split = run_js(cli, tmp_path, prompts, "--cloud", cloud.url, "--cache", js_cache, "--max-new", MAX_NEW,
                   "--tpot", 1, "--budget", BUDGET, "--prefill-ms-per-token", 40, *SEEDED_ARGS)
    assert [r["token_ids"] for r in split] == seeded_reference
    assert any(r["mode"] == "split" and r["cloud_tokens"] > 0 and r["device_tokens"] > 0 for r in split), split
    print("seeded split:", [(r["mode"], r["cloud_tokens"], r["device_tokens"]) for r in split])


@pytest.mark.parametrize("flag,value", [("--repetition-penalty", 1.1), ("--presence-penalty", 0.5),
                                        ("--frequency-penalty", 0.5), ("--min-tokens", 2),
                                        ("--logit-bias", "1:5"), ("--grammar", "a+")])
def test_js_refuses_settings_it_does_not_apply(cli, device_model_dir, tmp_path, prompts, flag, value):
    """Penalties, min_tokens, logit_bias and grammar are not applied by the JS device: asked for them,
    the CLI refuses by name instead of answering without them."""
    f = tmp_path / "p.json"
    f.write_text(json.dumps(prompts[:1]))
    r = subprocess.run([NODE, str(cli), "--prompts", str(f), "--model-dir", str(device_model_dir), "--max-new", "2",
                        flag, str(value)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and not r.stdout.strip()
    assert flag in r.stderr and "not supported" in r.stderr, r.stderr[-2000:]


@pytest.mark.slow  # ~100 s: thousands of draws; the golden vectors (npm test) and the seeded answers cover the rule
def test_js_sampler_on_real_logits(cli, onnx_engine, tokenizer, prompts, seeded_reference, tmp_path):
    """The JS sampler against decoding.sample on the device model's real logits (the 3 prompts' 72
    answer positions) for 3 settings x 40 seeds: how often the drawn token differs (Math.exp and
    glibc's exp differ in the last ulp for ~10% of arguments, which moves a draw only when the
    uniform lands within ~1e-16 of a CDF step). Asserted: none of the 8640 draws differ."""
    import numpy as np

    from relayinfer.protocol.model.decoding import SamplingParams, sample

    rows = []
    for p, ans in zip(prompts, seeded_reference):
        logits, kv = onnx_engine.prefill(tokenizer.encode_chat(p))
        for t in ans:
            rows.append(np.asarray(logits, dtype=np.float32))
            logits, kv = onnx_engine.decode(t, kv)
    lg = np.stack(rows)
    (tmp_path / "logits.bin").write_bytes(lg.tobytes())
    settings = [(0.8, 0.9, 40), (1.0, 1.0, 0), (0.7, 0.95, 0)]
    seeds = list(range(40))
    want = [[[sample(row, SamplingParams(temperature=t, top_p=tp, top_k=tk, seed=s), i % MAX_NEW) for s in seeds]
             for i, row in enumerate(lg)] for t, tp, tk in settings]
    script = f"""
import fs from "node:fs";
import {{ sampleToken }} from {json.dumps((cli.parent / "sampling.js").as_uri())};
const b = fs.readFileSync({json.dumps(str(tmp_path / "logits.bin"))});
const all = new Float32Array(b.buffer, b.byteOffset, b.length / 4), v = {lg.shape[1]};
const out = {json.dumps(settings)}.map(([t, tp, tk]) => Array.from({{ length: {lg.shape[0]} }}, (_, i) =>
  {json.dumps(seeds)}.map((s) => sampleToken(all.subarray(i * v, (i + 1) * v), {{ temperature: t, topP: tp, topK: tk, seed: s }}, i % {MAX_NEW}))));
process.stdout.write(JSON.stringify(out));
"""
    r = subprocess.run([NODE, "--input-type=module", "-e", script], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    total = sum(len(s) for st in want for s in st)
    diff = sum(a != b for gs, ws in zip(got, want) for g, w in zip(gs, ws) for a, b in zip(g, w))
    print(f"JS vs Python sampler on real logits: {diff} of {total} draws differ")
    assert total == 3 * lg.shape[0] * len(seeds) and diff == 0
