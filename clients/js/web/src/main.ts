/**
 * The demo page (`relayinfer cloud serve --web`, /web/): the websocket port from /web/config.json,
 * the model fingerprint from /healthz (the token: `#token=...` in the URL), the device model from
 * the cloud, then a chat box whose answers show cloud tokens and device tokens in two colours, with
 * TTFT, TPOT and the hand-off index. Query parameters preset the controls: mode, max, budget, pace,
 * tpot, threads, onnx (the device file; default model.fp32.onnx when served, see client.ts). For tests: `window.relayinfer` ({ready, error, results, last, busy, bench}) and the
 * last answer's token ids in `#log[data-token-ids]`.
 */
import type { GenerationResult, Mode, TokenEvent, SplitClient } from "../../src/split.js";
import { argmax } from "../../src/engine.js";
import { createBrowserClient } from "./client.js";

interface PageState {
  ready: boolean; busy: boolean; error: string | null; results: GenerationResult[]; last: GenerationResult | null;
  fingerprint: string | null; onnx: string | null; threads: number | null; loadMs: number | null; wsUrl: string | null;
  bench?: (tokens?: number, reps?: number) => Promise<{ runtime: string; onnx: string | null; tokens: number; reps: number; prompt_tokens: number; threads: number; tok_s_median: number; tok_s: number[] }>;
}
const state: PageState = { ready: false, busy: false, error: null, results: [], last: null, fingerprint: null, onnx: null, threads: null, loadMs: null, wsUrl: null };
(globalThis as unknown as { relayinfer: PageState }).relayinfer = state;

const $ = <T extends HTMLElement>(id: string) => document.getElementById(id) as T;
const status = (text: string, error = false) => { const s = $("status"); s.textContent = text; s.className = error ? "error" : ""; };
const params = new URLSearchParams(location.search);
const token = new URLSearchParams(location.hash.slice(1)).get("token");
const auth: Record<string, string> = token ? { Authorization: `Bearer ${token}` } : {};

for (const k of ["max", "budget", "pace", "tpot"]) if (params.has(k)) ($(k) as HTMLInputElement).value = params.get(k)!;
if (params.has("mode")) for (const r of document.querySelectorAll<HTMLInputElement>("input[name=mode]")) r.checked = r.value === params.get("mode");

const num = (id: string): number | null => { const v = ($(id) as HTMLInputElement).value.trim(); return v === "" ? null : Number(v); };
const mode = (): Mode => (document.querySelector<HTMLInputElement>("input[name=mode]:checked")!.value as Mode);

async function start(): Promise<SplitClient> {
  const cfg = await (await fetch("config.json")).json() as { ws_port: number; ws_scheme: string };
  const host = location.hostname.includes(":") ? `[${location.hostname}]` : location.hostname;
  const wsUrl = `${cfg.ws_scheme}://${host}:${cfg.ws_port}`;
  state.wsUrl = wsUrl;
  const hz = await (await fetch("/healthz", { headers: auth })).json() as { status: string; model_fingerprint?: string };
  if (!hz.model_fingerprint) throw new Error("/healthz names no model fingerprint: this cloud wants a token (open the page as /web/#token=...)");
  state.fingerprint = hz.model_fingerprint;
  let last = 0;
  const { client, model, onnx, threads, loadMs } = await createBrowserClient({
    cloudUrl: wsUrl, token, httpBase: location.origin, threads: params.has("threads") ? Number(params.get("threads")) : undefined,
    onnx: params.get("onnx") ?? undefined,
    progress: (name, done, total, cached) => {
      const now = performance.now();
      if (now - last > 200 || done === total) { last = now; status(`${cached ? "from the cache" : "downloading"} ${name}: ${(done / 1e6).toFixed(0)}${total ? ` / ${(total / 1e6).toFixed(0)}` : ""} MB`); }
    },
  });
  if (model.manifest.model_fingerprint !== hz.model_fingerprint) {
    throw new Error(`the device model's fingerprint ${model.manifest.model_fingerprint.slice(0, 16)} is not the cloud's ${hz.model_fingerprint.slice(0, 16)}`);
  }
  state.threads = threads; state.loadMs = loadMs; state.onnx = onnx;
  status(`ready: model ${hz.model_fingerprint.slice(0, 16)} (${onnx}), onnxruntime-web WASM, ${threads} thread${threads > 1 ? "s" : ""}${globalThis.crossOriginIsolated ? "" : " (not cross-origin isolated)"}, session in ${loadMs.toFixed(0)} ms; cloud ${wsUrl}`);
  return client;
}

