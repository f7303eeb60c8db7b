// Decode tok/s of onnxruntime-node on the device model (1 intra-op thread), greedy, after a prompt prefill.
//   node dist/bench/decode.js MODEL_DIR [tokens=128] [reps=3] [onnx file, default: the manifest's]
import { argmax } from "../src/engine.js";
import { loadEngine } from "../src/engine-node.js";
import { loadTokenizer } from "../src/node.js";

const [dir, nArg, repArg, onnx] = process.argv.slice(2);
const n = Number(nArg ?? 128), reps = Number(repArg ?? 3);
const eng = await loadEngine(dir, { threads: 1, onnx });
const ids = loadTokenizer(dir).encodeChat("Tell me a short story about a robot who learns to paint.");
const rates: number[] = [];
for (let r = 0; r < reps; r++) {
  let { logits, kv } = await eng.prefill(ids);
  const t0 = performance.now();
  for (let i = 0; i < n; i++) ({ logits, kv } = await eng.decode(argmax(logits), kv));
  rates.push(n / ((performance.now() - t0) / 1e3));
}
rates.sort((a, b) => a - b);
console.log(JSON.stringify({ runtime: "onnxruntime-node", onnx: onnx ?? "default", tokens: n, reps, prompt_tokens: ids.length, tok_s_median: rates[reps >> 1], tok_s: rates }));
await eng.release();
