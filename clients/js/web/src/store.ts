/**
 * The device model in the browser: the cloud's manifest, each file by `fetch` (the token as a
 * bearer header), checked by `crypto.subtle` sha256, kept in Cache Storage under a key that names
 * its sha256 (a file is checked again when read back; a mismatch is dropped and downloaded anew).
 */
import { deviceFiles, fetchChecked, fetchManifest, FORMAT_VERSION, ModelFileError, type Manifest } from "../../src/model.js";
import { hex } from "../../src/platform.js";

export const CACHE_NAME = "relayinfer-device-model";

export interface Progress { (name: string, done: number, total: number, fromCache: boolean): void }

async function sha256(buf: ArrayBuffer): Promise<string> {
  if (!globalThis.crypto?.subtle) throw new ModelFileError("crypto.subtle is missing: serve the page over https:// or from localhost / 127.0.0.1 (a secure context)");
  return hex(await crypto.subtle.digest("SHA-256", buf));
}

async function openCache(): Promise<Cache | null> {
  try { return typeof caches === "undefined" ? null : await caches.open(CACHE_NAME); } catch { return null; }
}

async function download(url: string, token: string | null, name: string, progress?: Progress): Promise<ArrayBuffer> {
  const r = await fetchChecked(url, token, 300000);
  const total = Number(r.headers.get("content-length") ?? 0);
  const reader = r.body!.getReader();
  const parts: Uint8Array[] = [];
  let done = 0;
  for (;;) {
    const { done: end, value } = await reader.read();
    if (end) break;
    parts.push(value); done += value.length;
    progress?.(name, done, total, false);
  }
  const out = new Uint8Array(done);
  let o = 0;
  for (const p of parts) { out.set(p, o); o += p.length; }
  return out.buffer;
}

/** One device file's bytes, sha256-checked (`want`), from the cache or the cloud. */
export async function deviceFile(base: string, name: string, want: string, token: string | null, progress?: Progress): Promise<ArrayBuffer> {
  const url = `${base}/v1/device-model/${encodeURIComponent(name)}`;
  const key = `${url}?sha256=${want}`;
  const cache = await openCache();
  const hit = cache ? await cache.match(key) : undefined;
  if (hit) {
    const buf = await hit.arrayBuffer();
    if (await sha256(buf) === want) { progress?.(name, buf.byteLength, buf.byteLength, true); return buf; }
    await cache!.delete(key);
  }
  const buf = await download(url, token, name, progress);
  const got = await sha256(buf);
  if (got !== want) throw new ModelFileError(`sha256 mismatch for ${name}: got ${got.slice(0, 16)}..., manifest says ${want.slice(0, 16)}...`);
  if (cache) {
    try { await cache.put(key, new Response(buf)); } catch (e) { console.warn(`not cached (${name}): ${(e as Error).message}`); }
  }
  return buf;
}

export interface DeviceModel { manifest: Manifest; onnx: Uint8Array; config: Record<string, unknown>; tokenizer: Record<string, unknown>; tokenizerMeta: Record<string, unknown> }

/** The cloud's device model (manifest, ONNX file, config, tokenizer), format FORMAT_VERSION. */
export async function loadDeviceModel(base: string, token: string | null, opt: { onnx?: string; progress?: Progress } = {}): Promise<DeviceModel> {
  const m = await fetchManifest(base, token);
  if ((m.format_version ?? 1) !== FORMAT_VERSION) {
    throw new ModelFileError(`the service at ${base} serves device-model format ${m.format_version ?? 1}; this device runs format ${FORMAT_VERSION}`);
  }
  const [onnxName, ...side] = deviceFiles(m, opt.onnx);
  const get = (n: string) => {
    const want = m.files[n];
    if (!want) throw new ModelFileError(`the service's manifest lists no ${JSON.stringify(n)}`);
    return deviceFile(base, n, want, token, opt.progress);
  };
  const json = async (n: string) => JSON.parse(new TextDecoder().decode(await get(n)));
  const [config, tokenizer, tokenizerMeta] = await Promise.all(side.map(json));
  const onnx = new Uint8Array(await get(onnxName));
  return { manifest: m, onnx, config, tokenizer, tokenizerMeta };
}
