/** The device model from the cloud into a cache folder (Node): sha256 streamed while writing. */
import { createHash } from "node:crypto";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { deviceFiles, fetchManifest, FORMAT_VERSION, fetchChecked, ModelFileError, type FetchOptions, type Manifest } from "./model.js";

export function fileSha256(file: string): Promise<string> {
  return new Promise((resolve, reject) => {
    const h = createHash("sha256");
    fs.createReadStream(file).on("data", (c) => h.update(c)).on("end", () => resolve(h.digest("hex"))).on("error", reject);
  });
}

export function defaultCacheDir(): string {
  return process.env.RELAYINFER_JS_CACHE || path.join(os.homedir(), ".cache", "relayinfer-js");
}

/** Download `name` into `dir` (through `.name.part`), streaming it through sha256; the file is
 * moved in place only when the digest equals `want` (else the part is deleted and this throws). */
async function downloadFile(base: string, dir: string, name: string, want: string, opt: FetchOptions): Promise<void> {
  const r = await fetchChecked(`${base}/v1/device-model/${encodeURIComponent(name)}`, opt.token, opt.timeoutMs ?? 120000);
  const total = Number(r.headers.get("content-length") ?? 0);
  const tmp = path.join(dir, `.${name}.part`);
  const h = createHash("sha256");
  const out = fs.createWriteStream(tmp);
  let done = 0;
  try {
    const reader = r.body!.getReader();
    for (;;) {
      const { done: end, value } = await reader.read();
      if (end) break;
      h.update(value);
      done += value.length;
      if (!out.write(value)) await new Promise<void>((res) => out.once("drain", () => res()));
      opt.progress?.(name, done, total);
    }
  } finally {
    await new Promise<void>((res, rej) => { out.once("error", rej); out.end(() => res()); });
  }
  const got = h.digest("hex");
  if (got !== want) {
    fs.rmSync(tmp, { force: true });
    throw new ModelFileError(`sha256 mismatch for ${name}: got ${got.slice(0, 16)}..., manifest says ${want.slice(0, 16)}...`);
  }
  fs.renameSync(tmp, path.join(dir, name));
}

/** Download the device files listed by the manifest into `dir`, skipping files already there with
 * the right sha256; writes manifest.json last. Returns `dir`. */
export async function downloadDeviceModel(base: string, dir: string, opt: FetchOptions = {}, manifest?: Manifest): Promise<string> {
  const m = manifest ?? await fetchManifest(base, opt.token);
  fs.mkdirSync(dir, { recursive: true });
  for (const name of deviceFiles(m, opt.onnx)) {
    const want = m.files[name];
    if (!want) throw new ModelFileError(`the service's manifest lists no ${JSON.stringify(name)}`);
    if (name.includes("/") || name.includes("\\") || name.startsWith(".")) throw new ModelFileError(`bad file name ${JSON.stringify(name)}`);
    const f = path.join(dir, name);
    if (fs.existsSync(f) && await fileSha256(f) === want) continue;
    await downloadFile(base, dir, name, want, opt);
  }
  fs.writeFileSync(path.join(dir, "manifest.json"), JSON.stringify(m));
  return dir;
}

/** The cloud's device model in the cache (`<cache>/models/<first 16 hex of the fingerprint>/onnx-v4`),
 * downloaded when missing or different. Throws ModelFileError on another format version. */
export async function cachedDeviceModel(base: string, opt: FetchOptions = {}): Promise<{ dir: string; manifest: Manifest }> {
  const m = await fetchManifest(base, opt.token, Math.min(opt.timeoutMs ?? 30000, 30000));
  const fp = m.model_fingerprint;
  if (!/^[0-9a-f]{16,}$/.test(fp)) throw new ModelFileError(`bad model_fingerprint ${JSON.stringify(fp.slice(0, 40))} in ${base}/v1/device-model/manifest`);
  if ((m.format_version ?? 1) !== FORMAT_VERSION) {
    throw new ModelFileError(`the service at ${base} serves device-model format ${m.format_version ?? 1}; this device runs format ${FORMAT_VERSION}`);
  }
  const dir = path.join(opt.cacheDir ?? defaultCacheDir(), "models", fp.slice(0, 16), `onnx-v${FORMAT_VERSION}`);
  const have = path.join(dir, "manifest.json");
  if (fs.existsSync(have) && fs.readFileSync(have, "utf8") === JSON.stringify(m) &&
      deviceFiles(m, opt.onnx).every((n) => fs.existsSync(path.join(dir, n)))) {
    return { dir, manifest: m };
  }
  await downloadDeviceModel(base, dir, opt, m);
  return { dir, manifest: m };
}
