/**
 * The split loop (docs/PROTOCOL.md section 5; reference: relayinfer.device.split): the cloud
 * prefills and streams the first tokens, the device prefills the prompt and then, batch by batch,
 * the cloud tokens received so far; when it has covered every received token it fixes the
 * hand-off index h, sends Stop{h} and decodes h, h+1, ... itself. Faults (cloud unreachable,
 * refused, lost mid-answer, request error, stall) end with the device answering alone.
 */
import { RemoteError, RelayInferError } from "./errors.js";
import type { Generate } from "./messages.js";
import { Connection, deviceModelBase, TimeoutError, type RequestEvent } from "./session.js";
import { OnnxEngine, type KV, type Pace } from "./engine.js";
import { sampleToken, seedKey, type SamplingOptions } from "./sampling.js";
import { randomHex, type Dialer } from "./platform.js";
import type { Tokenizer, ChatMessage } from "./tokenizer.js";

export type Mode = "split" | "device-only" | "cloud-only";

export interface TokenEvent { text: string; tokenId: number; source: "cloud" | "device"; shownAtMs: number; index: number }

/** As relayinfer.device.split.GenerationResult (snake_case, the same names). */
export interface GenerationResult {
  text: string;
  token_ids: number[];
  mode: Mode;
  handoff_index: number | null;
  cloud_tokens: number;
  device_tokens: number;
  ttft_ms: number;
  tpot_ms_p50: number;
  tpot_ms_max: number;
  finish_reason: string;
  fault: string | null;
  error: string | null;
  cloud_streamed: number;
  prompt_ids: number[];
  request_id: string;
  cloud_budget: number | null;
  plan: Mode;
  ready_ms: number[];
}

export interface GenerateOptions {
  maxNewTokens?: number;
  /** below 1e-5 (0 included): greedy. Sampling is decoding.sample's: with a `seed` the answer is
   * the Python device's token for token, and a split answer continues the cloud's exactly. */
  temperature?: number;
  topP?: number;
  topK?: number;
  /** request seed, an integer in [-2**63, 2**63-1] (null: not reproducible, Math.random). */
  seed?: number | bigint | null;
  /** Not applied on this device: a non-neutral value is refused (RangeError naming it), never ignored. */
  presencePenalty?: number;
  frequencyPenalty?: number;
  repetitionPenalty?: number;
  minTokens?: number;
  logitBias?: [number, number][];
  grammar?: unknown;
  stopIds?: number[];
  /** most tokens the cloud streams (null: until the device's Stop). */
  cloudBudget?: number | null;
  mode?: Mode;
  onToken?: (ev: TokenEvent) => void;
}

/** The sampling settings this device does not apply, by their GenerateOptions name and neutral value. */
export const UNSUPPORTED_SAMPLING: [keyof GenerateOptions, unknown][] = [
  ["presencePenalty", 0], ["frequencyPenalty", 0], ["repetitionPenalty", 1], ["minTokens", 0], ["logitBias", []], ["grammar", null],
];

/** Refuses (RangeError naming them) the settings the JS device cannot apply, and checks the others'
 * ranges (protocol.validate's rules: temperature [0, 2], top_p [0, 1], top_k >= -1, seed 64-bit). */
export function checkGenerateOptions(g: GenerateOptions): void {
  const bad = UNSUPPORTED_SAMPLING.filter(([k, neutral]) => {
    const v = g[k];
    return v !== undefined && v !== null && !(Array.isArray(neutral) ? Array.isArray(v) && v.length === 0 : v === neutral);
  }).map(([k]) => k);
  if (bad.length) throw new RangeError(`not supported by the JS device (it would not apply them): ${bad.join(", ")}`);
  const t = g.temperature ?? 0, tp = g.topP ?? 1, tk = g.topK ?? 0;
  if (!(typeof t === "number" && t >= 0 && t <= 2)) throw new RangeError(`temperature must be a number in [0, 2], got ${t}`);
  if (!(typeof tp === "number" && tp >= 0 && tp <= 1)) throw new RangeError(`topP must be a number in [0, 1], got ${tp}`);
  if (!(Number.isInteger(tk) && tk >= -1)) throw new RangeError(`topK must be an integer >= -1, got ${tk}`);
  if (g.seed !== undefined && g.seed !== null) seedKey(g.seed);
}

