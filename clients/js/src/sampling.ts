/**
 * Seeded sampling identical to the Python device (relayinfer/protocol/model/decoding.py `sample`):
 * the generator for answer position i is numpy's `default_rng((seed_key(seed), i))`, i.e. a
 * `SeedSequence` of the entropy [seed mod 2**64, i] feeding `PCG64` (XSL-RR 128/64), and one
 * `random()` float64 drawn through the inverse CDF. Softmax, top-k, top-p and every sum follow
 * numpy's order of operations in float64 (pairwise summation for `sum`, sequential `cumsum`), so
 * the same logits give the same token bit for bit (up to `Math.exp` vs numpy's `exp` in the last
 * ulp; see README).
 */
import { argmax } from "./engine.js";

/** A temperature below this is greedy (decoding.SAMPLING_EPS, vLLM's _SAMPLING_EPS). */
export const SAMPLING_EPS = 1e-5;

const M64 = (1n << 64n) - 1n;
const M128 = (1n << 128n) - 1n;

/** decoding.seed_key: the signed 64-bit request seed as its unsigned bits (seed mod 2**64). */
export function seedKey(seed: number | bigint): bigint {
  if (typeof seed === "number" && !Number.isSafeInteger(seed)) throw new RangeError(`seed must be an integer, got ${seed}`);
  const s = BigInt(seed);
  if (s < -(1n << 63n) || s > (1n << 63n) - 1n) throw new RangeError(`seed must be in [-2**63, 2**63-1], got ${s}`);
  return BigInt.asUintN(64, s);
}

// numpy/random/bit_generator.pyx
const INIT_A = 0x43b0d7e5, MULT_A = 0x931e8875, INIT_B = 0x8b51f9dd, MULT_B = 0x58f38ded;
const MIX_MULT_L = 0xca01f9dd, MIX_MULT_R = 0x4973f715, XSHIFT = 16, POOL_SIZE = 4;

/** numpy's `_int_to_uint32_array`: a non-negative integer as little-endian uint32 words ([0] for 0). */
function intWords(n: bigint): number[] {
  if (n < 0n) throw new RangeError("SeedSequence entropy must be non-negative");
  if (n === 0n) return [0];
  const out: number[] = [];
  for (; n > 0n; n >>= 32n) out.push(Number(n & 0xffffffffn));
  return out;
}

/** numpy's `SeedSequence(entropy).generate_state(nWords, np.uint32)` (no spawn key, pool size 4).
 * `entropy`: the integers of the seed sequence (each split into uint32 words, concatenated). */
export function seedSequenceState(entropy: (number | bigint)[], nWords: number): Uint32Array {
  const ent = entropy.flatMap((e) => intWords(BigInt(e)));
  let hashConst = INIT_A;
  const hashmix = (value: number): number => {
    value = (value ^ hashConst) >>> 0;
    hashConst = Math.imul(hashConst, MULT_A) >>> 0;
    value = Math.imul(value, hashConst) >>> 0;
    return (value ^ (value >>> XSHIFT)) >>> 0;
  };
  const mix = (x: number, y: number): number => {
    const r = (Math.imul(MIX_MULT_L, x) - Math.imul(MIX_MULT_R, y)) >>> 0;
    return (r ^ (r >>> XSHIFT)) >>> 0;
  };
  const pool = new Array<number>(POOL_SIZE);
  for (let i = 0; i < POOL_SIZE; i++) pool[i] = hashmix(i < ent.length ? ent[i] : 0);
  for (let s = 0; s < POOL_SIZE; s++) {
    for (let d = 0; d < POOL_SIZE; d++) if (s !== d) pool[d] = mix(pool[d], hashmix(pool[s]));
  }
  for (let s = POOL_SIZE; s < ent.length; s++) {
    for (let d = 0; d < POOL_SIZE; d++) pool[d] = mix(pool[d], hashmix(ent[s]));
  }
  const out = new Uint32Array(nWords);
  let hc = INIT_B;
  for (let i = 0; i < nWords; i++) {
    let v = (pool[i % POOL_SIZE] ^ hc) >>> 0;
    hc = Math.imul(hc, MULT_B) >>> 0;
    v = Math.imul(v, hc) >>> 0;
    out[i] = (v ^ (v >>> XSHIFT)) >>> 0;
  }
  return out;
}

