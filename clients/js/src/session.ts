/**
 * The device's connection to a cloud (docs/PROTOCOL.md sections 1, 4, 5): a websocket (binary
 * messages only, no permessage-deflate), the Hello/Welcome handshake, auto Pong, and the requests
 * multiplexed by request_id, each checked against the device's request table.
 */
import { ChannelClosed, ProtocolError, RelayInferError, RemoteError, CLOSE_CODES } from "./errors.js";
import {
  decode, encode, HANDSHAKE_MAX_BYTES, MAX_FRAME_BYTES, PROTOCOL_VERSION,
  type Generate, type Message, type Welcome,
} from "./messages.js";
import { RequestTable } from "./requests.js";
import type { Dialer, Socket } from "./platform.js";

export interface ConnectOptions {
  /** sha256 hex of the model file the device runs ("" = only ask where the device model is). */
  fingerprint: string;
  token?: string | null;
  client?: string;
  /** bound on the websocket upgrade and on the handshake, each (ms; the reference: 5000). */
  connectTimeoutMs?: number;
  /** largest frame accepted after the handshake (bytes). */
  maxFrameBytes?: number;
  /** opens the websocket (default `Connection.defaultDial`: `ws` once socket-node.js is imported,
   * the page's WebSocket in the browser build). */
  dial?: Dialer;
}

/** One event of a request: a cloud message (`ignored`: legal but crossed the request's end), or a
 * violation of the per-request rules by the cloud. */
export type RequestEvent = { kind: "message"; message: Message; ignored: boolean } | { kind: "violation"; reason: string };

class Queue<T> {
  private items: T[] = [];
  private waiters: ((v: T | Error) => void)[] = [];
  private failure: Error | null = null;
  push(v: T): void {
    const w = this.waiters.shift();
    if (w) w(v); else this.items.push(v);
  }
  fail(e: Error): void {
    if (this.failure) return;
    this.failure = e;
    for (const w of this.waiters.splice(0)) w(e);
  }
  /** The next item; throws the failure once the queue is drained, or a TimeoutError after `timeoutMs`. */
  next(timeoutMs?: number): Promise<T> {
    if (this.items.length) return Promise.resolve(this.items.shift() as T);
    if (this.failure) return Promise.reject(this.failure);
    return new Promise<T>((resolve, reject) => {
      let timer: ReturnType<typeof setTimeout> | undefined;
      const w = (v: T | Error) => { if (timer) clearTimeout(timer); if (v instanceof Error) reject(v); else resolve(v); };
      this.waiters.push(w);
      if (timeoutMs !== undefined && Number.isFinite(timeoutMs)) {
        timer = setTimeout(() => {
          const i = this.waiters.indexOf(w);
          if (i >= 0) this.waiters.splice(i, 1);
          reject(new TimeoutError(`nothing within ${timeoutMs.toFixed(0)} ms`));
        }, Math.max(0, timeoutMs));
      }
    });
  }
}

export class TimeoutError extends Error {
  constructor(message: string) { super(message); this.name = "TimeoutError"; }
}

/** The `http(s)://HOST:PORT` base of a Welcome's device_model_url; a loopback or unspecified host
 * in it (a cloud bound to all interfaces names itself 127.0.0.1) is replaced by the host dialled. */
export function deviceModelBase(deviceModelUrl: string, dialledUrl: string): string | null {
  if (!deviceModelUrl) return null;
  const u = new URL(deviceModelUrl), d = new URL(dialledUrl);
  const host = u.hostname.replace(/^\[|\]$/g, "");
  const dh = d.hostname.replace(/^\[|\]$/g, "");
  if (["127.0.0.1", "localhost", "0.0.0.0", "::", "::1"].includes(host) && dh && dh !== host) u.hostname = d.hostname;
  let path = u.pathname.endsWith("/v1/device-model") ? u.pathname.slice(0, -"/v1/device-model".length) : u.pathname;
  path = path.replace(/\/+$/, "");
  return `${u.protocol}//${u.host}${path}`;
}

