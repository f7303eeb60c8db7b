"""What a new user meets first: URL and port checks before any model loads, one rule for
empty input at every entry point, plain-words errors with the protocol code only in --json, planned
outcomes apart from faults, the export progress only when an export happens, the HTTP API without
`model`. CLI cases run in-process through typer's CliRunner."""
from __future__ import annotations

import json
import logging
import re
import socket
import time

import pytest
from typer.testing import CliRunner

from relayinfer.sdk.checks import check_cloud_url, check_ports_free
from relayinfer.protocol.validate import check_prompt_text
from relayinfer.protocol.model.decoding import SamplingParams, check_prompt
from relayinfer.protocol.model.errors import PromptTooLongError
from relayinfer.sdk.cli import app

runner = CliRunner(env={"COLUMNS": "200"})  # usage errors come in a rich box: keep each on one line


def run_cli(*args: str, input: str | None = None):
    return runner.invoke(app, list(args), input=input)


def one_line_error(res, *words: str) -> str:
    """Exit 2 and a single `error: ...` line on stderr holding every word (no traceback)."""
    assert res.exit_code == 2, (res.exit_code, res.stdout, res.stderr)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.output and "[bad_request]" not in res.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


@pytest.fixture
def no_model_loads(monkeypatch):
    """Loading a model (torch or ONNX) fails the test: the checks under test come before it."""
    from relayinfer.cloud.engine.torch_engine import TorchEngine
    from relayinfer.device.onnx_engine import OnnxEngine

    def refuse(*a, **k):
        pytest.fail("a model was loaded before the check")
    monkeypatch.setattr(TorchEngine, "__init__", refuse)
    monkeypatch.setattr(OnnxEngine, "__init__", refuse)


@pytest.fixture
def dead_port():
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- 1. cloud URLs ------------------------------------------------------------------------------

@pytest.mark.parametrize("url, words", [
    ("http://127.0.0.1:8766", ["HTTP URL", "websocket port", "8765"]),
    ("127.0.0.1:8765", ["ws://"]),
    ("ws://", ["no host"]),
    ("ws://127.0.0.1:99999", ["not a valid URL"]),
    ("ws://127.0.0.1:8765/v1", ["path"]),
    ("", ["empty"]),
])
def test_bad_cloud_url_is_refused_in_words(url, words):
    with pytest.raises(ValueError) as e:
        check_cloud_url(url)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_good_cloud_urls_pass():
    for url in ("ws://127.0.0.1:8765", "wss://cloud.example.com", "ws://[::1]:8765/", "WS://host:1"):
        assert check_cloud_url(url) == url


def test_client_checks_url_before_loading_the_model(no_model_loads):
    from relayinfer.sdk import Client

    with pytest.raises(ValueError, match="HTTP URL"):
        Client(cloud_url="http://127.0.0.1:8766", model="/nonexistent.gguf")  # the model path is never read


def test_chat_bad_url_exits_2_before_loading(no_model_loads):
    one_line_error(run_cli("chat", "--cloud", "http://127.0.0.1:8766", "--model", "/nonexistent.gguf"),
                   "--cloud", "websocket port")


def test_unreachable_cloud_is_announced_once(onnx_engine, dead_port, caplog):
    from relayinfer.sdk import Client

    url = f"ws://127.0.0.1:{dead_port}"
    c = Client(cloud_url=url, engine=onnx_engine, connect_timeout_s=2.0, cloud_budget=None)
    with caplog.at_level(logging.WARNING, logger="relayinfer.sdk"):
        reason = c.check_cloud()
        a = c.complete("Hi there!", max_new_tokens=2)
        b = c.complete("Hi again!", max_new_tokens=2)
    assert reason and ("Connect" in reason or "refused" in reason.lower()), reason
    assert a.mode == b.mode == "device-only" and a.fault == b.fault == "cloud-unreachable" and a.plan == "split"
    warnings = [r.getMessage() for r in caplog.records if r.name == "relayinfer.sdk"]
    assert warnings == [f"cloud unreachable at {url}: falling back to the device ({reason})"], warnings