/** `generate_state(n, np.uint64)`: 2n uint32 words, read as little-endian uint64 pairs. */
export function seedSequenceState64(entropy: (number | bigint)[], n: number): bigint[] {
  const w = seedSequenceState(entropy, 2 * n);
  return Array.from({ length: n }, (_, j) => BigInt(w[2 * j]) | (BigInt(w[2 * j + 1]) << 32n));
}

const PCG_MULT = 0x2360ed051fc65da44385df649fccf645n;

/** numpy's PCG64 (pcg64.h: 128-bit LCG, XSL-RR output), seeded as `PCG64(SeedSequence(entropy))`. */
export class PCG64 {
  state: bigint;
  inc: bigint;

  constructor(entropy: (number | bigint)[]) {
    const [s0, s1, i0, i1] = seedSequenceState64(entropy, 4);
    const initstate = (s0 << 64n) | s1, initseq = (i0 << 64n) | i1;
    // pcg_setseq_128_srandom_r
    this.state = 0n;
    this.inc = ((initseq << 1n) | 1n) & M128;
    this.step();
    this.state = (this.state + initstate) & M128;
    this.step();
  }

  private step(): void { this.state = (this.state * PCG_MULT + this.inc) & M128; }

  /** next_uint64: step, then XSL-RR of the new state. */
  nextUint64(): bigint {
    this.step();
    const s = this.state;
    const x = ((s >> 64n) ^ s) & M64;
    const rot = Number(s >> 122n);
    return ((x >> BigInt(rot)) | (x << BigInt((64 - rot) & 63))) & M64;
  }

  /** Generator.random(): (next_uint64 >> 11) * 2**-53. */
  random(): number { return Number(this.nextUint64() >> 11n) * 2 ** -53; }
}

/** The uniform draw for answer position `index` of a request seeded `seed`:
 * `np.random.default_rng((seed_key(seed), index)).random()`. */
export function positionUniform(seed: number | bigint, index: number): number {
  return new PCG64([seedKey(seed), BigInt(index)]).random();
}

/** numpy's float64 `sum` of a contiguous array: pairwise summation (blocks of 128, 8 accumulators;
 * numpy/_core/src/umath/loops_utils.h.src `DOUBLE_pairwise_sum`), added to 0. */
export function pairwiseSum(a: ArrayLike<number>, start = 0, n = a.length - start): number {
  if (n < 8) {
    let res = 0;
    for (let i = 0; i < n; i++) res += a[start + i];
    return res;
  }
  if (n <= 128) {
    const r = [a[start], a[start + 1], a[start + 2], a[start + 3], a[start + 4], a[start + 5], a[start + 6], a[start + 7]];
    let i = 8;
    for (; i < n - (n % 8); i += 8) for (let j = 0; j < 8; j++) r[j] += a[start + i + j];
    let res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; i++) res += a[start + i];
    return res;
  }
  let n2 = Math.floor(n / 2);
  n2 -= n2 % 8;
  return pairwiseSum(a, start, n2) + pairwiseSum(a, start + n2, n - n2);
}

/** decoding.top_p_keep: ids of the shortest prefix, in decreasing probability (ties: lower id
 * first), whose sequential cumulative sum reaches `topP` (searchsorted left). As in Python only a
 * head of that order is sorted: the ids with p >= a threshold (every other id is strictly less
 * likely, so they are the head of the full order and their cumulative sums are the same); when
 * their mass stays below topP the threshold is lowered, down to the whole vocabulary. */
