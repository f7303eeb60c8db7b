/** The device engine in Node: a model folder on onnxruntime-node (CPU execution provider). */
import fs from "node:fs";
import path from "node:path";
import * as ort from "onnxruntime-node";
import { OnnxEngine, type ModelConfig } from "./engine.js";
import { DEFAULT_ONNX } from "./model.js";

export async function loadEngine(dir: string, opt: { onnx?: string; threads?: number } = {}): Promise<OnnxEngine> {
  const cfg = JSON.parse(fs.readFileSync(path.join(dir, "config.json"), "utf8")) as ModelConfig;
  const mf = path.join(dir, "manifest.json");
  const manifest = fs.existsSync(mf) ? JSON.parse(fs.readFileSync(mf, "utf8")) : {};
  const file = path.join(dir, opt.onnx ?? manifest.default_onnx ?? DEFAULT_ONNX);
  return OnnxEngine.create(ort as never, file, cfg, manifest.model_fingerprint ?? "", {
    intraOpNumThreads: opt.threads ?? 1, interOpNumThreads: 1, graphOptimizationLevel: "all", executionProviders: ["cpu"],
  }, file);
}
