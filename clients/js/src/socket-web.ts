/** The browser `Socket`: the page's `WebSocket` (binaryType arraybuffer). A browser cannot send
 * close codes other than 1000 and 3000-4999, nor see why an upgrade was refused. */
import { ChannelClosed } from "./errors.js";
import type { Dialer, Socket, SocketHandlers } from "./platform.js";
import { TimeoutError } from "./session.js";

class BrowserSocket implements Socket {
  private h: SocketHandlers | null = null;
  private dead = false;
  constructor(private ws: WebSocket) {
    ws.onmessage = (ev) => {
      if (ev.data instanceof ArrayBuffer) this.h?.message(new Uint8Array(ev.data), true);
      else this.h?.message(new TextEncoder().encode(String(ev.data)), false);
    };
    ws.onclose = (ev) => this.closed_(ev.code, ev.reason);
    ws.onerror = () => this.h?.error(new Error("websocket error"));
  }
  private closed_(code: number, reason: string): void {
    if (this.dead) return;
    this.dead = true;
    this.h?.close(code, reason);
  }
  get open(): boolean { return !this.dead && this.ws.readyState === WebSocket.OPEN; }
  get closed(): boolean { return this.dead || this.ws.readyState === WebSocket.CLOSED; }
  setHandlers(h: SocketHandlers): void { this.h = h; }
  send(data: Uint8Array): void { this.ws.send(data); }
  close(code = 1000, reason?: string): void {
    const c = code === 1000 || (code >= 3000 && code <= 4999) ? code : 1000;
    try { this.ws.close(c, reason?.slice(0, 100)); } catch { this.ws.close(); }
  }
  terminate(): void {
    try { this.ws.close(); } catch { /* closing already */ }
    this.closed_(1006, "terminated");
  }
}

export const browserDial: Dialer = (url, opt) => new Promise<Socket>((resolve, reject) => {
  const ws = new WebSocket(url);
  ws.binaryType = "arraybuffer";
  const timer = setTimeout(() => { ws.close(); reject(new TimeoutError(`no websocket upgrade within ${opt.timeoutMs} ms`)); }, opt.timeoutMs);
  ws.onopen = () => { clearTimeout(timer); resolve(new BrowserSocket(ws)); };
  ws.onerror = () => { clearTimeout(timer); reject(new ChannelClosed(`cannot open the websocket ${url}`)); };
  ws.onclose = (ev) => { clearTimeout(timer); reject(new ChannelClosed(`the websocket ${url} closed (${ev.code}) before it opened`, ev.code)); };
});