export function topPKeep(p: Float64Array, topP: number): number[] {
  let top = 0;
  for (let i = 0; i < p.length; i++) if (p[i] > top) top = p[i];
  for (let tau = top * 2 ** -16; ; tau = tau > 1e-300 ? tau * 2 ** -32 : 0) {
    const cand: number[] = [];
    for (let i = 0; i < p.length; i++) if (p[i] >= tau) cand.push(i);
    cand.sort((a, b) => p[b] - p[a] || a - b);
    let cum = 0;
    for (let n = 0; n < cand.length; n++) {
      cum += p[cand[n]];
      if (cum >= topP) return cand.slice(0, n + 1);
    }
    if (tau === 0) return cand; // never reached: all are kept (searchsorted gives the length)
  }
}

/** decoding.draw: inverse CDF of `p` (cumsum, divided by its last entry) at `u`, searchsorted right. */
export function drawIndex(p: Float64Array, u: number): number {
  const cdf = new Float64Array(p.length);
  let c = 0;
  for (let i = 0; i < p.length; i++) { c += p[i]; cdf[i] = c; }
  const last = cdf[cdf.length - 1];
  let lo = 0, hi = cdf.length;
  while (lo < hi) { // first i with cdf[i] / last > u
    const mid = (lo + hi) >>> 1;
    if (cdf[mid] / last <= u) lo = mid + 1; else hi = mid;
  }
  return lo;
}

export interface SamplingOptions {
  temperature: number;
  topK?: number;
  topP?: number;
  /** request seed in [-2**63, 2**63-1]; null/undefined: Math.random (not reproducible). */
  seed?: number | bigint | null;
}

/** The probabilities decoding._pick draws from (float64 [vocab]), after temperature, top-k and top-p. */
export function samplingProbs(logits: ArrayLike<number>, temperature: number, topK = 0, topP = 1): Float64Array {
  const v = logits.length;
  const x = new Float64Array(v);
  for (let i = 0; i < v; i++) {
    if (Number.isNaN(logits[i])) throw new RangeError("the logits hold NaN values");
    x[i] = logits[i] / temperature;
  }
  if (topK > 0 && topK < v) {
    const s = Float64Array.from(x).sort();
    const kth = s[v - topK];
    for (let i = 0; i < v; i++) if (x[i] < kth) x[i] = -Infinity;
  }
  let top = -Infinity;
  for (let i = 0; i < v; i++) if (x[i] > top) top = x[i];
  let p = new Float64Array(v);
  if (top === Infinity) for (let i = 0; i < v; i++) p[i] = x[i] === Infinity ? 1 : 0;
  else if (top === -Infinity) throw new RangeError("every token's logit is -inf: nothing to sample");
  else for (let i = 0; i < v; i++) p[i] = Math.exp(x[i] - top);
  const z = pairwiseSum(p);
  for (let i = 0; i < v; i++) p[i] /= z;
  if (topP < 1) {
    const q = new Float64Array(v);
    for (const i of topPKeep(p, topP)) q[i] = p[i];
    const z2 = pairwiseSum(q);
    for (let i = 0; i < v; i++) q[i] /= z2;
    p = q;
  }
  return p;
}

/** decoding.sample without logit adjustments: greedy (argmax) below SAMPLING_EPS, else softmax of
 * logits / T filtered by top-k then top-p, drawn at answer position `index` with numpy's
 * `default_rng((seed_key(seed), index))` (Math.random without a seed). */
export function sampleToken(logits: Float32Array, o: SamplingOptions, index: number): number {
  if (o.temperature < SAMPLING_EPS) {
    for (let i = 0; i < logits.length; i++) if (Number.isNaN(logits[i])) throw new RangeError("the logits hold NaN values");
    return argmax(logits);
  }
  const p = samplingProbs(logits, o.temperature, o.topK ?? 0, o.topP ?? 1);
  const u = o.seed === null || o.seed === undefined ? Math.random() : positionUniform(o.seed, index);
  return drawIndex(p, u);
}
