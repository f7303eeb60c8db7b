"""The same OpenAI-API chat workload against `relayinfer cloud serve` and llama.cpp's `llama-server`.

N concurrent streaming `/v1/chat/completions` requests (a closed loop: each of N workers sends its
next request when its previous one ends) built from real conversations (chitchat-dataset, cut after
a user turn, prompts of at most `--max-prompt` tokens), greedy (temperature 0), a fixed answer
length through `ignore_eos` (both servers implement vLLM's field) and `max_tokens` 96, at N = 1, 4,
16, 64. Servers:

  * `relayinfer` - `relayinfer cloud serve` (torch engine, fp32 weights dequantized from the GGUF,
    continuous batching over a paged KV cache);
  * `relayinfer-bf16` - the same with `--dtype bfloat16` (weights and KV cache in bfloat16: oneDNN's
    AMX / AVX512-BF16 kernels where the CPU has them; its closeness to fp32 is bench/fidelity.py's
    `torch-bf16` row);
  * `relayinfer-gguf` - the same with `--weights gguf` (the file's Q4_1 layers run on their blocks,
    torch's int4 kernel, bf16 activations into those matmuls; fp32 KV cache and head; its closeness
    to fp32 is bench/fidelity.py's `torch-gguf` row);
  * `llama-f32`  - `llama-server` on an F32 GGUF made from the shipped file by
    `llama-quantize --allow-requantize ... F32` (the same fp32 arithmetic as relayinfer);
  * `llama-q4_1` - `llama-server` on the shipped Q4_1 GGUF.

Each server gets the same intra-op thread count (`--threads`) and runs pinned to the same cores
(`--server-cpus`); the client runs on the other cores (`--client-cpus`). llama-server gets what a
CPU user would pick for N concurrent users: `-np N` slots, `--threads T --threads-batch T`,
continuous batching on (`-cb`), a context of N x `--slot-ctx` tokens. It is restarted per N (its
slot count is fixed at start); relayinfer runs once for all N (it has no slot count).

Per server and N: output tokens/s (completion tokens / wall seconds of the level), TTFT (send to
first non-empty streamed content delta, ms) p50/p99 and TPOT ((last delta - first delta) / (tokens - 1), ms)
p50/p99. Each level sends `--requests` requests (default `--waves` x N, at least 2; N at 64) and stops sending
after `--level-budget-s`; a request still running at 2 x budget is cancelled and counted as such.
The levels of all servers run back to back per N, so their ratios are paired within one run.

    bench/llamacpp.sh                                  # builds llama-server (not a default dependency)
    .venv/bin/python bench/serve_compare.py            # full run -> bench/results/serve_compare.{json,md}
    .venv/bin/python bench/serve_compare.py --quick    # N = 1, 4; 2 requests each; writes under /tmp

Exit status 2 with a message on bad arguments or when llama.cpp is not built.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NoReturn

from machine import cpu_isa, cpu_name  # bench/machine.py, beside this script

ROOT = Path(__file__).resolve().parent
REPO = ROOT.parent
SERVERS = ("relayinfer", "relayinfer-bf16", "relayinfer-gguf", "llama-f32", "llama-q4_1")
OURS = ("relayinfer", "relayinfer-bf16", "relayinfer-gguf")
BASELINES = ("llama-f32", "llama-q4_1")
WEIGHTS = {"relayinfer": "fp32 (GGUF dequantized)", "relayinfer-bf16": "bf16 (GGUF dequantized)",
           "relayinfer-gguf": "Q4_1 blocks (torch int4), fp32 head",
           "llama-f32": "F32 GGUF", "llama-q4_1": "Q4_1 GGUF"}


def _die(msg: str) -> NoReturn:
    print(f"serve_compare: {msg}", file=sys.stderr)
    raise SystemExit(2)


# --- inputs ----------------------------------------------------------------------------------

def workload(tokenizer, count: int, max_prompt: int, seed: int = 0) -> list[list[dict]]:
    """`count` chat conversations (lists of {role, content}) from chitchat-dataset whose templated
    prompt is at most `max_prompt` tokens (a conversation that is longer loses turns from the front,
    keeping it ending on a user turn). Deterministic for a `seed`."""
    from relayinfer.sdk.datasets import chitchat_prompt
    out, i = [], 0
    while len(out) < count:
        msgs = chitchat_prompt(seed * 100003 + i, max_turns=6)
        i += 1
        while msgs and len(tokenizer.encode_chat(msgs)) > max_prompt:
            msgs = msgs[1:]
            while msgs and msgs[0]["role"] != "user":
                msgs = msgs[1:]
        if msgs:
            out.append(msgs)
        if i > 50 * count + 1000:
            raise RuntimeError(f"chitchat-dataset has too few conversations under {max_prompt} tokens")
    return out


def f32_gguf(q_path: Path, bindir: Path, log) -> Path:
    """The F32 GGUF made from `q_path` with `llama-quantize --allow-requantize <q> <out> F32`, cached
    under build/llamacpp/models/ (re-made when missing). Returns its path."""
    out = REPO / "build" / "llamacpp" / "models" / (q_path.stem.rsplit(".", 1)[0] + ".F32.gguf")
    if out.is_file() and out.stat().st_size > 0:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".part")
    log(f"making {out.name} from {q_path.name}")
    subprocess.run([str(bindir / "llama-quantize"), "--allow-requantize", str(q_path), str(tmp), "F32"],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=600)
    tmp.rename(out)
    return out


# --- servers ---------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server process on 127.0.0.1, started pinned to `cpus`, stopped by `stop()` (SIGTERM, then
    SIGKILL after 10 s) and by itself after `lifetime_s` (relayinfer: --duration-s; llama-server: the
    bench kills it). `base`: its http://127.0.0.1:port."""

    def __init__(self, name: str, argv: list[str], port: int, health: str, cpus: set[int], log_path: Path,
                 env: dict | None = None):
        self.name, self.argv, self.port, self.health, self.cpus = name, argv, port, health, cpus
        self.base = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO,
                                     env={**os.environ, **(env or {})}, start_new_session=True,
                                     preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        """Poll the health path until 200; raises RuntimeError with the log tail if the process
        exits or `timeout_s` passes."""
        import urllib.error
        import urllib.request
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(self.base + self.health, timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        tail = self.log_path.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{self.name} did not become ready in {timeout_s:.0f} s "
                           f"(exit {self.proc.returncode}):\n{tail}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


def start_relayinfer(name: str, threads: int, cpus: set[int], kv_mb: int, lifetime_s: float, logdir: Path) -> Server:
    """`relayinfer cloud serve` as server `name` of `OURS` (-bf16: `--dtype bfloat16`; -gguf: `--weights gguf`)."""
    port = free_port()
    argv = [str(REPO / ".venv" / "bin" / "relayinfer"), "cloud", "serve", "--host", "127.0.0.1", "--port", "0",
            "--http-port", str(port), "--threads", str(threads), "--kv-cache-mb", str(kv_mb),
            "--duration-s", str(int(lifetime_s)), "--device", "cpu",
            "--dtype", "bfloat16" if name.endswith("-bf16") else "float32",
            "--weights", "gguf" if name.endswith("-gguf") else "fp32"]
    return Server(name, argv, port, "/healthz", cpus, logdir / f"{name}.log",
                  env={"OMP_NUM_THREADS": str(threads)})


def start_llama(name: str, bindir: Path, model: Path, n: int, threads: int, slot_ctx: int, cpus: set[int],
                logdir: Path) -> Server:
    port = free_port()
    argv = [str(bindir / "llama-server"), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(n), "-c", str(n * slot_ctx), "--threads", str(threads), "--threads-batch", str(threads),
            "-cb", "--no-webui", "--alias", "smollm2"]
    return Server(name, argv, port, "/health", cpus, logdir / f"{name}-{n}.log")


# --- client ----------------------------------------------------------------------------------

async def one_request(session, base: str, messages: list[dict], max_tokens: int, timeout_s: float) -> dict:
    """One streaming chat request; returns {ttft_ms, tpot_ms, tokens, error}. Tokens: the final
    chunk's usage.completion_tokens when the server sends it, else the content deltas counted."""
    import aiohttp
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    deltas = 0
    usage = None
    try:
        async with session.post(base + "/v1/chat/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status != 200:
                return {"error": f"HTTP {r.status}: {(await r.text())[:300]}"}
            async for raw in r.content:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for ch in chunk.get("choices") or []:
                    if (ch.get("delta") or {}).get("content"):  # the role chunk's "" is no token
                        now = time.perf_counter()
                        first = first or now
                        last = now
                        deltas += 1
    except (asyncio.TimeoutError, aiohttp.ClientError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    tokens = int(usage["completion_tokens"]) if usage else deltas
    if first is None:
        return {"error": "no content streamed"}
    return {"ttft_ms": 1e3 * (first - t0), "tokens": tokens,
            "tpot_ms": 1e3 * (last - first) / (tokens - 1) if tokens > 1 else None, "deltas": deltas}


async def run_level(base: str, prompts: list[list[dict]], n: int, count: int, max_tokens: int,
                    budget_s: float) -> dict:
    """N workers in a closed loop over the first `count` prompts; no new request after `budget_s`,
    and requests still running at 2 x `budget_s` are cancelled. Returns the level's metrics."""
    import aiohttp
    queue = list(range(count))
    results: list[dict] = []
    t0 = time.perf_counter()

    async def worker(session):
        while queue and time.perf_counter() - t0 < budget_s:
            i = queue.pop(0)
            results.append(await one_request(session, base, prompts[i % len(prompts)], max_tokens, 2 * budget_s))

    # a fresh connection per request: llama-server closes idle keep-alive connections, and a pooled
    # connection it closed fails the next request ("Can not write request body")
    conn = aiohttp.TCPConnector(limit=n + 4, force_close=True)
    async with aiohttp.ClientSession(connector=conn) as session:
        tasks = [asyncio.create_task(worker(session)) for _ in range(n)]
        done, pending = await asyncio.wait(tasks, timeout=2 * budget_s + 5)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    ttft = [r["ttft_ms"] for r in ok]
    tpot = [r["tpot_ms"] for r in ok if r["tpot_ms"] is not None]
    toks = sum(r["tokens"] for r in ok)
    return {"concurrency": n, "sent": len(results) + len(pending), "completed": len(ok),
            "errors": sorted({r["error"] for r in results if "error" in r})[:5], "cancelled": len(pending),
            "wall_s": wall, "output_tokens": toks, "output_tok_s": toks / wall,
            "tokens_per_request": sorted({r["tokens"] for r in ok}),
            "ttft_ms": {"p50": pct(ttft, 50), "p99": pct(ttft, 99)},
            "tpot_ms": {"p50": pct(tpot, 50), "p99": pct(tpot, 99)}}


def pct(xs: list[float], q: float) -> float | None:
    """The q-th percentile (linear interpolation, numpy's default) or None for no samples."""
    if not xs:
        return None
    import numpy as np
    return float(np.percentile(xs, q))


# --- report ----------------------------------------------------------------------------------

def fmt(x, nd=0) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def write_markdown(path: Path, rep: dict) -> None:
    s = rep["settings"]
    lines = [f"# Serving comparison: relayinfer vs llama-server, {Path(rep['model']['q4_1']).name}", "",
             f"Command: `{rep['command']}` ({rep['date']}, {machine_line(rep['machine'])}, {rep['machine']['cores']} cores "
             f"shared with other jobs, load avg before {rep['machine']['loadavg_before']}, wall {rep['wall_s']:.0f} s; "
             f"llama.cpp {rep['llama_cpp']}).", "",
             f"Streaming `/v1/chat/completions`, chitchat-dataset conversations (prompts {s['prompt_tokens']['min']}-"
             f"{s['prompt_tokens']['max']} tokens, mean {s['prompt_tokens']['mean']:.0f}), greedy, `ignore_eos`, "
             f"max_tokens {s['max_tokens']}; closed loop of N workers. Servers: {s['threads']} thread(s) pinned to "
             f"CPUs {s['server_cpus']}, client on CPUs {s['client_cpus']}. llama-server: `-np N -c N*{s['slot_ctx']} "
             f"--threads {s['threads']} --threads-batch {s['threads']} -cb`, restarted per N. TTFT: send to first "
             "content delta; TPOT: (last - first delta) / (tokens - 1).", "",
             "| server | weights | N | requests done / sent | out tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) |",
             "|---|---|---|---|---|---|---|"]
    for lv in rep["levels"]:
        lines.append(f"| {lv['server']} | {rep['weights'][lv['server']]} | {lv['concurrency']} | {lv['completed']} / "
                     f"{lv['sent']} | {lv['output_tok_s']:.1f} | {fmt(lv['ttft_ms']['p50'])} / {fmt(lv['ttft_ms']['p99'])} "
                     f"| {fmt(lv['tpot_ms']['p50'], 1)} / {fmt(lv['tpot_ms']['p99'], 1)} |")
    pairs = sorted({k for r in rep["ratios"].values() for k, v in r.items() if v is not None},
                   key=lambda k: (OURS.index(k.split(" / ")[0]), k))
    lines += ["", "Output tokens/s ratios (paired, same run):", "", "| N | " + " | ".join(pairs) + " |",
              "|---|" + "---|" * len(pairs)]
    for n, r in rep["ratios"].items():
        lines.append(f"| {n} | " + " | ".join(fmt(r.get(k), 2) for k in pairs) + " |")
    g = rep.get("goal")
    if g:
        lines += ["", f"Goal: cloud engine >= 1.0x llama-server on F32 at 16 concurrent: **{g['status']}** "
                  f"(fp32 ratio {fmt(g['ratio'], 2)})."]
    errs = [(lv["server"], lv["concurrency"], lv["errors"]) for lv in rep["levels"] if lv["errors"]]
    if errs:
        lines += ["", "Errors: " + "; ".join(f"{a} N={b}: {c}" for a, b, c in errs)]
    path.write_text("\n".join(lines) + "\n" + kept_notes(path, machine_line(rep["machine"])))


def machine_line(m: dict) -> str:
    """'<CPU>; ISA avx2, ...' of a report's `machine` (what the hand-written notes are about)."""
    return f"{m['cpu']}; ISA {', '.join(m['isa']) if m.get('isa') else 'unknown'}"


def kept_notes(path: Path, machine: str) -> str:
    """The hand-written '## Notes' of the file a run overwrites, kept only where that file's run
    was on the same machine (`machine_line` in its header); notes about another CPU are dropped
    with a line on stderr, so a results file never carries another host's reading."""
    old = path.read_text() if path.is_file() else ""
    if "## Notes" not in old:
        return ""
    if f", {machine}, " not in old.split("\n\n", 2)[1]:
        print(f"serve_compare: the notes of {path} were written for another machine; not kept", file=sys.stderr)
        return ""
    return "\n" + old[old.index("## Notes"):]


# --- main ------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,4,16,64", help="comma list of N (default 1,4,16,64)")
    ap.add_argument("--servers", default=",".join(SERVERS), help=f"comma list from {','.join(SERVERS)}")
    ap.add_argument("--requests", type=int, help="requests per level (default: --waves x N, at least 2; N at N >= 64)")
    ap.add_argument("--waves", type=int, default=2, help="requests per worker and level (default 2)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--max-prompt", type=int, default=384, help="prompt tokens at most")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads of every server")
    ap.add_argument("--server-cpus", default="0", help="CPUs the servers are pinned to (comma list)")
    ap.add_argument("--client-cpus", default="1", help="CPUs the client is pinned to (comma list)")
    ap.add_argument("--slot-ctx", type=int, default=512, help="llama-server context per slot (tokens)")
    ap.add_argument("--kv-cache-mb", type=int, default=1024, help="relayinfer paged KV cache (MiB)")
    ap.add_argument("--level-budget-s", type=float, default=180.0, help="no new request after this (s)")
    ap.add_argument("--llama-isa", default="avx2", choices=("avx2", "avx512"),
                    help="which bench/llamacpp.sh build runs llama-server (avx512: AVX512 + AMX kernels)")
    ap.add_argument("--quick", action="store_true", help="N = 1,4, 2 requests per level, output under /tmp")
    ap.add_argument("--out", type=Path, help="JSON path; .md beside it (default bench/results/serve_compare.json)")
    args = ap.parse_args(argv)
    try:
        levels = [int(x) for x in ("1,4" if args.quick else args.concurrency).split(",") if x.strip()]
        servers = [s.strip() for s in args.servers.split(",") if s.strip()]
        server_cpus = {int(c) for c in args.server_cpus.split(",")}
        client_cpus = {int(c) for c in args.client_cpus.split(",")}
    except ValueError as e:
        _die(f"bad list argument: {e}")
    if not levels or min(levels) < 1:
        _die("--concurrency needs positive integers")
    if bad := [s for s in servers if s not in SERVERS]:
        _die(f"unknown server {bad[0]!r}; choose from {', '.join(SERVERS)}")
    if args.max_tokens < 2 or args.threads < 1 or args.max_prompt + args.max_tokens > args.slot_ctx:
        _die("need --max-tokens >= 2, --threads >= 1 and --max-prompt + --max-tokens <= --slot-ctx")
    ncpu = os.cpu_count() or 1
    if max(server_cpus | client_cpus) >= ncpu:
        _die(f"CPU ids must be below {ncpu}")
    out = args.out or (Path(tempfile.gettempdir()) / "relayinfer-serve-compare-quick.json" if args.quick
                       else ROOT / "results" / "serve_compare.json")
    t_start = time.perf_counter()
    log = lambda m: print(f"[{time.perf_counter() - t_start:6.1f}s] {m}", file=sys.stderr, flush=True)
    loadavg = os.getloadavg()

    bindir = None
    if any(s.startswith("llama") for s in servers):
        r = subprocess.run([str(ROOT / "llamacpp.sh"), "--print"], capture_output=True, text=True,
                           env={**os.environ, "LLAMACPP_ISA": args.llama_isa})
        if r.returncode != 0:
            _die(f"llama.cpp ({args.llama_isa}) is not built: run LLAMACPP_ISA={args.llama_isa} bench/llamacpp.sh "
                 "first (or --servers relayinfer)")
        bindir = Path(r.stdout.strip().splitlines()[-1])

    from relayinfer.protocol.model.model_file import resolve_model_path
    from relayinfer.protocol.model.tokenizer import Tokenizer
    q_path = resolve_model_path(None)
    tok = Tokenizer.from_gguf(q_path)
    models = {"q4_1": str(q_path)}
    if "llama-f32" in servers:
        models["f32"] = str(f32_gguf(q_path, bindir, log))
    count_for = lambda n: args.requests or (2 if args.quick else (n if n >= 64 else max(2, args.waves * n)))
    prompts = workload(tok, max(count_for(n) for n in levels) + 1, args.max_prompt)
    plens = [len(tok.encode_chat(m)) for m in prompts]
    os.sched_setaffinity(0, client_cpus)
    logdir = Path(tempfile.mkdtemp(prefix="serve-compare-"))
    log(f"server logs in {logdir}")

    results, ours = [], {}  # relayinfer servers run once for all N (idle while another server's level runs)
    try:
        for name in (s for s in servers if s in OURS):
            ours[name] = srv = start_relayinfer(name, args.threads, server_cpus, args.kv_cache_mb,
                                                lifetime_s=len(levels) * 4 * args.level_budget_s + 600, logdir=logdir)
            srv.wait_ready()
            asyncio.run(run_level(srv.base, prompts[-1:], 1, 1, args.max_tokens, args.level_budget_s))  # warm-up
        for n in levels:
            for name in servers:
                srv = ours.get(name)
                if srv is None:
                    model = Path(models["f32" if name == "llama-f32" else "q4_1"])
                    srv = start_llama(name, bindir, model, n, args.threads, args.slot_ctx, server_cpus, logdir)
                try:
                    srv.wait_ready()
                    if name not in OURS:  # warm-up
                        asyncio.run(run_level(srv.base, prompts[-1:], 1, 1, args.max_tokens, args.level_budget_s))
                    lv = asyncio.run(run_level(srv.base, prompts, n, count_for(n), args.max_tokens,
                                               args.level_budget_s))
                finally:
                    if name not in OURS:
                        srv.stop()
                lv["server"] = name
                results.append(lv)
                log(f"{name} N={n}: {lv['completed']}/{lv['sent']} done, {lv['output_tok_s']:.1f} tok/s, TTFT p50 "
                    f"{fmt(lv['ttft_ms']['p50'])} ms, TPOT p50 {fmt(lv['tpot_ms']['p50'], 1)} ms"
                    + (f", errors {lv['errors']}" if lv["errors"] else ""))
    finally:
        for srv in ours.values():
            srv.stop()

    by = {(lv["server"], lv["concurrency"]): lv["output_tok_s"] for lv in results}
    ratios = {str(n): {f"{a} / {b}": (by[(a, n)] / by[(b, n)] if by.get((b, n)) and by.get((a, n)) else None)
                       for a in OURS for b in BASELINES} for n in levels}
    goal = None
    f32_16 = ratios.get("16", {}).get("relayinfer / llama-f32")
    if f32_16 is not None:
        goal = {"goal": "cloud engine (fp32) >= 1.0x llama-server on F32 at 16 concurrent (output tok/s)",
                "ratio": f32_16, "target": 1.0, "status": "met" if f32_16 >= 1.0 else "missed"}
    llama_ver = None
    if bindir:
        src = REPO / "build" / "llamacpp" / "SOURCE"
        llama_ver = (src.read_text().strip() if src.is_file() else "vendored") + f", {args.llama_isa} build"
    rep = {
        "command": " ".join([".venv/bin/python", "bench/serve_compare.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {"cpu": cpu_name() or platform.machine(), "isa": cpu_isa(), "cores": os.cpu_count(),
                    "loadavg_before": [round(x, 2) for x in loadavg]},
        "llama_cpp": llama_ver, "model": models,
        "weights": WEIGHTS,
        "settings": {"concurrency": levels, "max_tokens": args.max_tokens, "threads": args.threads,
                     "server_cpus": sorted(server_cpus), "client_cpus": sorted(client_cpus),
                     "slot_ctx": args.slot_ctx, "kv_cache_mb": args.kv_cache_mb,
                     "level_budget_s": args.level_budget_s, "requests": {str(n): count_for(n) for n in levels},
                     "prompt_tokens": {"min": min(plens), "max": max(plens), "mean": statistics.mean(plens)},
                     "units": "tok/s; ms"},
        "levels": results, "ratios": ratios, "goal": goal, "wall_s": time.perf_counter() - t_start,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rep, indent=1) + "\n")
    write_markdown(out.with_suffix(".md"), rep)
    log(f"wrote {out} and {out.with_suffix('.md')}")
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
