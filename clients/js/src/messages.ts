/**
 * Wire messages (docs/PROTOCOL.md sections 2-3): one MessagePack map per frame with a "type" tag.
 *
 * The encoder mimics the reference (msgspec) byte for byte: `type` first, then the fields in table
 * order, fields equal to their default omitted, the smallest integer width, floats always as
 * float 64 (even 1.0), tensors as {dtype, shape, data}. Values are encoded with @msgpack/msgpack;
 * the map headers are written here so the field order and the float/int choice follow the schema.
 */
import { decode as mpDecode, encode as mpEncode } from "@msgpack/msgpack";
import { ProtocolError } from "./errors.js";

export const PROTOCOL_VERSION = 1;
export const HANDSHAKE_MAX_BYTES = 4096;
export const MAX_FRAME_BYTES = 64 * 1024 * 1024;
export const MAX_TENSOR_DIMS = 32;

export type Int = number | bigint;

export interface Tensor { dtype: string; shape: number[]; data: Uint8Array }
export interface Grammar { kind: string; spec: string }

export interface Hello { type: "hello"; protocol_version: number; model_fingerprint: string; token?: string | null; client?: string }
export interface Welcome { type: "welcome"; protocol_version: number; model_fingerprint: string; server?: string; session_id?: string; device_model_url?: string }
export interface Generate {
  type: "generate"; request_id: string; prompt_ids: number[]; max_new_tokens: number;
  temperature?: number; top_p?: number; top_k?: number; seed?: Int | null; cloud_budget?: number | null;
  refine?: number | null; stop_ids?: number[]; presence_penalty?: number; frequency_penalty?: number;
  repetition_penalty?: number; min_tokens?: number; kv_from?: number | null; logit_bias?: [number, number][];
  kv_rate?: number | null; grammar?: Grammar | null; kv_wire?: "float16" | "int8";
}
export interface Token { type: "token"; request_id: string; token_id: number; index: number; t_cloud_ms: number; cached_tokens?: number; finish_reason?: string | null }
export interface RefinedPrompt { type: "refined_prompt"; request_id: string; kept_indices: number[] }
export interface ExtendBudget { type: "extend_budget"; request_id: string; cloud_budget: number }
export interface Stop { type: "stop"; request_id: string; handoff_index: number }
export interface Cancel { type: "cancel"; request_id: string }
export interface Done { type: "done"; request_id: string; reason: string; cloud_tokens: number; prefill_ms: number; cached_tokens?: number }
export interface ErrorMsg { type: "error"; code: string; message: string; request_id?: string | null; retry_after_ms?: number | null }
export interface Ping { type: "ping"; nonce: Int; t_ms: number }
export interface Pong { type: "pong"; nonce: Int; t_ms: number }
export interface KVTransfer { type: "kv_transfer"; request_id: string; layer_start: number; kv: Tensor; num_tokens: number; block_index?: number; num_blocks?: number; token_start?: number; scale?: Tensor | null }
export interface PreInfer { type: "pre_infer"; request_id: string; user_id: Int; item_ids: Int[]; timestamps: Int[] }
export interface Rank { type: "rank"; request_id: string; user_id: Int; item_ids: Int[]; timestamps: Int[]; candidate_ids: Int[]; request_ts?: Int | null }
export interface Scores { type: "scores"; request_id: string; scores: Tensor; prefix_source: string }
export interface TileBatch { type: "tile_batch"; request_id: string; slide_id: string; coords: number[][]; tiles: Tensor; jpeg?: Uint8Array[]; features?: Tensor | null; device_scores?: number[]; last?: boolean }
export interface Embeddings { type: "embeddings"; request_id: string; embeddings: Tensor; slide_score?: number | null; attention?: Tensor | null; encoder?: string; weights?: string }

/** The tagged union of every wire message. */
export type Message = Hello | Welcome | Generate | Token | RefinedPrompt | ExtendBudget | Stop | Cancel | Done |
  ErrorMsg | Ping | Pong | KVTransfer | PreInfer | Rank | Scores | TileBatch | Embeddings;
export type MessageType = Message["type"];

type Kind = "int" | "float" | "str" | "bool" | "bytes" | "tensor" | "grammar" | "ints" | "floats" | "intss" |
  "bytess" | "logit_bias";
/** [name, kind, optional (| nil), default (undefined = required)] */
type Field = [string, Kind, boolean, unknown];
const R = undefined;

