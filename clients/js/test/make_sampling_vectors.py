"""Writes clients/js/test/sampling-vectors.json from numpy and relayinfer's decoding.sample (the
Python device's sampler): run from the repo root with the project's venv,
    .venv/bin/python clients/js/test/make_sampling_vectors.py
Floats are stored as the hex of their float64 bits, so the node test compares to the last bit."""
import json
import struct
from pathlib import Path

import numpy as np

from relayinfer.protocol.model.decoding import SamplingParams, sample, seed_key

hx = lambda f: struct.pack(">d", float(f)).hex()  # noqa: E731
out = {"numpy": np.__version__, "uniform": [], "seed_sequence": [], "pcg64": [], "pairwise": [], "sample": [], "probs": []}
keys = [0, 1, 1234, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1, seed_key(-1), seed_key(-1234), 987654321987654321]
for k in keys:
    for i in [0, 1, 2, 7, 23, 255, 4096, 2**31 - 1]:
        out["uniform"].append({"key": str(k), "index": i, "u": hx(np.random.default_rng((k, i)).random())})
for ent in [[0, 0], [1234, 5], [2**64 - 1, 3], [1, 2, 3, 4, 5, 6], [2**100 + 7, 0]]:
    ss = np.random.SeedSequence(ent)
    out["seed_sequence"].append({"entropy": [str(e) for e in ent], "u32": [int(w) for w in ss.generate_state(8, np.uint32)],
                                 "u64": [str(int(w)) for w in ss.generate_state(4, np.uint64)]})
    g = np.random.PCG64(ent)
    out["pcg64"].append({"entropy": [str(e) for e in ent], "state": str(g.state["state"]["state"]), "inc": str(g.state["state"]["inc"]),
                         "next": [str(int(x)) for x in np.random.Generator(np.random.PCG64(ent)).integers(0, 2**64, 5, dtype=np.uint64, endpoint=False)]})
rs = np.random.default_rng(7)
for n in [0, 1, 5, 8, 9, 15, 16, 17, 100, 127, 128, 129, 255, 256, 257, 1000, 4099]:
    a = np.exp(rs.normal(size=n) * 4)
    out["pairwise"].append({"n": n, "seed": 7, "values": [hx(v) for v in a], "sum": hx(a.sum()),
                            "seq": hx(sum(a.tolist()))})
settings = [(0.8, 0.9, 40), (1.0, 1.0, 0), (0.7, 0.95, 0), (1.3, 1.0, 50), (0.5, 0.0, 0), (2.0, 0.5, 5), (0.0, 1.0, 0), (1e-6, 1.0, 0)]
for case in range(6):
    v = [300, 2000, 5000, 300, 1000, 2000][case]
    lg = (np.random.default_rng(100 + case).standard_normal(v) * (2 + case)).astype(np.float32)
    if case == 3:
        lg[::7] = lg.max()  # ties at the top
    row = {"logits": lg.tobytes().hex(), "draws": []}
    for t, tp, tk in settings:
        for seed in [1234, -1, 0, 2**63 - 1]:
            for idx in [0, 3, 17]:
                p = SamplingParams(temperature=t, top_p=tp, top_k=tk, seed=seed)
                row["draws"].append([t, tp, tk, str(seed), idx, sample(lg, p, idx)])
    out["sample"].append(row)
# the probabilities _pick draws from, bit for bit (small vocab)
lg = (np.random.default_rng(3).standard_normal(300) * 3).astype(np.float32)
for t, tp, tk in [(0.8, 0.9, 40), (1.0, 1.0, 0), (0.7, 0.5, 0)]:
    x = lg.astype(np.float64) / t
    if tk and tk < x.size:
        x = np.where(x < np.partition(x, -tk)[-tk], -np.inf, x)
    pr = np.exp(x - x.max()); pr /= pr.sum()
    if tp < 1:
        from relayinfer.protocol.model.decoding import top_p_keep
        keep = top_p_keep(pr, tp); q = np.zeros_like(pr); q[keep] = pr[keep]; pr = q / q.sum()
    out["probs"].append({"logits": lg.tobytes().hex(), "t": t, "top_p": tp, "top_k": tk, "p": [hx(v) for v in pr]})
Path(__file__).with_name("sampling-vectors.json").write_text(json.dumps(out))
print("wrote", sum(len(v) if isinstance(v, list) else 0 for v in out.values()), "groups")