def test_a_cloud_of_another_model_is_named_as_the_cause(onnx_engine, torch_engine, caplog):
    """A cloud serving another model refuses the session (fingerprint mismatch): the warning says
    refused, not unreachable, and tells to start the cloud with the same --model."""
    from relayinfer.cloud.serve.service import CloudService, ServiceThread
    from relayinfer.sdk import Client

    with ServiceThread(CloudService(torch_engine, "sha256:" + "0" * 64), http_port=None) as other:
        c = Client(cloud_url=other.url, engine=onnx_engine, cloud_budget=None)
        with caplog.at_level(logging.WARNING, logger="relayinfer.sdk"):
            res = c.complete("Hi there!", max_new_tokens=2)
        c.close()
    assert res.mode == "device-only" and res.fault == "cloud-refused", res
    warnings = [r.getMessage() for r in caplog.records if r.name == "relayinfer.sdk"]
    assert len(warnings) == 1 and warnings[0].startswith(f"cloud refused the session at {other.url}: falling back"), warnings
    assert "fingerprint" in warnings[0] and "start it with the same --model as this device" in warnings[0]


def test_chat_announces_unreachable_cloud_once(onnx_engine, dead_port, monkeypatch):
    import relayinfer.sdk.engines as engines

    monkeypatch.setattr(engines, "load_engine", lambda *a, **k: onnx_engine)  # the session's engine: no reload
    url = f"ws://127.0.0.1:{dead_port}"
    res = run_cli("chat", "--cloud", url, "--max-new-tokens", "2", input="Hello!\nAnd again?\n\n")
    assert res.exit_code == 0, res.output
    assert res.stderr.count(f"warning: cloud unreachable at {url}: falling back to the device (") == 1, res.stderr
    turns = [ln for ln in res.stderr.splitlines() if ln.startswith("[device-only")]
    assert len(turns) == 2 and all("; fault cloud-unreachable: " in t for t in turns), res.stderr
    assert "sampling: temperature 0.2, top_p 0.9" in res.stderr
    assert "> " not in res.stdout and res.stdout.strip(), res.stdout  # piped input: answers, no prompts


# --- 2. ports ----------------------------------------------------------------------------------