/** Every message's fields in wire (table) order, from docs/PROTOCOL.md / protocol.schema.json. */
export const FIELDS: Record<MessageType, Field[]> = {
  hello: [["protocol_version", "int", false, R], ["model_fingerprint", "str", false, R], ["token", "str", true, null], ["client", "str", false, ""]],
  welcome: [["protocol_version", "int", false, R], ["model_fingerprint", "str", false, R], ["server", "str", false, ""],
    ["session_id", "str", false, ""], ["device_model_url", "str", false, ""]],
  generate: [["request_id", "str", false, R], ["prompt_ids", "ints", false, R], ["max_new_tokens", "int", false, R],
    ["temperature", "float", false, 0.0], ["top_p", "float", false, 1.0], ["top_k", "int", false, 0], ["seed", "int", true, null],
    ["cloud_budget", "int", true, null], ["refine", "float", true, null], ["stop_ids", "ints", false, []],
    ["presence_penalty", "float", false, 0.0], ["frequency_penalty", "float", false, 0.0], ["repetition_penalty", "float", false, 1.0],
    ["min_tokens", "int", false, 0], ["kv_from", "int", true, null], ["logit_bias", "logit_bias", false, []],
    ["kv_rate", "float", true, null], ["grammar", "grammar", true, null], ["kv_wire", "str", false, "float16"]],
  token: [["request_id", "str", false, R], ["token_id", "int", false, R], ["index", "int", false, R], ["t_cloud_ms", "float", false, R],
    ["cached_tokens", "int", false, 0], ["finish_reason", "str", true, null]],
  refined_prompt: [["request_id", "str", false, R], ["kept_indices", "ints", false, R]],
  extend_budget: [["request_id", "str", false, R], ["cloud_budget", "int", false, R]],
  stop: [["request_id", "str", false, R], ["handoff_index", "int", false, R]],
  cancel: [["request_id", "str", false, R]],
  done: [["request_id", "str", false, R], ["reason", "str", false, R], ["cloud_tokens", "int", false, R], ["prefill_ms", "float", false, R],
    ["cached_tokens", "int", false, 0]],
  error: [["code", "str", false, R], ["message", "str", false, R], ["request_id", "str", true, null], ["retry_after_ms", "float", true, null]],
  ping: [["nonce", "int", false, R], ["t_ms", "float", false, R]],
  pong: [["nonce", "int", false, R], ["t_ms", "float", false, R]],
  kv_transfer: [["request_id", "str", false, R], ["layer_start", "int", false, R], ["kv", "tensor", false, R], ["num_tokens", "int", false, R],
    ["block_index", "int", false, -1], ["num_blocks", "int", false, 1], ["token_start", "int", false, 0],
    ["scale", "tensor", true, null]],
  pre_infer: [["request_id", "str", false, R], ["user_id", "int", false, R], ["item_ids", "ints", false, R], ["timestamps", "ints", false, R]],
  rank: [["request_id", "str", false, R], ["user_id", "int", false, R], ["item_ids", "ints", false, R], ["timestamps", "ints", false, R],
    ["candidate_ids", "ints", false, R], ["request_ts", "int", true, null]],
  scores: [["request_id", "str", false, R], ["scores", "tensor", false, R], ["prefix_source", "str", false, R]],
  tile_batch: [["request_id", "str", false, R], ["slide_id", "str", false, R], ["coords", "intss", false, R], ["tiles", "tensor", false, R],
    ["jpeg", "bytess", false, []], ["features", "tensor", true, null], ["device_scores", "floats", false, []], ["last", "bool", false, false]],
  embeddings: [["request_id", "str", false, R], ["embeddings", "tensor", false, R], ["slide_score", "float", true, null],
    ["attention", "tensor", true, null], ["encoder", "str", false, ""], ["weights", "str", false, ""]],
};

export const TENSOR_ITEMSIZE: Record<string, number> = {
  float32: 4, float16: 2, bfloat16: 2, int8: 1, uint8: 1, int32: 4, int64: 8, bool: 1,
};

// -- encoding -----------------------------------------------------------------------------------------

const FLOAT = { forceIntegerToFloat: true } as const;
const INT = { useBigInt64: true } as const;

function mapHeader(n: number): Uint8Array {
  if (n < 16) return Uint8Array.of(0x80 | n);
  if (n < 0x10000) return Uint8Array.of(0xde, n >> 8, n & 0xff);
  return Uint8Array.of(0xdf, (n >>> 24) & 0xff, (n >>> 16) & 0xff, (n >>> 8) & 0xff, n & 0xff);
}

function mapHeader16(n: number): Uint8Array {
  return n < 0x10000 ? Uint8Array.of(0xde, n >> 8, n & 0xff) : mapHeader(n);
}