function statsLine(r: GenerationResult): string {
  const where = r.handoff_index !== null ? `hand-off at token ${r.handoff_index}` : r.mode === "device-only" ? "device only" : "cloud only";
  return `${r.mode}: ${where} · ${r.cloud_tokens} cloud + ${r.device_tokens} device tokens · TTFT ${r.ttft_ms.toFixed(0)} ms · TPOT p50 ${r.tpot_ms_p50.toFixed(0)} ms, max ${r.tpot_ms_max.toFixed(0)} ms · ${r.finish_reason}${r.fault ? ` · fault ${r.fault}: ${r.error}` : ""}`;
}

async function send(client: SplitClient, text: string): Promise<void> {
  const log = $("log");
  const turn = document.createElement("div"); turn.className = "turn";
  const u = document.createElement("div"); u.className = "user"; u.textContent = `> ${text}`;
  const a = document.createElement("div");
  const st = document.createElement("div"); st.className = "stats"; st.textContent = "…";
  turn.append(u, a, st); log.append(turn);
  let prev: "cloud" | "device" | null = null;
  const r = await client.generate(text, {
    mode: mode(), maxNewTokens: num("max") ?? 64, cloudBudget: num("budget"),
    onToken: (ev: TokenEvent) => {
      const s = document.createElement("span");
      s.className = ev.source + (prev === "cloud" && ev.source === "device" ? " handoff" : "");
      s.textContent = ev.text; s.dataset.tokenId = String(ev.tokenId);
      a.append(s); prev = ev.source;
    },
  });
  st.textContent = statsLine(r);
  log.dataset.tokenIds = JSON.stringify(r.token_ids);
  state.results.push(r); state.last = r;
}

try {
  const client = await start();
  client.opt.targetTpotMs = num("tpot") ?? 50;
  const form = $("chat") as HTMLFormElement, input = $("prompt") as HTMLInputElement, button = $("send") as HTMLButtonElement;
  const apply = () => {
    client.opt.targetTpotMs = num("tpot") ?? 50;
    const pace = num("pace");
    client.engine.pace = pace ? { prefillMsPerToken: pace } : null;
  };
  apply();
  input.disabled = button.disabled = false;
  state.ready = true;
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const text = input.value.trim();
    if (!text || state.busy) return;
    input.value = ""; state.busy = true; button.disabled = true;
    try { apply(); await send(client, text); } catch (e) { state.error = String(e); status(String(e), true); }
    finally { state.busy = false; button.disabled = false; }
  });
  state.bench = async (tokens = 128, reps = 3) => { // decode tok/s, as bench/decode.ts
    const eng = client.engine, pace = eng.pace;
    eng.pace = null;
    const ids = client.tokenizer.encodeChat("Tell me a short story about a robot who learns to paint.");
    const rates: number[] = [];
    try {
      for (let i = 0; i < reps; i++) {
        let { logits, kv } = await eng.prefill(ids);
        const t0 = performance.now();
        for (let k = 0; k < tokens; k++) ({ logits, kv } = await eng.decode(argmax(logits), kv));
        rates.push(tokens / ((performance.now() - t0) / 1e3));
      }
    } finally { eng.pace = pace; }
    rates.sort((x, y) => x - y);
    return { runtime: "onnxruntime-web (wasm)", onnx: state.onnx, tokens, reps, prompt_tokens: ids.length, threads: state.threads!, tok_s_median: rates[reps >> 1], tok_s: rates };
  };
} catch (e) {
  state.error = e instanceof Error ? `${e.name}: ${e.message}` : String(e);
  status(state.error, true);
}