def test_busy_port_is_named_before_the_model_loads(monkeypatch, no_model_loads):
    import relayinfer.cloud.patho.encoder as patho_encoder

    import relayinfer.cloud.relay.server as relay_server

    monkeypatch.setattr(patho_encoder, "ViTEncoder", lambda *a, **k: pytest.fail("patho serve loaded its encoder"))
    monkeypatch.setattr(relay_server, "main", lambda *a, **k: pytest.fail("relay serve loaded its model"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ValueError, match=f"port {port} on 127.0.0.1 is already in use"):
            check_ports_free("127.0.0.1", [("--port", port)])
        # a missing model file would be the error if the model were looked at first
        one_line_error(run_cli("cloud", "serve", "--port", "0", "--http-port", str(port), "--model", "/nonexistent.gguf"),
                       f"port {port}", "--http-port", "already in use")
        one_line_error(run_cli("relay", "serve", "--port", str(port)), f"port {port}", "already in use")
        one_line_error(run_cli("patho", "serve", "--port", str(port)), f"port {port}", "already in use")
        # the same port twice is named as such even when that port is busy (checked before any bind)
        with pytest.raises(ValueError, match=f"--http-port {port} is the same port as --port"):
            check_ports_free("127.0.0.1", [("--port", port), ("--http-port", port)])
        one_line_error(run_cli("cloud", "serve", "--port", str(port), "--http-port", str(port)), "same port")
        with pytest.raises(ValueError, match="not an address"):
            check_ports_free("no-such-host.invalid", [("--port", port)])
    check_ports_free("127.0.0.1", [("--port", 0), ("--http-port", None)])  # free ports: nothing to check


# --- 6. plain-words errors -----------------------------------------------------------------------

def test_sampling_errors_name_field_value_and_range():
    cases = [(dict(max_new_tokens=-5), "max_new_tokens must be an integer in [1, 1048576], got -5"),
             (dict(temperature=-1.0), "temperature must be a number in [0, 2], got -1.0"),
             (dict(top_p=1.5), "top_p must be a number in [0, 1], got 1.5"),
             (dict(top_k=-2), "top_k must be an integer in [-1, 1048576], got -2")]
    for kw, msg in cases:
        with pytest.raises(ValueError) as e:
            SamplingParams(**kw)
        assert str(e.value) == msg and "SamplingParams(" not in str(e.value)


def test_too_many_new_tokens_is_not_called_a_long_prompt():
    with pytest.raises(PromptTooLongError) as e:
        check_prompt(33, 100_000, 8192)
    assert e.value.message == ("max_new_tokens 100000 is too large for this prompt: 33 prompt tokens + 100000 new "
                               "tokens exceed the context length of 8192 tokens; at most 8159 new tokens fit")
    with pytest.raises(PromptTooLongError, match="prompt too long: 9000 prompt tokens"):
        check_prompt(9000, 1, 8192)


def test_cli_range_errors_are_plain_and_early(no_model_loads):
    one_line_error(run_cli("generate", "--max-new-tokens", "-5", "hi"), "--max-new-tokens must be an integer in [1, 1048576], got -5")
    one_line_error(run_cli("demo", "--top-p", "1.5", "hi"), "--top-p must be a number in [0, 1], got 1.5")
    one_line_error(run_cli("chat", "--cloud", "ws://127.0.0.1:1", "--temperature", "-1"),
                   "--temperature must be a number in [0, 2], got -1.0")
    one_line_error(run_cli("cloud", "serve", "--port", "70000"), "--port 70000 is not a port number", "1..65535")
    one_line_error(run_cli("demo", "--profile", "fone", "hi"), "unknown device profile 'fone'", "phone")


def test_cli_errors_carry_the_protocol_code_only_in_json(device_model_dir):
    line = one_line_error(run_cli("generate", "--engine", "onnx", "--max-new-tokens", "100000", "hi"),
                          "--max-new-tokens 100000 is too large", "at most")
    assert "prompt_too_long" not in line
    res = run_cli("generate", "--engine", "onnx", "--json", "--max-new-tokens", "100000", "hi")
    assert res.exit_code == 2
    err = json.loads(res.stdout)["error"]
    assert err["code"] == "prompt_too_long" and err["message"].startswith("--max-new-tokens 100000 is too large")
    one_line_error(run_cli("generate", "--engine", "tpu", "hi"), "unknown engine 'tpu'", "torch, onnx")


# --- 7. empty input: one rule at every entry point -------------------------------------------

@pytest.mark.parametrize("prompt", ["", "   \n", [], [{"role": "user", "content": "  "}],
                                    [{"role": "system", "content": ""}, {"role": "user", "content": ""}]])
def test_empty_prompt_rule(prompt):
    with pytest.raises(ValueError, match="empty|none with text"):
        check_prompt_text(prompt)


def test_nonempty_prompts_pass_the_rule():
    for p in ["hi", [1, 2], [{"role": "user", "content": "hi"}],
              [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]]:
        check_prompt_text(p)


def test_empty_prompt_client_raises_at_the_call(onnx_engine):
    from relayinfer.sdk import Client

    c = Client(engine=onnx_engine)
    for p in ("", [], [{"role": "user", "content": " "}]):
        with pytest.raises(ValueError, match="empty|none with text"):
            c.generate(p)  # raised by generate itself, not later from the stream


def test_empty_prompt_cli_exits_2(no_model_loads):
    for args in (["generate", ""], ["generate", "--engine", "onnx", "  "], ["demo", ""]):
        one_line_error(run_cli(*args), "prompt is empty")  # refused before any model loads
    res = run_cli("demo", "--json", "")
    assert res.exit_code == 2 and json.loads(res.stdout)["error"]["message"].startswith("prompt is empty")


# --- 5. export progress only when an export happens -----------------------------------------

def test_export_is_silent_when_cached(device_model_dir):
    res = run_cli("export")
    assert res.exit_code == 0 and res.stdout.strip() == str(device_model_dir) and res.stderr == ""


def test_export_progress_when_it_happens(monkeypatch, tmp_path):
    import relayinfer.cloud.export as export

    def fake_export(model=None, quantize=None, progress=None):
        progress("loading model.gguf")
        time.sleep(0.6)
        progress("exporting to ONNX (about 65 s on 2 cores)")
        time.sleep(0.6)
        progress(f"device model ready in 1 s: {tmp_path}")
        return tmp_path

    monkeypatch.setattr(export, "device_model_ready", lambda *a: False)
    monkeypatch.setattr(export, "ensure_device_model", fake_export)
    res = run_cli("export")
    assert res.exit_code == 0 and res.stdout.strip() == str(tmp_path)
    assert re.search(rf"device model exported in \d+ s, cached in {re.escape(str(tmp_path))}", res.stderr), res.stderr
    assert "cli.py" not in res.stderr  # no log-location noise


# --- 4. the demo's default conversation and sampling ------------------------------------------

def test_demo_default_answer_is_long_and_not_repetitive(onnx_engine, tokenizer):
    from relayinfer.protocol.model.decoding import generate
    from relayinfer.sdk.cli import DEMO_CONVERSATION, DEMO_SAMPLING
    from relayinfer.sdk.datasets import chitchat_prompt

    ids = tokenizer.encode_chat(chitchat_prompt(**DEMO_CONVERSATION))
    out = generate(onnx_engine, ids, SamplingParams(max_new_tokens=64, **DEMO_SAMPLING))
    grams = [tuple(out.token_ids[i:i + 4]) for i in range(len(out.token_ids) - 3)]
    assert out.finish_reason == "length" and len(out.token_ids) == 64  # long enough for a hand-off
    assert len(set(grams)) / len(grams) > 0.9, tokenizer.decode(out.token_ids)  # old default, greedy: one sentence 8 times


# --- 7 and 8. the HTTP API: the same empty-input rule; `model` optional, the GGUF's name an alias --

@pytest.fixture(scope="module")
def http_cloud(torch_engine):
    from relayinfer.cloud.engine.llm_engine import AsyncLLMEngine, LLMEngine
    from relayinfer.cloud.serve.service import CloudService, ServiceThread

    svc = CloudService(torch_engine, torch_engine.fingerprint,
                       llm=AsyncLLMEngine(LLMEngine(torch_engine, kv_cache_bytes=16 << 20)))
    with ServiceThread(svc) as running:
        yield running


def post(base: str, path: str, body: dict) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_http_model_is_optional_and_the_gguf_name_is_an_alias(http_cloud, model_path):
    base, msgs = http_cloud.http_url, [{"role": "user", "content": "Hi!"}]
    for model in (None, "smollm2-135m-instruct", model_path.name, model_path.stem):
        body = {"messages": msgs, "max_tokens": 2, "temperature": 0, **({"model": model} if model else {})}
        status, res = post(base, "/v1/chat/completions", body)
        assert status == 200 and res["model"] == "smollm2-135m-instruct", (model, res)
        assert res["usage"]["completion_tokens"] >= 1
    status, res = post(base, "/v1/completions", {"prompt": "The sky is", "max_tokens": 2})
    assert status == 200 and res["choices"][0]["text"] is not None
    status, res = post(base, "/v1/chat/completions", {"model": "gpt-4", "messages": msgs})
    assert status == 404 and res["error"]["code"] == "model_not_found"
    assert model_path.name in res["error"]["message"] and "leave 'model' out" in res["error"]["message"]


def test_http_empty_input_follows_the_same_rule(http_cloud):
    base = http_cloud.http_url
    cases = [("/v1/chat/completions", {"messages": [{"role": "user", "content": "  "}]}, "none with text"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]},
              "none with text"),
             ("/v1/chat/completions", {"messages": []}, "messages is empty"),
             ("/v1/completions", {"prompt": " \n"}, "prompt is empty"),
             ("/v1/completions", {"prompt": ["fine", ""]}, "prompt[1] is empty")]
    for path, body, words in cases:
        status, res = post(base, path, body)
        assert status == 400 and words in res["error"]["message"], (body, res)