export interface ClientOptions {
  /** ws:// or wss:// URL of `relayinfer cloud serve` (null: device-only). */
  cloudUrl?: string | null;
  token?: string | null;
  /** a folder with the device model (Node); default: fetched from the cloud into `cacheDir`. */
  modelDir?: string;
  cacheDir?: string;
  threads?: number;
  /** opens the websocket (default: Connection.defaultDial). */
  dial?: Dialer;
  targetTpotMs?: number;
  connectTimeoutMs?: number;
  prefillChunk?: number;
  /** pace the device engine like a slower device (tests, demos): relayinfer's DeviceProfile. */
  pace?: Pace | null;
  progressFloorMs?: number;
  progressFactor?: number;
}

const SEND_TIMEOUT_MS = 1000;

/** Released at max(ready, previous shown + interval); the first token as soon as it is ready
 * (relayinfer.device.speed.release_time). */
export function releaseTime(readyMs: number, prevShownMs: number | null, intervalMs: number): number {
  return prevShownMs === null ? readyMs : Math.max(readyMs, prevShownMs + intervalMs);
}

function median(x: number[]): number {
  if (!x.length) return 0;
  const s = [...x].sort((a, b) => a - b), m = s.length >> 1;
  return s.length % 2 ? s[m] : (s[m - 1] + s[m]) / 2;
}

/** Where the cloud at `cloudUrl` serves its device model (`http(s)://HOST:PORT`, null: it serves
 * none): a Hello with an empty fingerprint, answered by a Welcome naming it, then closed. */
export async function askDeviceModelBase(opt: ClientOptions): Promise<string | null> {
  if (!opt.cloudUrl) throw new Error("no cloudUrl to fetch the device model from");
  const c = await Connection.connect(opt.cloudUrl, { fingerprint: "", token: opt.token, connectTimeoutMs: opt.connectTimeoutMs, dial: opt.dial });
  const base = deviceModelBase(c.welcome.device_model_url ?? "", opt.cloudUrl);
  await c.close();
  return base;
}

/** The split loop over an engine and a tokenizer, the same in Node (DeviceClient.create in node.ts)
 * and in the browser (web/src/client.ts). */
export class SplitClient {
  readonly engine: OnnxEngine;
  readonly tokenizer: Tokenizer;
  readonly opt: ClientOptions;
  private conn: Connection | null = null;
  private retryAt = 0;
  private ttftEstMs = 1000;
  private tpotEstMs = 100;

  constructor(engine: OnnxEngine, tokenizer: Tokenizer, opt: ClientOptions) {
    this.engine = engine; this.tokenizer = tokenizer; this.opt = opt;
    engine.pace = opt.pace ?? null;
  }

  async close(): Promise<void> {
    const c = this.conn;
    this.conn = null;
    if (c) await c.close();
  }

  private async link(): Promise<Connection> {
    if (this.conn && !this.conn.closed) return this.conn;
    this.conn = await Connection.connect(this.opt.cloudUrl!, {
      fingerprint: this.engine.fingerprint, token: this.opt.token, connectTimeoutMs: this.opt.connectTimeoutMs ?? 5000, dial: this.opt.dial,
    });
    return this.conn;
  }

  /** Generate an answer to a user string or chat messages (or prompt ids). */
  async generate(prompt: string | ChatMessage[] | number[], g: GenerateOptions = {}): Promise<GenerationResult> {
    checkGenerateOptions(g);
    const ids = Array.isArray(prompt) && typeof prompt[0] === "number" ? (prompt as number[]) : this.tokenizer.encodeChat(prompt as string | ChatMessage[]);
    return new Run(this, ids, g).go();
  }

