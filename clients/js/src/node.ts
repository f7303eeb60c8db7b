/** The Node platform: `ws` websockets, the device model in a cache folder, onnxruntime-node. */
import fs from "node:fs";
import path from "node:path";
import "./socket-node.js"; // Connection.defaultDial = ws
import { loadEngine } from "./engine-node.js";
import { cachedDeviceModel } from "./model-node.js";
import { askDeviceModelBase, SplitClient, type ClientOptions } from "./split.js";
import { Tokenizer } from "./tokenizer.js";

/** The tokenizer `relayinfer export` wrote into `dir` (tokenizer.json, tokenizer_meta.json). */
export function loadTokenizer(dir: string): Tokenizer {
  return new Tokenizer(JSON.parse(fs.readFileSync(path.join(dir, "tokenizer.json"), "utf8")),
    JSON.parse(fs.readFileSync(path.join(dir, "tokenizer_meta.json"), "utf8")));
}

export class DeviceClient extends SplitClient {
  /** Load the device model (from `modelDir`, else fetched from the cloud the Welcome names). */
  static async create(opt: ClientOptions): Promise<DeviceClient> {
    let dir = opt.modelDir;
    if (!dir) {
      if (!opt.cloudUrl) throw new Error("no modelDir and no cloudUrl to fetch the device model from");
      const base = await askDeviceModelBase(opt);
      if (!base) throw new Error(`the cloud at ${opt.cloudUrl} serves no device model`);
      dir = (await cachedDeviceModel(base, { token: opt.token, cacheDir: opt.cacheDir })).dir;
    }
    const engine = await loadEngine(dir, { threads: opt.threads });
    return new DeviceClient(engine, loadTokenizer(dir), opt);
  }
}