def test_kv_piece_size_below_one_token_is_named_by_its_flag():
    # one float16 token of SmolLM2's KV is 23,040 bytes: a 1 KiB piece cannot hold it (checked once the
    # model's shape is known, before any port is bound)
    res = run_cli("cloud", "serve", "--port", "0", "--http-port", "0", "--kv-piece-kib", "1")
    assert res.exit_code == 2, (res.exit_code, res.stderr)
    last = [ln for ln in res.stderr.splitlines() if ln.strip()][-1]
    assert last.startswith("error: --kv-piece-kib 1: kv_piece_bytes=1024") and "at least one token" in last, last
    assert "Traceback" not in res.output


def _cli_flags() -> set[str]:
    """Every option name of every `relayinfer` command (the relay sub-app included)."""
    import typer

    from relayinfer.sdk import cli, relay_cli

    names: set[str] = set()

    def walk(cmd):
        for p in cmd.params:  # typer's own click: options by their option strings
            names.update(o for o in getattr(p, "opts", []) + getattr(p, "secondary_opts", []) if o.startswith("--"))
        for sub in getattr(cmd, "commands", {}).values():
            walk(sub)

    walk(typer.main.get_command(cli.app))
    walk(typer.main.get_command(relay_cli.relay_app))
    return names | {"--help"}  # click's help option, on every command (not among the params)