  /** @internal */ _link(): Promise<Connection> { return this.link(); }
  /** @internal */ _drop(): void { const c = this.conn; this.conn = null; c?.terminate(); }
  /** @internal */ get _retryAt(): number { return this.retryAt; }
  /** @internal */ _backOff(ms: number | null): void { this.retryAt = performance.now() + Math.min(ms ?? 1000, 600000); }
  /** @internal */ _learn(ttft: number | null, tpot: number | null): void {
    if (ttft !== null) this.ttftEstMs = ttft;
    if (tpot !== null) this.tpotEstMs = tpot;
  }
  /** @internal */ _progressTimeoutMs(first: boolean): number {
    return (this.opt.progressFloorMs ?? 3000) + (this.opt.progressFactor ?? 5) * (first ? this.ttftEstMs : this.tpotEstMs);
  }
}

type Phase = "connecting" | "cloud" | "handed-off" | "device-alone" | "fault" | "done";

class Run {
  readonly id = randomHex(6);
  private t0 = performance.now();
  private ids: number[] = [];
  private source: ("cloud" | "device")[] = [];
  private readyMs: number[] = [];
  private finish: string | null = null;
  private phase: Phase = "connecting";
  private endedIn: Phase | null = null;
  private handoff: number | null = null;
  private fault: string | null = null;
  private error: string | null = null;
  private conn: Connection | null = null;
  private streamed = 0;
  private deviceBusy = false;
  private wake: (() => void)[] = [];
  private mode: Mode;
  private budget: number | null;
  private maxNew: number;
  /** the request's sampling with the defaults filled in: what the Generate sends and the device draws with */
  private sampling: Required<SamplingOptions>;

  constructor(private c: SplitClient, private prompt: number[], private g: GenerateOptions) {
    this.mode = g.mode ?? (c.opt.cloudUrl ? "split" : "device-only");
    if (!c.opt.cloudUrl) this.mode = "device-only";
    this.budget = this.mode === "split" ? (g.cloudBudget ?? null) : null;
    this.maxNew = g.maxNewTokens ?? 256;
    this.sampling = { temperature: g.temperature ?? 0, topP: g.topP ?? 1, topK: Math.max(0, g.topK ?? 0), seed: g.seed ?? null };
  }

  private now(): number { return performance.now() - this.t0; }
  private notify(): void { for (const w of this.wake.splice(0)) w(); }
  private changed(): Promise<void> { return new Promise((r) => this.wake.push(r)); }
  private get done(): boolean { return this.finish !== null; }

  private finishReason(tok: number, n: number): string | null {
    if (tok === this.c.engine.eosId) return "eos";
    if ((this.g.stopIds ?? []).includes(tok)) return "stop";
    if (n >= this.maxNew) return "length";
    return null;
  }

  private append(tok: number, src: "cloud" | "device", reason: string | null | undefined): void {
    this.ids.push(tok); this.source.push(src); this.readyMs.push(this.now());
    if (reason) this.end(reason);
    this.notify();
  }

  private end(reason: string): void {
    if (this.finish !== null) return;
    this.endedIn = this.phase;
    this.finish = reason;
    this.phase = "done";
    this.notify();
  }

  private generateMsg(): Generate {
    return {
      type: "generate", request_id: this.id, prompt_ids: this.prompt, max_new_tokens: this.maxNew,
      temperature: this.sampling.temperature, top_p: this.sampling.topP, top_k: this.sampling.topK,
      seed: this.sampling.seed, cloud_budget: this.budget, stop_ids: this.g.stopIds ?? [],
    };
  }

  /** The cloud stream ended early: the device takes over (cloud-only mode: the answer ends). */
  private cloudFault(kind: string, error: string): void {
    if (this.phase !== "cloud" && this.phase !== "connecting") return;
    this.fault = kind; this.error = error;
    if (this.mode === "cloud-only") { this.end("error"); return; }
    this.phase = "fault";
    this.notify();
  }

