/**
 * The device runtime: the exported Llama (format 4) on ONNX Runtime (onnxruntime-node in Node,
 * onnxruntime-web's WASM backend in the browser: the module is passed in, see engine-node.ts and
 * web/src/runtime.ts).
 *
 * Inputs: input_ids int64 [1, S], position_ids int64 [1, S], seqlens_k int32 [1] (= total - 1),
 * total_sequence_length int32 [] (= cached + S), past_key.i / past_value.i float32
 * [1, kv_heads, past, head_dim] per layer; outputs: logits float32 [1, vocab] (last position only),
 * present_key.i / present_value.i. The Python engine binds past and present to one buffer of
 * `capacity` slots (GroupQueryAttention's shared buffer); here past is the exact cached length and
 * ORT returns present = past + the new tokens (a copy per step, simpler and the same numbers).
 */
import type { InferenceSession, Tensor } from "onnxruntime-common";
import type { OrtModule } from "./platform.js";

export interface ModelConfig {
  n_layers: number; n_kv_heads: number; dim: number; n_heads: number; vocab_size: number;
  context_length: number; bos_id: number; eos_id: number; head_dim_kv?: number;
}

/** The cache after `length` tokens: per layer (key, value) tensors [1, kv_heads, length, head_dim]. */
export interface KV { tensors: Tensor[]; length: number }

/** A device profile's pacing (relayinfer.device.profiles.PacedEngine): each call lasts at least
 * prefillMsBase + prefillMsPerToken x tokens (ms). */
export interface Pace { prefillMsBase?: number; prefillMsPerToken: number }

export class OnnxEngine {
  readonly cfg: ModelConfig;
  readonly headDim: number;
  readonly eosId: number;
  readonly contextLength: number;
  readonly fingerprint: string;
  pace: Pace | null = null;
  constructor(private ort: OrtModule, private session: InferenceSession, cfg: ModelConfig, fingerprint: string) {
    this.cfg = cfg;
    this.headDim = cfg.head_dim_kv || cfg.dim / cfg.n_heads;
    this.eosId = cfg.eos_id;
    this.contextLength = cfg.context_length;
    this.fingerprint = fingerprint;
  }

  /** An engine over a session created from `ort` (`model`: the ONNX file's bytes or path). */
  static async create(ort: OrtModule, model: Uint8Array | string, cfg: ModelConfig, fingerprint: string,
    options: InferenceSession.SessionOptions, name = "the device model"): Promise<OnnxEngine> {
    const session = typeof model === "string" ? await ort.InferenceSession.create(model, options) : await ort.InferenceSession.create(model, options);
    if (!session.inputNames.includes("position_ids") || !session.inputNames.includes("past_key.0")) {
      await session.release();
      throw new Error(`${name} is not a format-4 device model; export it again`);
    }
    return new OnnxEngine(ort, session, cfg, fingerprint);
  }

  get vocabSize(): number { return this.cfg.vocab_size; }

  newCache(): KV {
    const t: Tensor[] = [];
    for (let i = 0; i < 2 * this.cfg.n_layers; i++) t.push(new this.ort.Tensor("float32", new Float32Array(0), [1, this.cfg.n_kv_heads, 0, this.headDim]));
    return { tensors: t, length: 0 };
  }

  /** Run `ids` after the cached tokens; returns the last position's logits and the longer cache. */
  async prefill(ids: number[], kv: KV | null = null): Promise<{ logits: Float32Array; kv: KV }> {
    if (!ids.length) throw new Error("prefill of no tokens");
    const t0 = performance.now();
    const cache = kv ?? this.newCache();
    const s = ids.length, total = cache.length + s;
    if (total > this.contextLength) throw new Error(`${cache.length} cached + ${s} new tokens exceed the context length ${this.contextLength}`);
    const ort = this.ort;
    const feeds: Record<string, Tensor> = {
      input_ids: new ort.Tensor("int64", BigInt64Array.from(ids, (x) => BigInt(x)), [1, s]),
      position_ids: new ort.Tensor("int64", BigInt64Array.from({ length: s }, (_, j) => BigInt(cache.length + j)), [1, s]),
      seqlens_k: new ort.Tensor("int32", Int32Array.of(total - 1), [1]),
      total_sequence_length: new ort.Tensor("int32", Int32Array.of(total), []),
    };
    for (let i = 0; i < this.cfg.n_layers; i++) {
      feeds[`past_key.${i}`] = cache.tensors[2 * i];
      feeds[`past_value.${i}`] = cache.tensors[2 * i + 1];
    }
    const out = await this.session.run(feeds);
    const lg = out.logits.data as Float32Array;
    const logits = lg.length === this.vocabSize ? lg : lg.subarray(lg.length - this.vocabSize);
    const tensors: Tensor[] = [];
    for (let i = 0; i < this.cfg.n_layers; i++) tensors.push(out[`present_key.${i}`], out[`present_value.${i}`]);
    if (this.pace) {
      const want = (this.pace.prefillMsBase ?? 0) + this.pace.prefillMsPerToken * s;
      const left = want - (performance.now() - t0);
      if (left > 0) await new Promise((r) => setTimeout(r, left));
    }
    return { logits, kv: { tensors, length: total } };
  }

  decode(token: number, kv: KV): Promise<{ logits: Float32Array; kv: KV }> {
    return this.prefill([token], kv);
  }

  async release(): Promise<void> { await this.session.release(); }
}

/** The first index of the largest logit (numpy's argmax; NaN is refused). */
export function argmax(x: Float32Array): number {
  let best = 0, bv = -Infinity;
  for (let i = 0; i < x.length; i++) {
    const v = x[i];
    if (v !== v) throw new RangeError("the logits hold NaN");
    if (v > bv) { bv = v; best = i; }
  }
  return best;
}
