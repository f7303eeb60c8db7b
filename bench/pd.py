"""`relayinfer bench pd`: P/D serving benchmark.

Parts (each writes its own JSON under bench/results/ with the command that made it):

* `transfer` (real, Ray): KV hand-off of one request of 1k / 4k / 8k tokens, contiguous (one gather
  into one buffer, one object, one scatter) vs block-fixed (one object per 16-token block), between
  two Ray actors on this machine through Ray's object store. The caches are the real `ModelRunner`
  tensors of the model's geometry (default SmolLM2-135M: 30 layers x 3 KV heads x 64, fp32: 46,080 bytes/token) with a
  fragmented block table; K/V contents are random (the copy does not depend on them). Also the same
  export + import in one process (no object store), to separate copy cost from per-object cost.
* `perf` (real): the engine's speeds measured here (prefill tokens/s by prompt length, decode step ms
  by batch size, mixed prefill+decode steps), fitted to the linear step-time model the simulator uses.
* `sim` (SIMULATED): `bench/pd_sim.py`, a discrete-event simulation of 8-64 instances driven by the
  `perf` and `transfer` timings: aggregated vs P/D with one static ratio vs per-scenario groups with
  the ratio controller, on-demand forwarding vs the push router, on chitchat and long-context
  workloads (token lengths of real conversations from chitchat-dataset), Poisson and Gamma (CV 4)
  arrivals.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
PARTS = ("transfer", "perf", "sim", "prefix")
sys.path.insert(0, str(HERE))


# --- transfer ----------------------------------------------------------------------------------------

def _runner(num_blocks: int, block_size: int = 16, model: str | None = None):
    """A real `ModelRunner` (its K/V cache tensors, slots/gather/scatter) on the geometry of `model`
    (GGUF path or installed name; default SmolLM2-135M-Instruct), without weights (a transfer does
    not run the model)."""
    import torch

    from relayinfer.cloud.engine.model_runner import ModelRunner
    from relayinfer.protocol.model.model_file import open_gguf, read_config, resolve_model_path

    class _Shape(torch.nn.Module):
        def __init__(self, cfg):
            super().__init__()
            self.cfg = cfg
            self.p = torch.nn.Parameter(torch.zeros(1))

    return ModelRunner(_Shape(read_config(open_gguf(resolve_model_path(model)))), num_blocks, block_size)


class _KVActor:
    """One side of the transfer benchmark: a cache of `num_blocks` blocks, random contents."""

    def __init__(self, num_blocks: int, seed: int, model: str | None = None):
        import torch

        torch.set_num_threads(1)
        self.r = _runner(num_blocks, model=model)
        g = torch.Generator().manual_seed(seed)
        for t in self.r.k + self.r.v:
            t.copy_(torch.randn(t.shape, generator=g))
        self.rng = np.random.default_rng(seed)

    def table(self, n_tokens: int) -> list[int]:
        n = -(-n_tokens // 16)
        return [int(b) for b in self.rng.permutation(self.r.num_blocks)[:n]]  # fragmented, as after churn

    def export_put(self, n_tokens: int, mode: str):
        import ray

        from relayinfer.cloud.pd.kv import export_kv

        c0 = time.process_time()
        p = export_kv(self.r, self.table(n_tokens), n_tokens, mode)
        t0 = time.perf_counter()
        refs = [ray.put(a) for a in p.parts]
        put_s = time.perf_counter() - t0
        p.parts = refs
        p.meta["cpu_s"] = time.process_time() - c0  # this process's CPU time: export + put
        return p, put_s

    def fetch_import(self, payload):
        import ray

        from relayinfer.cloud.pd.kv import writer

        c0 = time.process_time()
        t0 = time.perf_counter()
        payload.parts = ray.get(payload.parts)
        fetch_s = time.perf_counter() - t0
        table = self.table(payload.num_tokens)
        writer(payload)(self.r, self.r.slots(table, 0, payload.num_tokens), 0)
        return fetch_s, payload.import_s, time.process_time() - c0

    def local(self, n_tokens: int, mode: str):
        """Export + import in this process (no object store)."""
        from relayinfer.cloud.pd.kv import export_kv, writer

        p = export_kv(self.r, self.table(n_tokens), n_tokens, mode)
        writer(p)(self.r, self.r.slots(self.table(n_tokens), 0, n_tokens), 0)
        return p.export_s, p.import_s, p.nbytes, p.num_objects


def bench_transfer(sizes=(1024, 4096, 8192), reps: int = 5, seed: int = 0, model: str | None = None) -> dict:
    import ray

    from relayinfer.cloud.pd.ray_pool import start_ray

    start_ray(num_cpus=2)
    blocks = max(sizes) // 16 * 2 + 8
    A = ray.remote(num_cpus=0)(_KVActor)
    p_actor, d_actor = A.remote(blocks, seed, model), A.remote(blocks, seed + 1, model)
    ray.get([p_actor.table.remote(16), d_actor.table.remote(16)])
    rows = []
    for n in sizes:
        for mode in ("contiguous", "block-fixed"):
            runs = []
            for _ in range(reps + 1):  # the first is a warm-up
                t0 = time.perf_counter()
                payload, put_s = ray.get(p_actor.export_put.remote(n, mode))
                fetch_s, import_s, d_cpu = ray.get(d_actor.fetch_import.remote(payload))
                total = time.perf_counter() - t0
                runs.append({"total_ms": total * 1e3, "export_ms": payload.export_s * 1e3, "put_ms": put_s * 1e3,
                             "fetch_ms": fetch_s * 1e3, "import_ms": import_s * 1e3,
                             "cpu_ms": (payload.meta["cpu_s"] + d_cpu) * 1e3})
                nbytes, nobj = payload.nbytes, payload.num_objects
                del payload
            runs = runs[1:]
            local = [ray.get(p_actor.local.remote(n, mode)) for _ in range(reps)]
            med = {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}
            rows.append({"tokens": n, "mode": mode, "bytes": nbytes, "objects": nobj, **med,
                         "total_ms_all": [round(r["total_ms"], 3) for r in runs],
                         "local_export_import_ms": round(statistics.median((e + i) * 1e3 for e, i, *_ in local), 3)})
            print(f"transfer {n:5d} {mode:11s} {nbytes / 2**20:7.1f} MiB {nobj:4d} obj  total {med['total_ms']:8.1f} ms"
                  f"  (export {med['export_ms']:.1f} put {med['put_ms']:.1f} fetch {med['fetch_ms']:.1f} import "
                  f"{med['import_ms']:.1f})  in-process {rows[-1]['local_export_import_ms']:.1f} ms", flush=True)
    ray.kill(p_actor)
    ray.kill(d_actor)
    ratios = {}
    for n in sizes:
        c = next(r for r in rows if r["tokens"] == n and r["mode"] == "contiguous")
        b = next(r for r in rows if r["tokens"] == n and r["mode"] == "block-fixed")
        ratios[str(n)] = {"contiguous_over_block_fixed": round(c["total_ms"] / b["total_ms"], 3),
                          "cpu_time_ratio": round(c["cpu_ms"] / b["cpu_ms"], 3),
                          "in_process_ratio": round(c["local_export_import_ms"] / b["local_export_import_ms"], 3)}
    return {"what": "real: KV hand-off of one request between two Ray actors on this machine (object store, "
                    "shared memory), SmolLM2-135M cache geometry, fp32, fragmented block tables, random K/V. "
                    "total_ms: wall time export -> put -> fetch -> import (the machine is shared: noisy); "
                    "cpu_ms: CPU time of the two actor processes for it (robust to the load)",
            "load_average": os.getloadavg(),
            "reps": reps, "rows": rows, "ratios": ratios,
            "goal": "contiguous <= 0.54x block-fixed at 4k tokens (P/D-Serve: -46 % transfer time)"}


# --- engine speeds -------------------------------------------------------------------------------------

def bench_perf(quick: bool = False, model: str | None = None) -> dict:
    """Prefill and decode speeds of the real engine here (1 thread), fitted for the simulator."""
    import torch

    from relayinfer.cloud.engine.llm_engine import LLMEngine
    from relayinfer.cloud.engine.torch_engine import TorchEngine
    from relayinfer.protocol.model.decoding import SamplingParams

    torch.set_num_threads(1)
    te = TorchEngine(model, threads=1)
    eng = LLMEngine(te, kv_cache_bytes=512 << 20, max_num_batched_tokens=512, enable_prefix_caching=False)
    rng = np.random.default_rng(0)
    eng.generate([list(rng.integers(100, 40000, 64))], SamplingParams(max_new_tokens=2))

    def prefill(n):
        ids = [int(x) for x in rng.integers(100, 40000, n)]
        t0 = time.process_time()  # CPU time of this (one-thread) process: robust to the shared machine's load
        eng.add_request(f"p{n}-{t0}", ids, SamplingParams(max_new_tokens=1))
        while eng.has_unfinished():
            eng.step()
        return time.process_time() - t0

    lengths = (128, 512, 1024) if quick else (128, 512, 1024, 2048)
    pre = {n: statistics.median(prefill(n) for _ in range(2)) for n in lengths}
    print("prefill s:", {k: round(v, 3) for k, v in pre.items()}, flush=True)

    def decode_step(batch, ctx=200):
        for i in range(batch):
            eng.add_request(f"d{batch}-{i}-{time.time()}", [int(x) for x in rng.integers(100, 40000, ctx)],
                            SamplingParams(max_new_tokens=12), ignore_eos=True)
        times = []
        while eng.has_unfinished():
            t0 = time.process_time()
            eng.step()
            if all(s.num_computed_tokens >= s.num_prompt_tokens for s in eng.scheduler.running) and \
                    len(eng.scheduler.running) == batch:
                times.append(time.process_time() - t0)
        return statistics.median(times[2:]) if len(times) > 3 else statistics.median(times)

    batches = (1, 4, 16) if quick else (1, 2, 4, 8, 16, 32)
    dec = {b: decode_step(b) for b in batches}
    print("decode step s:", {k: round(v, 4) for k, v in dec.items()}, flush=True)
    # linear fits: prefill s = a + n / rate (on <= 2k tokens), decode step ms = a + c * batch
    xs = np.array([n for n in lengths if n <= 2048], float)
    ys = np.array([pre[n] for n in xs.astype(int)])
    icpt, slope = cost_line(xs, ys)
    bx = np.array(batches, float)
    by = np.array([dec[b] for b in batches]) * 1e3
    a, c = cost_line(bx, by)
    return {"what": f"real: LLMEngine on {te.model_path.name}, fp32, 1 torch thread, this (shared, 2-core) machine; times are "
                    "the process's CPU time (time.process_time), so the other jobs on the machine do not inflate them",
            "load_average": os.getloadavg(),
            "prefill_s": {str(k): round(v, 4) for k, v in pre.items()},
            "decode_step_s": {str(k): round(v, 5) for k, v in dec.items()},
            "fit": {"prefill_tok_s": round(1 / slope, 1) if slope > 0 else None, "prefill_overhead_ms": round(icpt * 1e3, 2),
                    "decode_a_ms": round(a, 3), "decode_c_ms": round(c, 3)}}


# --- prefix hit rate of multi-turn chats ----------------------------------------------------------------

def bench_prefix(quick: bool = False, model: str | None = None, conversations: int = 8, turns: int = 4,
                 max_new: int = 16) -> dict:
    """Prompt tokens reused from the prefix cache over `conversations` chitchat chats of `turns`
    user turns each (all conversations in flight at once, turn by turn; greedy, `max_new` tokens
    per answer): one batching engine vs the P/D gateway (2 prefill + 2 decode in-process
    instances) with prefix-aware routing and without it (round-robin prefill, fewest-in-flight
    decode). Hit rate = cached prompt tokens / prompt tokens."""
    import asyncio

    from relayinfer.cloud.engine.llm_engine import AsyncLLMEngine, LLMEngine
    from relayinfer.cloud.engine.torch_engine import TorchEngine
    from relayinfer.cloud.pd.gateway import Gateway, GroupSpec, Scenario, local_groups
    from relayinfer.cloud.pd.instance import InstanceConfig
    from relayinfer.cloud.pd.service import PDEngine
    from relayinfer.protocol.model.decoding import SamplingParams
    from relayinfer.sdk.datasets import chitchat_prompt

    conversations, turns = (4, 3) if quick else (conversations, turns)
    te = TorchEngine(model, threads=1)
    tok = te.tokenizer
    chats, i = [], 0
    while len(chats) < conversations:
        users = [m["content"] for m in chitchat_prompt(i, max_turns=2 * turns) if m["role"] == "user"]
        i += 1
        if len(users) >= turns:
            chats.append(users[:turns])
    kv = 64 << 20

    async def drive(engine) -> dict:
        msgs = [[] for _ in chats]
        prompt = cached = 0

        async def one(c: int, t: int):
            nonlocal prompt, cached
            msgs[c].append({"role": "user", "content": chats[c][t]})
            ids = tok.encode_chat(msgs[c])
            rid = f"c{c}-t{t}"
            out = [o.token_id async for o in engine.generate(rid, ids, SamplingParams(max_new_tokens=max_new))]
            st = engine.request_stats(rid)
            prompt += len(ids)
            cached += st.prefix_hit_tokens if st is not None else 0
            msgs[c].append({"role": "assistant", "content": tok.decode(out, skip_special=True)})

        t0 = time.perf_counter()
        for t in range(turns):
            await asyncio.gather(*(one(c, t) for c in range(len(chats))))
        return {"prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": round(cached / prompt, 4),
                "wall_s": round(time.perf_counter() - t0, 2)}

    async def pd(prefix_routing: bool) -> dict:
        gw = Gateway(local_groups(te, [GroupSpec(Scenario("chat", 60000, 5000), 2, 2)],
                                  InstanceConfig(kv_cache_bytes=kv)), prefix_routing=prefix_routing)
        blocks = kv // (16 * te.cfg.kv_bytes_per_token)
        engine = PDEngine(gw, te.cfg, min(te.context_length, blocks * 16), blocks, model=te.model)
        await gw.start()
        try:
            return await drive(engine)
        finally:
            await gw.stop()

    async def single() -> dict:
        engine = AsyncLLMEngine(LLMEngine(te, kv_cache_bytes=kv))
        try:
            return await drive(engine)
        finally:
            engine.shutdown()

    rows = {"one engine": asyncio.run(single()), "P/D, prefix-aware routing": asyncio.run(pd(True)),
            "P/D, round-robin": asyncio.run(pd(False))}
    print("prefix hit rate:", {k: v["hit_rate"] for k, v in rows.items()}, flush=True)
    return {"what": f"real: {conversations} chitchat conversations x {turns} user turns, all in flight at once, "
                    f"greedy {max_new} tokens per answer, {te.model_path.name}; one AsyncLLMEngine vs the P/D "
                    "gateway over 2 prefill + 2 decode in-process instances (one machine)",
            "load_average": os.getloadavg(), "rows": rows}


def run(parts: list[str], out_dir: str = "bench/results", quick: bool = False, seed: int = 0,
        command: str | None = None, model: str | None = None) -> dict:
    """Run the named parts ('transfer', 'perf', 'sim', 'prefix') and write their JSON under `out_dir`;
    `model` (GGUF path or installed name; default SmolLM2-135M-Instruct) sets the KV geometry of the
    transfer and the engine of the perf fit (the simulation has no model)."""
    bad = [p for p in parts if p not in PARTS]
    if not parts:
        raise ValueError(f"no part to run; choose from {', '.join(PARTS)}")
    if bad:
        raise ValueError(f"unknown part {bad[0]!r}; choose from {', '.join(PARTS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    command = command or " ".join(["python", "bench/pd.py", *sys.argv[1:]])
    summary = {}
    if "transfer" in parts:
        sizes = (1024, 4096) if quick else (1024, 4096, 8192)
        res = bench_transfer(sizes, reps=3 if quick else 5, seed=seed, model=model)
        res["command"] = command
        (out / "pd-transfer.json").write_text(json.dumps(res, indent=1))
        summary["transfer"] = res["ratios"]
    if "perf" in parts:
        res = bench_perf(quick, model)
        res["command"] = command
        (out / "pd-perf.json").write_text(json.dumps(res, indent=1))
        summary["perf"] = res["fit"]
    if "prefix" in parts:
        res = bench_prefix(quick, model)
        res["command"] = command
        (out / "pd-prefix.json").write_text(json.dumps(res, indent=1))
        summary["prefix"] = {k: v["hit_rate"] for k, v in res["rows"].items()}
    if "sim" in parts:
        import pd_sim

        res = pd_sim.run_all(out, quick=quick, seed=seed)
        res["command"] = command
        (out / "pd-sim.json").write_text(json.dumps(res, indent=1))
        summary["sim"] = res["summary"]
    return summary


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="transfer,perf,sim")
    ap.add_argument("--out-dir", default="bench/results")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(json.dumps(run(a.parts.split(","), a.out_dir, a.quick, a.seed), indent=1))