def test_every_flag_a_message_names_exists():
    """Error hints and docstrings in the library name only flags that some command has (a hint that
    says `--mpp` where the flag is `--slide-mpp` sends the user nowhere). Flags of other tools
    (pip's, llama.cpp's) are listed apart."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    other_tools = {"--no-deps",  # pip install --no-deps (the wheel hints)
                   "--head", "--address",  # ray start --head / --address (multi-node Ray)
                   "--tile", "--pyramid"}  # vips tiffsave --tile --pyramid (making a pyramidal TIFF)
    have = _cli_flags()
    files = [p for d in ("sdk", "cloud", "device", "protocol") for p in (root / d).rglob("*.py")]
    # the library's internal processes (python -m relayinfer.cloud.relay.server ...) parse their own flags
    have |= {f for p in files + list((root / "bench").glob("*.py"))  # and the bench scripts theirs
             for f in re.findall(r"add_argument\(\s*\"(--[a-z][a-z0-9-]+)\"", p.read_text())}
    missing = {}
    for p in files:
        for m in re.finditer(r"(?<![\w-])--[a-z][a-z0-9-]+", p.read_text()):
            if m.group(0) not in have | other_tools:
                missing.setdefault(m.group(0), str(p.relative_to(root)))
    assert not missing, missing


def _flags_of(*commands) -> set[str]:
    """The option names of these click commands and their sub-commands."""
    names: set[str] = set()
    todo = list(commands)
    while todo:
        cmd = todo.pop()
        for p in cmd.params:
            names.update(o for o in getattr(p, "opts", []) + getattr(p, "secondary_opts", []) if o.startswith("--"))
        todo += getattr(cmd, "commands", {}).values()
    return names


def test_relay_and_patho_hints_name_flags_of_their_own_commands():
    """Stricter for the GR relay and the pathology code: a flag named in sdk/relay_cli.py or
    cloud/relay/ is an option of `relayinfer relay ...`, one named in sdk/patho_cli.py or
    cloud/patho/ an option of `relayinfer patho ...` / `bench patho` (not just of some command or
    of an internal process: `--checkpoint` on a hint must be a flag the user can type). The instance
    process (cloud/relay/server.py) and the code that builds its command line (instance_proc.py)
    name that process's own flags."""
    import re
    from pathlib import Path

    import typer

    from relayinfer.sdk import cli, patho_cli, relay_cli

    root = Path(__file__).resolve().parents[1]
    relay = _flags_of(typer.main.get_command(relay_cli.relay_app))
    patho = _flags_of(typer.main.get_command(patho_cli.patho_app), typer.main.get_command(cli.bench_app).commands["patho"])
    assert {"--checkpoint", "--token", "--out", "--shape"} <= relay and {"--cloud", "--slide-mpp", "--out"} <= patho
    server = set(re.findall(r"add_argument\(\s*\"(--[a-z][a-z0-9-]+)\"", (root / "cloud/relay/server.py").read_text()))
    internal = {"cloud/relay/server.py", "cloud/relay/instance_proc.py"}
    pip = {"--no-deps"}  # pip install --no-deps (the wheel hints)
    groups = {"relay": (["sdk/relay_cli.py", *sorted(str(p.relative_to(root)) for p in (root / "cloud/relay").glob("*.py"))],
                        relay),
              "patho": (["sdk/patho_cli.py", *sorted(str(p.relative_to(root)) for p in (root / "cloud/patho").glob("*.py"))],
                        patho)}
    missing, seen = {}, 0
    for files, have in groups.values():
        assert len(files) > 5, files
        for f in files:
            allowed = have | pip | (server if f in internal else set())
            for m in re.finditer(r"(?<![\w-])--[a-z][a-z0-9-]+", (root / f).read_text()):
                seen += 1
                if m.group(0) not in allowed:
                    missing.setdefault(m.group(0), f)
    assert seen > 50, f"only {seen} flag names found: the pattern or the files changed"
    assert not missing, missing


