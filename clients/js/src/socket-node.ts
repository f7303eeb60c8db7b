/** The Node `Socket`: the `ws` package (no permessage-deflate; an HTTP refusal of the upgrade is
 * named with its status). Importing this module makes it the default dialer of `Connection`. */
import WebSocket from "ws";
import { ChannelClosed } from "./errors.js";
import type { Dialer, Socket, SocketHandlers } from "./platform.js";
import { Connection } from "./session.js";

class NodeSocket implements Socket {
  private h: SocketHandlers | null = null;
  constructor(private ws: WebSocket) {
    ws.on("message", (data, isBinary) => {
      const b = data as Buffer;
      this.h?.message(new Uint8Array(b.buffer, b.byteOffset, b.byteLength), isBinary);
    });
    ws.on("close", (code, reason) => this.h?.close(code, reason.toString()));
    ws.on("error", (e) => this.h?.error(e));
  }
  get open(): boolean { return this.ws.readyState === WebSocket.OPEN; }
  get closed(): boolean { return this.ws.readyState === WebSocket.CLOSED; }
  setHandlers(h: SocketHandlers): void { this.h = h; }
  send(data: Uint8Array): void { this.ws.send(data); }
  close(code = 1000, reason?: string): void { this.ws.close(code, reason); }
  terminate(): void { this.ws.terminate(); }
}

export const wsDial: Dialer = (url, opt) => new Promise<Socket>((resolve, reject) => {
  const ws = new WebSocket(url, { perMessageDeflate: false, handshakeTimeout: opt.timeoutMs, maxPayload: opt.maxPayload });
  ws.binaryType = "nodebuffer";
  ws.once("open", () => resolve(new NodeSocket(ws)));
  ws.once("error", (e) => { ws.terminate(); reject(e); });
  ws.once("unexpected-response", (_req, res) => { ws.terminate(); reject(new ChannelClosed(`websocket upgrade refused: HTTP ${res.statusCode}`)); });
});

Connection.defaultDial = wsDial;
