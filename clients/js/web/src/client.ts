/**
 * The split client in the browser: the same SplitClient as in Node over onnxruntime-web's WASM
 * backend (threads only when the page is cross-origin isolated, else 1), the page's WebSocket and
 * the device model from Cache Storage.
 */
import * as ort from "onnxruntime-web/wasm";
import { OnnxEngine, type ModelConfig } from "../../src/engine.js";
import { browserDial } from "../../src/socket-web.js";
import { Connection } from "../../src/session.js";
import { SplitClient, type ClientOptions } from "../../src/split.js";
import { Tokenizer, type TokenizerMeta } from "../../src/tokenizer.js";
import { DEFAULT_ONNX, fetchManifest, type Manifest } from "../../src/model.js";
import { loadDeviceModel, type DeviceModel, type Progress } from "./store.js";

Connection.defaultDial = browserDial;

export interface BrowserOptions extends ClientOptions {
  /** http(s)://HOST:PORT of the cloud's HTTP side (the device model). */
  httpBase: string;
  /** intra-op threads; default 1, or up to 4 when crossOriginIsolated (SharedArrayBuffer). */
  threads?: number;
  /** the ONNX file (default: wasmOnnx(manifest)). */
  onnx?: string;
  progress?: Progress;
}

/** The ONNX file to run on the WASM backend: model.fp32.onnx when the cloud serves it (its
 * MatMulNBits kernels are ~8x slower than fp32 MatMul on WASM: 2.3 vs 17.8 tok/s here), else the
 * manifest's default. The fingerprint is the GGUF's either way (fp32 = its dequantized weights). */
export function wasmOnnx(m: Manifest): string {
  return m.files[FP32_ONNX] ? FP32_ONNX : (m.default_onnx ?? DEFAULT_ONNX);
}
export const FP32_ONNX = "model.fp32.onnx";

/** The threads onnxruntime-web may use here. */
export function wasmThreads(want?: number): number {
  if (!globalThis.crossOriginIsolated) return 1;
  return Math.max(1, Math.min(want ?? 4, navigator.hardwareConcurrency || 1));
}

export async function createBrowserClient(opt: BrowserOptions): Promise<{ client: SplitClient; model: DeviceModel; onnx: string; threads: number; loadMs: number }> {
  const here = new URL(".", import.meta.url).href;
  const threads = wasmThreads(opt.threads);
  ort.env.wasm.numThreads = threads;
  ort.env.wasm.wasmPaths = { wasm: `${here}ort-wasm-simd-threaded.wasm`, mjs: `${here}ort-wasm-simd-threaded.mjs` };
  const onnx = opt.onnx ?? wasmOnnx(await fetchManifest(opt.httpBase, opt.token ?? null));
  const model = await loadDeviceModel(opt.httpBase, opt.token ?? null, { onnx, progress: opt.progress });
  const t0 = performance.now();
  const engine = await OnnxEngine.create(ort as never, model.onnx, model.config as unknown as ModelConfig, model.manifest.model_fingerprint, {
    executionProviders: ["wasm"], graphOptimizationLevel: "all", intraOpNumThreads: threads, interOpNumThreads: 1,
  }, onnx);
  const loadMs = performance.now() - t0;
  model.onnx = new Uint8Array(0); // the session holds its own copy
  const tok = new Tokenizer(model.tokenizer, model.tokenizerMeta as unknown as TokenizerMeta);
  return { client: new SplitClient(engine, tok, { ...opt, dial: browserDial }), model, onnx, threads, loadMs };
}
