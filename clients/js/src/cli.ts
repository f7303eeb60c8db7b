#!/usr/bin/env node
/**
 * relayinfer-device-js: run prompts through the split loop and print one JSON line per answer
 * (GenerationResult fields); with --events also {"event": TokenEvent} lines as tokens are shown.
 *
 *   node dist/src/cli.js --cloud ws://127.0.0.1:PORT --prompts prompts.json [--mode split|device-only|cloud-only]
 *     [--budget N] [--max-new N] [--tpot MS] [--prefill-ms-per-token MS] [--model-dir DIR] [--cache DIR]
 *     [--token T] [--threads N] [--events]
 *
 * prompts.json: a JSON array; each item a user string, a list of {role, content} messages, or token ids.
 */
import fs from "node:fs";
import { DeviceClient } from "./node.js";
import type { Mode } from "./split.js";

function args(argv: string[]): Record<string, string | boolean> {
  const out: Record<string, string | boolean> = {};
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    if (!a.startsWith("--")) throw new Error(`unexpected argument ${a}`);
    const k = a.slice(2);
    if (k === "events" || k === "tokenize-only") out[k] = true;
    else out[k] = argv[++i];
  }
  return out;
}

const a = args(process.argv.slice(2));
const num = (k: string) => (a[k] === undefined ? undefined : Number(a[k]));
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
      maxNewTokens: num("max-new") ?? 64, mode: (a.mode as Mode) || undefined, cloudBudget: num("budget") ?? null,
      onToken: a.events ? (ev) => write({ event: ev }) : undefined,
    });
    write(r);
  }
} finally {
  await client.close();
  await client.engine.release();
}