/** A handshaken connection to the cloud. */
export class Connection {
  /** The dialer used when ConnectOptions.dial is not given (set by socket-node.js / the browser build). */
  static defaultDial: Dialer | null = null;
  readonly welcome: Welcome;
  readonly url: string;
  private ws: Socket;
  private table = new RequestTable();
  private queues = new Map<string, Queue<RequestEvent>>();
  private closedError: RelayInferError | null = null;
  private maxFrameBytes: number;
  private closeWaiters: (() => void)[] = [];

  private constructor(url: string, ws: Socket, welcome: Welcome, maxFrameBytes: number) {
    this.url = url;
    this.ws = ws;
    this.welcome = welcome;
    this.maxFrameBytes = maxFrameBytes;
    ws.setHandlers({
      message: (data, isBinary) => this.onFrame(data, isBinary),
      close: (code, reason) => {
        for (const w of this.closeWaiters.splice(0)) w();
        this.onClosed(new ChannelClosed(`the connection closed (${code}${reason.length ? " " + reason : ""})`, code));
      },
      error: (e) => this.onClosed(new ChannelClosed(`transport error: ${e.message}`)),
    });
  }

  /** Dial `url`, send Hello, wait for Welcome. Throws RemoteError (the server's refusal, with its
   * code and retryAfterMs), ProtocolError (version_mismatch, fingerprint_mismatch,
   * handshake_required, bad frames), ChannelClosed, TimeoutError, or the transport's error. */
  static async connect(url: string, opt: ConnectOptions): Promise<Connection> {
    const timeout = opt.connectTimeoutMs ?? 5000;
    const maxFrame = opt.maxFrameBytes ?? MAX_FRAME_BYTES;
    const dial = opt.dial ?? Connection.defaultDial;
    if (!dial) throw new Error("no websocket dialer: import socket-node.js (Node) or pass ConnectOptions.dial");
    const ws = await dial(url, { timeoutMs: timeout, maxPayload: maxFrame + Math.max(maxFrame / 4, 65536) });
    try {
      const first = new Promise<Message>((resolve, reject) => {
        const timer = setTimeout(() => reject(new TimeoutError(`no welcome within ${timeout} ms`)), timeout);
        let got = false;
        ws.setHandlers({
          message: (data, isBinary) => {
            if (got) return;
            got = true;
            clearTimeout(timer);
            try {
              if (!isBinary) throw new ProtocolError("bad_frame", "a text websocket message");
              if (data.length > HANDSHAKE_MAX_BYTES) throw new ProtocolError("frame_too_large", `a ${data.length}-byte frame before the handshake`);
              resolve(decode(data));
            } catch (e) { reject(e); }
          },
          close: (code) => { clearTimeout(timer); reject(new ChannelClosed(`the server closed (${code}) before its welcome`, code)); },
          error: (e) => { clearTimeout(timer); reject(new ChannelClosed(`transport error: ${e.message}`)); },
        });
      });
      ws.send(encode({ type: "hello", protocol_version: PROTOCOL_VERSION, model_fingerprint: opt.fingerprint, token: opt.token ?? null, client: opt.client ?? "relayinfer-device-js" }));
      const msg = await first;
      if (msg.type === "error") throw new RemoteError(msg.code, msg.message, msg.request_id ?? null, msg.retry_after_ms ?? null);
      if (msg.type !== "welcome") throw new ProtocolError("handshake_required", `expected welcome, got ${msg.type}`);
      if (msg.protocol_version !== PROTOCOL_VERSION) {
        throw new ProtocolError("version_mismatch", `the server speaks protocol ${msg.protocol_version}, this client ${PROTOCOL_VERSION}`);
      }
      if (opt.fingerprint && msg.model_fingerprint !== opt.fingerprint) {
        throw new ProtocolError("fingerprint_mismatch", `the server runs model ${msg.model_fingerprint.slice(0, 16)}…, this device ${opt.fingerprint.slice(0, 16)}…`);
      }
      return new Connection(url, ws, msg, maxFrame);
    } catch (e) {
      if (e instanceof ProtocolError && ws.open) {
        try { ws.send(encode({ type: "error", code: e.code, message: e.message })); } catch { /* best effort */ }
        ws.close(CLOSE_CODES[e.code] ?? 1008, e.code);
      } else {
        ws.terminate();
      }
      throw e;
    }
  }