function arrayHeader(n: number): Uint8Array {
  if (n < 16) return Uint8Array.of(0x90 | n);
  if (n < 0x10000) return Uint8Array.of(0xdc, n >> 8, n & 0xff);
  return Uint8Array.of(0xdd, (n >>> 24) & 0xff, (n >>> 16) & 0xff, (n >>> 8) & 0xff, n & 0xff);
}

function concat(parts: Uint8Array[]): Uint8Array {
  let n = 0;
  for (const p of parts) n += p.length;
  const out = new Uint8Array(n);
  let o = 0;
  for (const p of parts) { out.set(p, o); o += p.length; }
  return out;
}

function encInt(v: unknown): Uint8Array {
  if (typeof v === "bigint") {
    // the smallest width: a bigint that fits a safe integer is encoded as a number
    if (v >= BigInt(Number.MIN_SAFE_INTEGER) && v <= BigInt(Number.MAX_SAFE_INTEGER)) return mpEncode(Number(v));
    return mpEncode(v, INT);
  }
  if (typeof v !== "number" || !Number.isInteger(v)) throw new TypeError(`not an integer: ${String(v)}`);
  return mpEncode(v);
}

function encValue(kind: Kind, v: unknown): Uint8Array {
  switch (kind) {
    case "int": return encInt(v);
    case "float": return mpEncode(Number(v), FLOAT);
    case "str": case "bool": case "bytes": return mpEncode(v);
    case "ints": return concat([arrayHeader((v as unknown[]).length), ...(v as unknown[]).map(encInt)]);
    case "intss": return concat([arrayHeader((v as unknown[][]).length), ...(v as unknown[][]).map((r) => encValue("ints", r))]);
    case "floats": return concat([arrayHeader((v as number[]).length), ...(v as number[]).map((x) => mpEncode(x, FLOAT))]);
    case "bytess": return concat([arrayHeader((v as Uint8Array[]).length), ...(v as Uint8Array[]).map((x) => mpEncode(x))]);
    case "logit_bias": return concat([arrayHeader((v as [number, number][]).length),
      ...(v as [number, number][]).map(([t, b]) => concat([arrayHeader(2), encInt(t), mpEncode(b, FLOAT)]))]);
    case "tensor": {
      const t = v as Tensor;
      checkTensor(t);
      return concat([mapHeader(3), mpEncode("dtype"), mpEncode(t.dtype), mpEncode("shape"), encValue("ints", t.shape),
        mpEncode("data"), mpEncode(t.data)]);
    }
    case "grammar": {
      const g = v as Grammar;
      return concat([mapHeader(2), mpEncode("kind"), mpEncode(g.kind), mpEncode("spec"), mpEncode(g.spec)]);
    }
  }
}

function isDefault(v: unknown, d: unknown): boolean {
  if (v === undefined) return true;
  if (Array.isArray(d)) return Array.isArray(v) && v.length === 0 && d.length === 0;
  if (typeof v === "bigint" || typeof d === "bigint") return v == d; // eslint-disable-line eqeqeq
  return v === d;
}

/** One frame body: `msg` as MessagePack, as the reference encoder writes it. */
export function encode(msg: Message): Uint8Array {
  const fields = FIELDS[msg.type];
  if (!fields) throw new TypeError(`unknown message type ${String((msg as { type: unknown }).type)}`);
  const parts: Uint8Array[] = [mpEncode("type"), mpEncode(msg.type)];
  let n = 1;
  const m = msg as unknown as Record<string, unknown>;
  for (const [name, kind, optional, dflt] of fields) {
    const v = m[name];
    if (dflt === undefined) {
      if (v === undefined || v === null) throw new TypeError(`${msg.type}.${name} is required`);
    } else if (isDefault(v, dflt) || (optional && v === null)) {
      continue;
    }
    parts.push(mpEncode(name), encValue(kind, v));
    n++;
  }
  // msgspec sizes the map header by the struct's field count (type included), not by the fields
  // written: a Generate (19) always gets a map16 header, even with 4 fields on the wire
  return concat([fields.length + 1 > 15 ? mapHeader16(n) : mapHeader(n), ...parts]);
}

// -- decoding -----------------------------------------------------------------------------------------

function bad(msg: string): never {
  throw new ProtocolError("bad_frame", msg);
}

function isInt(v: unknown): boolean {
  return typeof v === "bigint" || (typeof v === "number" && Number.isInteger(v));
}

