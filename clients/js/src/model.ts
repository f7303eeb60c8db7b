/**
 * The device model from the cloud: `GET <base>/v1/device-model/manifest` ({files: {name: sha256},
 * model_fingerprint, format_version, default_onnx}), then each file at
 * `<base>/v1/device-model/<name>`, checked by sha256 and cached: in a folder in Node (model-node.ts),
 * in Cache Storage in the browser (web/src/store.ts). This module is shared by both.
 */
import { RemoteError } from "./errors.js";

/** The device-model format this client runs (relayinfer.device.onnx_engine.FORMAT_VERSION). */
export const FORMAT_VERSION = 4;
export const DEFAULT_ONNX = "model.gguf.onnx";

export interface Manifest {
  files: Record<string, string>;
  model_fingerprint: string;
  format_version?: number;
  default_onnx?: string;
  model_file?: string;
}

export class ModelFileError extends Error {
  constructor(message: string) { super(message); this.name = "ModelFileError"; }
}

export interface FetchOptions {
  token?: string | null;
  /** cache root (Node; default $RELAYINFER_JS_CACHE or ~/.cache/relayinfer-js) */
  cacheDir?: string;
  /** onnx file (default: the manifest's default_onnx, else model.gguf.onnx) */
  onnx?: string;
  timeoutMs?: number;
  progress?: (name: string, done: number, total: number) => void;
}

function headers(token?: string | null): Record<string, string> {
  return token ? { Authorization: `Bearer ${token}` } : {};
}

export async function fetchChecked(url: string, token: string | null | undefined, timeoutMs: number): Promise<Response> {
  const r = await fetch(url, { headers: headers(token), signal: AbortSignal.timeout(timeoutMs) });
  if (r.status === 401 || r.status === 403) {
    throw new RemoteError("unauthorized", `${url} refused the ${token ? "token" : "request without a token"} (HTTP ${r.status})`);
  }
  if (!r.ok) throw new ModelFileError(`${url}: HTTP ${r.status} ${await r.text().catch(() => "")}`.trim());
  return r;
}

/** The cloud's device-model manifest. `base`: http(s)://HOST:PORT. */
export async function fetchManifest(base: string, token?: string | null, timeoutMs = 30000): Promise<Manifest> {
  const m = await (await fetchChecked(`${base}/v1/device-model/manifest`, token, timeoutMs)).json() as Manifest;
  if (!m || typeof m !== "object" || !m.model_fingerprint || typeof m.files !== "object") {
    throw new ModelFileError(`${base}/v1/device-model/manifest names no model_fingerprint or files`);
  }
  return m;
}

/** The files a device needs: the ONNX model, config.json, tokenizer.json, tokenizer_meta.json. */
export function deviceFiles(m: Manifest, onnx?: string): string[] {
  return [onnx ?? m.default_onnx ?? DEFAULT_ONNX, "config.json", "tokenizer.json", "tokenizer_meta.json"];
}