@pytest.mark.parametrize("bad", ["", "nope", "GGUF-Q8"])
def test_a_bad_quantize_is_refused_by_name(bad):
    """`quantize` is checked before anything loads, in the SDK (naming the parameter) and the CLI
    (exit 2); an empty one is refused, not taken for the default."""
    from relayinfer.sdk import Client

    with pytest.raises(ValueError, match="quantize: unknown device weights"):
        Client(cloud_url="ws://127.0.0.1:1", quantize=bad)
    for cmd in (["demo"], ["export"], ["generate", "--engine", "onnx", "hi"], ["chat"]):
        res = run_cli(*cmd, "--quantize", bad)
        assert res.exit_code == 2 and "--quantize: unknown device weights" in res.stderr, (cmd, res.output)


def test_console_script_usage_errors_are_one_line_or_one_json_object():
    """Run as a program, a usage error (an unknown option, a value out of range, a value of the wrong
    type) is one line on stderr naming it, or with --json one object on stdout; exit 2, and nothing
    loads first (each call returns within seconds)."""
    import shutil
    import subprocess
    import sys

    exe = shutil.which("relayinfer") or f"{sys.prefix}/bin/relayinfer"

    def run(*argv):
        return subprocess.run([exe, *argv], capture_output=True, text=True, timeout=60)

    out = run("demo", "--max-new-tokens", "0")
    assert out.returncode == 2 and out.stdout == "", out
    assert out.stderr.strip().splitlines() == [
        "error: Invalid value for '--max-new-tokens': Input should be greater than or equal to 1 "
        "(see relayinfer demo --help)"], out.stderr
    out = run("demo", "--no-such-flag", "--json")
    assert out.returncode == 2 and out.stderr == "", out
    assert json.loads(out.stdout) == {"error": {"message": "No such option: --no-such-flag", "code": "bad_request",
                                                "type": "NoSuchOption"}}
    out = run("cloud", "serve", "--port", "abc")
    assert out.returncode == 2 and "'--port'" in out.stderr and "relayinfer cloud serve --help" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    # the same for every command that runs until a duration or a count: a negative one is refused,
    # and the forwarded `relay` sub-commands answer in the same one line
    for argv, flag in ((("pd", "serve", "--duration-s", "-1"), "--duration-s"),
                       (("patho", "serve", "--duration-s", "-1"), "--duration-s"),
                       (("relay", "train", "--steps", "0"), "--steps")):
        out = run(*argv)
        assert out.returncode == 2 and out.stdout == "", (argv, out)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: Invalid value for '{flag}'"), (argv, out.stderr)
        assert f"(see relayinfer {' '.join(argv[:2])} --help)" in lines[0], lines[0]
    assert run("--help").returncode == 0