function normInt(v: unknown, where: string): Int {
  if (!isInt(v)) bad(`${where} must be an integer, got ${typeof v}`);
  if (typeof v === "bigint") {
    if (v < -(1n << 63n) || v > (1n << 64n) - 1n) bad(`${where} is out of the 64-bit range`);
    return v >= BigInt(Number.MIN_SAFE_INTEGER) && v <= BigInt(Number.MAX_SAFE_INTEGER) ? Number(v) : v;
  }
  return v as number;
}

export function checkTensor(t: unknown, where = "tensor"): Tensor {
  if (typeof t !== "object" || t === null || Array.isArray(t)) bad(`${where} must be a map`);
  const o = t as Record<string, unknown>;
  if (typeof o.dtype !== "string") bad(`${where}.dtype must be a string`);
  const size = TENSOR_ITEMSIZE[o.dtype as string];
  if (size === undefined) bad(`${where} dtype ${JSON.stringify(o.dtype)} not allowed`);
  if (!Array.isArray(o.shape)) bad(`${where}.shape must be an array`);
  const shape = (o.shape as unknown[]).map((d, i) => normInt(d, `${where}.shape[${i}]`));
  if (shape.length > MAX_TENSOR_DIMS) bad(`${where} has ${shape.length} dimensions; at most ${MAX_TENSOR_DIMS}`);
  let prod = 1n, nz = 1n;
  for (const d of shape) {
    const b = BigInt(d);
    if (b < 0n) bad(`${where} shape has a negative dimension`);
    prod *= b;
    if (b) nz *= b;
  }
  if (nz * BigInt(size) > (1n << 63n) - 1n) bad(`${where} shape is too large to address`);
  if (!(o.data instanceof Uint8Array)) bad(`${where}.data must be bin`);
  const data = o.data as Uint8Array;
  if (BigInt(data.length) !== prod * BigInt(size)) bad(`${where} data is ${data.length} bytes, shape needs ${prod * BigInt(size)}`);
  if (o.dtype === "bool" && data.some((b) => b > 1)) bad(`${where}: bool data holds bytes other than 0 and 1`);
  return { dtype: o.dtype as string, shape: shape.map(Number), data };
}

function decValue(kind: Kind, v: unknown, where: string): unknown {
  switch (kind) {
    case "int": return normInt(v, where);
    case "float":
      if (typeof v === "bigint") return Number(v);
      if (typeof v !== "number") bad(`${where} must be a number`);
      return v;
    case "str": if (typeof v !== "string") bad(`${where} must be a string`); return v;
    case "bool": if (typeof v !== "boolean") bad(`${where} must be a bool`); return v;
    case "bytes": if (!(v instanceof Uint8Array)) bad(`${where} must be bin`); return v;
    case "ints": if (!Array.isArray(v)) bad(`${where} must be an array`); return v.map((x, i) => normInt(x, `${where}[${i}]`));
    case "intss": if (!Array.isArray(v)) bad(`${where} must be an array`); return v.map((x, i) => decValue("ints", x, `${where}[${i}]`));
    case "floats": if (!Array.isArray(v)) bad(`${where} must be an array`); return v.map((x, i) => decValue("float", x, `${where}[${i}]`));
    case "bytess": if (!Array.isArray(v)) bad(`${where} must be an array`); return v.map((x, i) => decValue("bytes", x, `${where}[${i}]`));
    case "logit_bias":
      if (!Array.isArray(v)) bad(`${where} must be an array`);
      return v.map((p, i) => {
        if (!Array.isArray(p) || p.length !== 2) bad(`${where}[${i}] must be a [token, bias] pair`);
        return [normInt(p[0], `${where}[${i}][0]`), decValue("float", p[1], `${where}[${i}][1]`)];
      });
    case "tensor": return checkTensor(v, where);
    case "grammar": {
      if (typeof v !== "object" || v === null || Array.isArray(v)) bad(`${where} must be a map`);
      const g = v as Record<string, unknown>;
      return { kind: decValue("str", g.kind, `${where}.kind`), spec: decValue("str", g.spec, `${where}.spec`) };
    }
  }
}

function cloneDefault(d: unknown): unknown {
  return Array.isArray(d) ? [] : d;
}

/** Build a message from a plain map (decoded MessagePack, or JSON after `fromJSON`): checks every
 * field, fills defaults, drops unknown keys. Throws ProtocolError(bad_frame / unknown_message). */
