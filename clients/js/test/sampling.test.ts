// Seeded sampling == the Python device's (decoding.sample), checked to the last bit against vectors
// made by numpy (test/make_sampling_vectors.py -> test/sampling-vectors.json).
import { test } from "node:test";
import assert from "node:assert/strict";
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { PCG64, pairwiseSum, positionUniform, sampleToken, samplingProbs, seedKey, seedSequenceState, seedSequenceState64 } from "../src/sampling.js";

const here = path.dirname(fileURLToPath(import.meta.url));
const V = JSON.parse(fs.readFileSync(path.resolve(here, "../../test/sampling-vectors.json"), "utf8"));
const f64 = (h: string): number => Buffer.from(h, "hex").readDoubleBE(0);
const hex = (x: number): string => { const b = Buffer.alloc(8); b.writeDoubleBE(x); return b.toString("hex"); };
const f32 = (h: string): Float32Array => { const b = Buffer.from(h, "hex"); return new Float32Array(b.buffer.slice(b.byteOffset, b.byteOffset + b.length)); };

test("seed_key: signed 64-bit seeds as their unsigned bits", () => {
  assert.equal(seedKey(-1), (1n << 64n) - 1n);
  assert.equal(seedKey(1234), 1234n);
  assert.equal(seedKey(-(1n << 63n)), 1n << 63n);
  assert.throws(() => seedKey(1n << 63n), RangeError);
  assert.throws(() => seedKey(1.5), RangeError);
});

test("SeedSequence.generate_state == numpy (uint32 and uint64)", () => {
  for (const c of V.seed_sequence) {
    const ent = c.entropy.map(BigInt);
    assert.deepEqual(Array.from(seedSequenceState(ent, 8)), c.u32, `entropy ${c.entropy}`);
    assert.deepEqual(seedSequenceState64(ent, 4).map(String), c.u64);
  }
});

test("PCG64 seeded state, inc and next_uint64 == numpy", () => {
  for (const c of V.pcg64) {
    const g = new PCG64(c.entropy.map(BigInt));
    assert.equal(String(g.state), c.state); assert.equal(String(g.inc), c.inc);
    // Generator.integers(0, 2**64, dtype=uint64) is a raw next_uint64 (full range, no masking)
    assert.deepEqual(Array.from({ length: c.next.length }, () => String(g.nextUint64())), c.next);
  }
});

test("default_rng((key, i)).random() == numpy to the last bit (keys up to 2**64-1)", () => {
  assert.ok(V.uniform.length >= 80);
  for (const c of V.uniform) {
    const k = BigInt(c.key), seed = k >= 1n << 63n ? k - (1n << 64n) : k; // the request seed of that key
    assert.equal(hex(positionUniform(seed, c.index)), c.u, `key ${c.key} index ${c.index}`);
  }
});

test("pairwise sum == numpy's float64 sum bit for bit (and differs from the sequential one somewhere)", () => {
  let differs = 0;
  for (const c of V.pairwise) {
    const a = Float64Array.from(c.values, f64);
    assert.equal(hex(pairwiseSum(a)), c.sum, `n=${c.n}`);
    if (c.sum !== c.seq) differs++;
  }
  assert.ok(differs > 0);
});

test("sampling probabilities (temperature, top-k, top-p, renormalised) == Python to a few ulp (Math.exp vs glibc exp)", () => {
  for (const c of V.probs) {
    const p = samplingProbs(f32(c.logits), c.t, c.top_k, c.top_p);
    assert.equal(p.length, c.p.length);
    for (let i = 0; i < p.length; i++) {
      const w = f64(c.p[i]);
      assert.ok(w === 0 ? p[i] === 0 : Math.abs(p[i] - w) <= 8 * Number.EPSILON * w, `T=${c.t} top_p=${c.top_p} top_k=${c.top_k} p[${i}] ${p[i]} != ${w}`);
    }
  }
});

test("sampleToken == decoding.sample for every setting, seed and position", () => {
  let n = 0;
  for (const row of V.sample) {
    const lg = f32(row.logits);
    for (const [t, tp, tk, seed, idx, want] of row.draws) {
      assert.equal(sampleToken(lg, { temperature: t, topP: tp, topK: tk, seed: BigInt(seed) }, idx), want, `T=${t} top_p=${tp} top_k=${tk} seed=${seed} i=${idx}`);
      n++;
    }
  }
  assert.ok(n >= 500);
});

test("settings the JS device does not apply are refused by name, never ignored", async () => {
  const { checkGenerateOptions } = await import("../src/split.js");
  assert.throws(() => checkGenerateOptions({ repetitionPenalty: 1.1 }), /repetitionPenalty/);
  assert.throws(() => checkGenerateOptions({ presencePenalty: 0.5, logitBias: [[1, 2]] }), /presencePenalty, logitBias/);
  assert.throws(() => checkGenerateOptions({ minTokens: 3 }), /minTokens/);
  assert.throws(() => checkGenerateOptions({ grammar: { kind: "regex", spec: "a+" } }), /grammar/);
  assert.throws(() => checkGenerateOptions({ frequencyPenalty: -1 }), /frequencyPenalty/);
  assert.throws(() => checkGenerateOptions({ temperature: 3 }), /temperature/);
  assert.throws(() => checkGenerateOptions({ seed: 1n << 63n }), /seed/);
  checkGenerateOptions({ temperature: 0.8, topP: 0.9, topK: 40, seed: -1, repetitionPenalty: 1, logitBias: [], minTokens: 0 });
});