  async go(): Promise<GenerationResult> {
    const c = this.c;
    if (this.mode !== "device-only") {
      try {
        if (performance.now() < c._retryAt) throw new RemoteError("overloaded", "the cloud asked to retry later", null, c._retryAt - performance.now());
        this.conn = await c._link();
        this.conn.start(this.generateMsg());
        this.phase = "cloud";
      } catch (e) {
        const overloaded = e instanceof RemoteError && e.code === "overloaded";
        if (overloaded && performance.now() >= c._retryAt) c._backOff((e as RemoteError).retryAfterMs);
        if (this.mode === "cloud-only") throw e;
        this.fault = overloaded ? "cloud-overloaded" : e instanceof RelayInferError && !(e.code === "connection_closed") ? "cloud-refused" : "cloud-unreachable";
        this.error = `${(e as Error).name}: ${(e as Error).message}`;
        this.conn = null;
        this.mode = "device-only";
      }
    }
    if (this.mode === "device-only") this.phase = "device-alone";
    const shown: TokenEvent[] = [];
    const tasks: Promise<void>[] = [];
    if (this.conn) tasks.push(this.receive());
    if (this.mode !== "cloud-only") tasks.push(this.device());
    const display = this.display(shown);
    await display;
    this.notify();
    if (this.conn) this.conn.release(this.id); // ends the receiver's wait; later frames of the request are dropped
    await Promise.allSettled(tasks);
    if (this.conn) {
      if (this.fault === "connection-lost" || this.fault === "cloud-stalled" || this.fault === "cloud-error") c._drop();
    }
    return this.result(shown);
  }

  private async receive(): Promise<void> {
    const conn = this.conn!;
    let firstAt: number | null = null;
    try {
      while (!this.done && this.phase === "cloud") {
        let ev: RequestEvent;
        try {
          ev = await conn.next(this.id, this.c._progressTimeoutMs(this.streamed === 0));
        } catch (e) {
          if (e instanceof TimeoutError) {
            if (this.deviceBusy) continue; // working towards a hand-off on its own: no harm yet
            this.cloudFault("cloud-stalled", `no frame from the cloud: ${e.message}`);
            this.sendQuietly({ type: "cancel", request_id: this.id });
            return;
          }
          throw e;
        }
        if (ev.kind === "violation") {
          this.cloudFault("cloud-error", `protocol violation: ${ev.reason}`);
          this.sendQuietly({ type: "cancel", request_id: this.id });
          return;
        }
        if (ev.ignored) continue;
        const m = ev.message;
        if (m.type === "token") {
          this.streamed++;
          if (firstAt === null) firstAt = this.now();
          if (this.phase === "cloud") this.append(m.token_id, "cloud", m.finish_reason);
          const arr = this.readyMs.filter((_, i) => this.source[i] === "cloud");
          this.c._learn(firstAt, arr.length > 1 ? (arr[arr.length - 1] - arr[0]) / (arr.length - 1) : null);
        } else if (m.type === "done") {
          if (this.phase !== "cloud" || this.done) return;
          if (m.reason === "budget" && this.mode === "split") { this.phase = "fault"; this.notify(); return; } // as planned: take over
          if (this.mode === "cloud-only" && ["eos", "stop", "length"].includes(m.reason)) { this.end(m.reason); return; }
          this.cloudFault("cloud-error", `the cloud ended the stream early (${m.reason})`);
          return;
        } else if (m.type === "error") {
          const overloaded = m.code === "overloaded";
          if (overloaded) this.c._backOff(m.retry_after_ms ?? null);
          this.cloudFault(overloaded ? "cloud-overloaded" : "cloud-error", `cloud error [${m.code}]: ${m.message}`);
          return;
        }
      }
    } catch (e) {
      if (this.done || this.phase !== "cloud") return; // released after the answer or the hand-off
      if (e instanceof RemoteError && e.code === "overloaded") this.c._backOff(e.retryAfterMs);
      this.cloudFault("connection-lost", (e as Error).message);
    }
  }

