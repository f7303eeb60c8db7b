/**
 * What the split loop needs from the platform, so that Node and the browser share session.ts and
 * split.ts: a binary websocket (`Socket`, opened by a `Dialer`), an ONNX Runtime module with the
 * onnxruntime-common API (onnxruntime-node or onnxruntime-web), and random bytes.
 */
import type { InferenceSession, Tensor } from "onnxruntime-common";

/** Handlers of a `Socket`'s events (set once the socket is open; `setHandlers` replaces them). */
export interface SocketHandlers {
  message(data: Uint8Array, isBinary: boolean): void;
  close(code: number, reason: string): void;
  error(e: Error): void;
}

/** An open binary websocket (no permessage-deflate). */
export interface Socket {
  readonly open: boolean;
  readonly closed: boolean;
  setHandlers(h: SocketHandlers): void;
  send(data: Uint8Array): void;
  /** The close handshake with this code and reason (a browser only sends 1000 or 3000-4999). */
  close(code?: number, reason?: string): void;
  /** Drop the connection at once; the close handler runs (code 1006). */
  terminate(): void;
}

export interface DialOptions { timeoutMs: number; maxPayload: number }
/** Open a websocket to `url`; rejects with ChannelClosed (refused upgrade, unreachable) or a timeout. */
export type Dialer = (url: string, opt: DialOptions) => Promise<Socket>;

/** The parts of an ONNX Runtime JS module the engine uses (both packages export these). */
export interface OrtModule {
  Tensor: typeof Tensor;
  InferenceSession: typeof InferenceSession;
}

/** `n` random bytes as hex (Web Crypto: Node >= 19 and browsers). */
export function randomHex(n: number): string {
  const b = new Uint8Array(n);
  globalThis.crypto.getRandomValues(b);
  return Array.from(b, (x) => x.toString(16).padStart(2, "0")).join("");
}

/** `bytes` as a hex string. */
export function hex(bytes: ArrayBuffer | Uint8Array): string {
  return Array.from(bytes instanceof Uint8Array ? bytes : new Uint8Array(bytes), (x) => x.toString(16).padStart(2, "0")).join("");
}
