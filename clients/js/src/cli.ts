#!/usr/bin/env node
/**
 * relayinfer-device-js: run prompts through the split loop and print one JSON line per answer
 * (GenerationResult fields); with --events also {"event": TokenEvent} lines as tokens are shown.
 *
 *   node dist/src/cli.js --cloud ws://127.0.0.1:PORT --prompts prompts.json [--mode split|device-only|cloud-only]
 *     [--budget N] [--max-new N] [--tpot MS] [--prefill-ms-per-token MS] [--model-dir DIR] [--cache DIR]
 *     [--token T] [--threads N] [--events]
 *     [--temperature T] [--top-p P] [--top-k K] [--seed S]
 *
 * Sampling as the Python device (decoding.sample): with --seed an answer is token for token the
 * Python device's. --presence-penalty, --frequency-penalty, --repetition-penalty, --min-tokens,
 * --logit-bias and --grammar are refused by name (the JS device does not apply them); so is any
 * other unknown flag.
 *
 * prompts.json: a JSON array; each item a user string, a list of {role, content} messages, or token ids.
 */
import fs from "node:fs";
import { DeviceClient } from "./node.js";
import type { Mode } from "./split.js";

const KNOWN = ["cloud", "prompts", "mode", "budget", "max-new", "tpot", "prefill-ms-per-token", "model-dir", "cache", "token",
  "threads", "events", "tokenize-only", "temperature", "top-p", "top-k", "seed"];
const REFUSED = ["presence-penalty", "frequency-penalty", "repetition-penalty", "min-tokens", "logit-bias", "grammar"];

function args(argv: string[]): Record<string, string | boolean> {
  const out: Record<string, string | boolean> = {};
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    if (!a.startsWith("--")) throw new Error(`unexpected argument ${a}`);
    const k = a.slice(2);
    if (REFUSED.includes(k)) throw new Error(`--${k} is not supported by the JS device (it would not be applied)`);
    if (!KNOWN.includes(k)) throw new Error(`unknown option --${k}`);
    if (k === "events" || k === "tokenize-only") out[k] = true;
    else out[k] = argv[++i];
  }
  return out;
}

const a = args(process.argv.slice(2));
const num = (k: string) => {
  if (a[k] === undefined) return undefined;
  const v = Number(a[k]);
  if (a[k] === "" || !Number.isFinite(v)) throw new Error(`--${k} must be a number, got ${String(a[k])}`);
  return v;
};
const seed = a.seed === undefined ? null : /^-?\d+$/.test(a.seed as string) ? BigInt(a.seed as string) : (() => { throw new Error(`--seed must be an integer, got ${String(a.seed)}`); })();
const write = (o: unknown) => process.stdout.write(JSON.stringify(o) + "\n");

const client = await DeviceClient.create({
  cloudUrl: (a.cloud as string) || null, token: (a.token as string) || null, modelDir: a["model-dir"] as string | undefined,
  cacheDir: a.cache as string | undefined, threads: num("threads"), targetTpotMs: num("tpot"),
  pace: a["prefill-ms-per-token"] !== undefined ? { prefillMsPerToken: num("prefill-ms-per-token")! } : null,
});
const prompts = JSON.parse(fs.readFileSync(a.prompts as string, "utf8"));
try {
  for (const p of prompts) {
    if (a["tokenize-only"]) { write({ prompt_ids: client.tokenizer.encodeChat(p) }); continue; }
    const r = await client.generate(p, {
      maxNewTokens: num("max-new") ?? 64, temperature: num("temperature"), topP: num("top-p"), topK: num("top-k"), seed, mode: (a.mode as Mode) || undefined, cloudBudget: num("budget") ?? null,
      onToken: a.events ? (ev) => write({ event: ev }) : undefined,
    });
    write(r);
  }
} finally {
  await client.close();
  await client.engine.release();
}