  private sendQuietly(msg: Parameters<Connection["send"]>[0]): boolean {
    try { return this.conn !== null && !this.conn.closed && this.conn.send(msg); } catch { return false; }
  }

  private async device(): Promise<void> {
    try {
      await this.deviceWork();
    } catch (e) {
      this.fault = "device-error"; this.error = `device runtime failed: ${(e as Error).message}`;
      if (this.phase === "cloud" && this.sendQuietly({ type: "extend_budget", request_id: this.id, cloud_budget: this.maxNew })) return;
      this.end("error");
    }
  }

  private async deviceWork(): Promise<void> {
    const eng = this.c.engine, chunk = this.c.opt.prefillChunk ?? 256;
    this.deviceBusy = true;
    let kv: KV | null = null;
    let logits: Float32Array | null = null;
    for (let i = 0; i < this.prompt.length; i += chunk) {
      if (this.done) return;
      ({ logits, kv } = await eng.prefill(this.prompt.slice(i, i + chunk), kv));
    }
    // catch up on the cloud tokens received, batch by batch, until covered; then hand off
    let covered = 0;
    for (;;) {
      if (this.done) return;
      const received = this.ids.length;
      if (received > covered) {
        ({ logits, kv } = await eng.prefill(this.ids.slice(covered, received), kv));
        covered = received;
        continue;
      }
      break; // covered == received, checked with no await before the hand-off below
    }
    const before = this.phase;
    this.handoff = covered;
    this.phase = covered === 0 && before !== "fault" ? "device-alone" : "handed-off";
    if (before === "cloud") this.sendQuietly({ type: "stop", request_id: this.id, handoff_index: covered });
    this.notify();
    for (let i = covered; i < this.maxNew; i++) {
      const tok = sampleToken(logits!, this.sampling, i); // answer position i: the cloud's generator for that index
      this.append(tok, "device", this.finishReason(tok, i + 1));
      if (this.done) return;
      ({ logits, kv } = await eng.decode(tok, kv!));
    }
    if (!this.done) this.end("length");
  }

  private async display(shown: TokenEvent[]): Promise<void> {
    const interval = this.c.opt.targetTpotMs ?? 50;
    const dec = this.c.tokenizer.streamDecoder();
    let k = 0;
    for (;;) {
      while (k >= this.ids.length) {
        if (this.done) return;
        await this.changed();
      }
      const at = releaseTime(this.readyMs[k], shown.length ? shown[shown.length - 1].shownAtMs : null, interval);
      const delay = at - this.now();
      if (delay > 0) await new Promise((r) => setTimeout(r, delay));
      const ev: TokenEvent = { text: dec.push(this.ids[k]), tokenId: this.ids[k], source: this.source[k], shownAtMs: this.now(), index: k };
      shown.push(ev);
      this.g.onToken?.(ev);
      k++;
    }
  }

  private result(shown: TokenEvent[]): GenerationResult {
    const cloud = this.source.filter((s) => s === "cloud").length;
    const gaps = shown.slice(1).map((e, i) => e.shownAtMs - shown[i].shownAtMs);
    const ended = this.endedIn ?? this.phase;
    const mode: Mode = ended === "handed-off" ? "split" : ended === "device-alone" ? "device-only" : "cloud-only";
    return {
      text: shown.map((e) => e.text).join(""), token_ids: [...this.ids], mode,
      handoff_index: cloud && this.ids.length > cloud ? this.handoff : null,
      cloud_tokens: cloud, device_tokens: this.ids.length - cloud,
      ttft_ms: shown.length ? shown[0].shownAtMs : NaN, tpot_ms_p50: median(gaps), tpot_ms_max: gaps.length ? Math.max(...gaps) : 0,
      finish_reason: this.finish ?? "length", fault: this.fault, error: this.error, cloud_streamed: this.streamed,
      prompt_ids: this.prompt, request_id: this.id, cloud_budget: this.budget,
      plan: this.c.opt.cloudUrl ? (this.g.mode ?? "split") : "device-only", ready_ms: [...this.readyMs],
    };
  }
}