  get closed(): boolean { return this.closedError !== null; }

  private onClosed(e: RelayInferError): void {
    if (this.closedError) return;
    this.closedError = e;
    for (const q of this.queues.values()) q.fail(e);
  }

  private onFrame(data: Uint8Array, isBinary: boolean): void {
    if (this.closedError) return;
    let msg: Message;
    try {
      if (!isBinary) throw new ProtocolError("bad_frame", "a text websocket message");
      if (data.length > this.maxFrameBytes) throw new ProtocolError("frame_too_large", `frame of ${data.length} bytes`);
      msg = decode(data);
    } catch (e) {
      const pe = e as ProtocolError;
      this.failLocal(pe);
      return;
    }
    if (msg.type === "ping") { this.sendRaw({ type: "pong", nonce: msg.nonce, t_ms: msg.t_ms }); return; }
    if (msg.type === "pong") return;
    if (msg.type === "welcome" || msg.type === "hello") { this.failLocal(new ProtocolError("bad_request", `a ${msg.type} after the handshake`)); return; }
    const id = (msg as { request_id?: string | null }).request_id;
    if (msg.type === "error" && (id === null || id === undefined)) { // connection-level: the peer closes
      const err = new RemoteError(msg.code, msg.message, null, msg.retry_after_ms ?? null);
      this.onClosed(err);
      this.ws.close(1000);
      return;
    }
    if (typeof id !== "string") return;
    const q = this.queues.get(id);
    const v = this.table.apply("recv", msg);
    if (!q) return; // a request this side no longer follows (its frames crossed its end)
    q.push(v.ok ? { kind: "message", message: msg, ignored: v.ignored } : { kind: "violation", reason: v.reason });
  }

  private failLocal(e: ProtocolError): void {
    try { this.ws.send(encode({ type: "error", code: e.code, message: e.message })); } catch { /* closed */ }
    this.ws.close(CLOSE_CODES[e.code] ?? 1008, e.code);
    this.onClosed(e);
  }

  private sendRaw(msg: Message): void {
    if (this.closedError) throw this.closedError;
    this.ws.send(encode(msg));
  }

  /** Send a device message of a request; false when the request table ignores it (it crossed the
   * cloud's done). Throws ChannelClosed on a closed connection. */
  send(msg: Message): boolean {
    const v = this.table.apply("send", msg);
    if (!v.ok) throw new ProtocolError("bad_request", v.reason);
    if (v.ignored) return false;
    this.sendRaw(msg);
    return true;
  }

  /** Start a request: send its Generate; its events come from `next(request_id)`. */
  start(g: Generate): void {
    const q = new Queue<RequestEvent>();
    if (this.closedError) throw this.closedError;
    this.queues.set(g.request_id, q);
    this.send(g);
  }

  /** The request's next event, within `timeoutMs` (TimeoutError after). Throws the connection's
   * end (ChannelClosed, RemoteError of a connection-level error) once it closed. */
  next(requestId: string, timeoutMs?: number): Promise<RequestEvent> {
    const q = this.queues.get(requestId);
    if (!q) return Promise.reject(new Error(`no request ${requestId} on this connection`));
    return q.next(timeoutMs);
  }

  /** Stop following a request (its later frames are dropped). */
  release(requestId: string): void {
    this.queues.get(requestId)?.fail(new ChannelClosed(`request ${requestId} released`));
    this.queues.delete(requestId);
  }

  /** Close normally (1000), bounded by `timeoutMs`. */
  async close(timeoutMs = 1000): Promise<void> {
    if (this.ws.closed) return;
    await new Promise<void>((resolve) => {
      const t = setTimeout(() => { this.ws.terminate(); resolve(); }, timeoutMs);
      this.closeWaiters.push(() => { clearTimeout(t); resolve(); });
      this.ws.close(1000);
    });
    this.onClosed(new ChannelClosed("closed by this side", 1000));
  }

  /** Drop the connection at once (tests, faults). */
  terminate(): void { this.ws.terminate(); }
}