export function fromMap(obj: unknown): Message {
  if (typeof obj !== "object" || obj === null || Array.isArray(obj) || obj instanceof Uint8Array) bad("a frame must be a map");
  const o = obj as Record<string, unknown>;
  if (!("type" in o)) bad("the frame has no 'type'");
  if (typeof o.type !== "string") bad("'type' must be a string");
  const fields = FIELDS[o.type as MessageType];
  if (!fields) throw new ProtocolError("unknown_message", `unknown message type ${JSON.stringify(o.type)}`);
  const out: Record<string, unknown> = { type: o.type };
  for (const [name, kind, optional, dflt] of fields) {
    const v = o[name];
    if (v === undefined) {
      if (dflt === undefined) bad(`${o.type} lacks required field ${name}`);
      out[name] = cloneDefault(dflt);
    } else if (v === null) {
      if (!optional) bad(`${o.type}.${name} may not be nil`);
      out[name] = null;
    } else {
      out[name] = decValue(kind, v, `${o.type}.${name}`);
    }
  }
  return out as unknown as Message;
}

/** Decode one frame body. Throws ProtocolError: bad_frame (not MessagePack, trailing bytes, a bad
 * field or tensor), unknown_message. */
export function decode(frame: Uint8Array): Message {
  let obj: unknown;
  try {
    obj = mpDecode(frame, { useBigInt64: true });
  } catch (e) {
    bad(`not a valid MessagePack frame: ${(e as Error).message}`);
  }
  return fromMap(obj);
}

/** `msg` with every default filled in (what `decode` returns for its encoding). */
export function withDefaults(msg: Message): Message {
  return fromMap(msg);
}

// -- JSON (schema, golden .json): bytes and tensor data as base64 -------------------------------------

function b64(u: Uint8Array): string { return Buffer.from(u.buffer, u.byteOffset, u.byteLength).toString("base64"); }
function unb64(s: unknown, where: string): Uint8Array {
  if (typeof s !== "string") bad(`${where} must be a base64 string`);
  return new Uint8Array(Buffer.from(s as string, "base64"));
}

/** A message from its JSON form (golden `.json`, the JSON Schema's shape). */
export function fromJSON(obj: Record<string, unknown>): Message {
  const fields = FIELDS[obj.type as MessageType];
  if (!fields) throw new ProtocolError("unknown_message", `unknown message type ${JSON.stringify(obj.type)}`);
  const o: Record<string, unknown> = { ...obj };
  for (const [name, kind] of fields) {
    const v = o[name];
    if (v === undefined || v === null) continue;
    if (kind === "tensor") o[name] = { ...(v as object), data: unb64((v as { data: unknown }).data, `${name}.data`) };
    else if (kind === "bytes") o[name] = unb64(v, name);
    else if (kind === "bytess") o[name] = (v as unknown[]).map((x) => unb64(x, name));
  }
  return fromMap(o);
}

/** The JSON form of a message (bytes base64; big integers as JSON numbers may lose precision). */
export function toJSON(msg: Message): Record<string, unknown> {
  return JSON.parse(JSON.stringify(msg, (_k, v) => {
    if (v instanceof Uint8Array) return b64(v);
    if (typeof v === "bigint") return Number(v);
    return v;
  }));
}

// -- byte-stream framing (u32 BE length | body) -------------------------------------------------------

/** `body` with its 4-byte big-endian length prefix. */
export function packFrame(body: Uint8Array): Uint8Array {
  if (body.length > 0xffffffff) throw new RangeError("a frame above 4 GiB - 1 cannot be framed");
  const out = new Uint8Array(4 + body.length);
  new DataView(out.buffer).setUint32(0, body.length, false);
  out.set(body, 4);
  return out;
}

/** Splits a byte stream into frame bodies; the declared length is checked against `maxFrameBytes`
 * as soon as the 4 header bytes arrive (frame_too_large: the stream cannot be resynchronised). */
export class FrameBuffer {
  private buf: Uint8Array = new Uint8Array(0);
  constructor(public maxFrameBytes: number = MAX_FRAME_BYTES) {}
  push(data: Uint8Array): Uint8Array[] {
    this.buf = concat([this.buf, data]);
    const out: Uint8Array[] = [];
    for (;;) {
      if (this.buf.length < 4) break;
      const n = new DataView(this.buf.buffer, this.buf.byteOffset, 4).getUint32(0, false);
      if (n > this.maxFrameBytes) throw new ProtocolError("frame_too_large", `frame of ${n} bytes over the limit ${this.maxFrameBytes}`);
      if (this.buf.length < 4 + n) break;
      out.push(this.buf.slice(4, 4 + n));
      this.buf = this.buf.slice(4 + n);
    }
    return out;
  }
  get pending(): number { return this.buf.length; }
}
