// The demo page's bundle: web/dist/{index.html, app.js, ort-wasm-simd-threaded.{mjs,wasm}}.
//   node web/build.mjs        (npm run build:web)
import * as esbuild from "esbuild";
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));
const out = path.join(here, "dist");
fs.rmSync(out, { recursive: true, force: true });
fs.mkdirSync(out, { recursive: true });
await esbuild.build({
  entryPoints: [path.join(here, "src", "main.ts")], outfile: path.join(out, "app.js"),
  bundle: true, format: "esm", platform: "browser", target: "es2022", minify: true, sourcemap: false,
  conditions: ["onnxruntime-web-use-extern-wasm"], logLevel: "warning",
});
const ortDist = path.join(here, "..", "node_modules", "onnxruntime-web", "dist");
for (const f of ["ort-wasm-simd-threaded.wasm", "ort-wasm-simd-threaded.mjs"]) fs.copyFileSync(path.join(ortDist, f), path.join(out, f));
fs.copyFileSync(path.join(here, "index.html"), path.join(out, "index.html"));
const size = (f) => (fs.statSync(path.join(out, f)).size / 1e6).toFixed(2);
console.log(`wrote ${out}: app.js ${size("app.js")} MB, ort-wasm-simd-threaded.wasm ${size("ort-wasm-simd-threaded.wasm")} MB`);
