// Handshake and per-request rules against a scripted websocket server (the real cloud: tests/test_js_client.py).
import { test } from "node:test";
import assert from "node:assert/strict";
import { WebSocketServer, type WebSocket as WS } from "ws";
import { Connection, deviceModelBase } from "../src/session.js";
import "../src/socket-node.js"; // the default dialer: ws
import { decode, encode, type Message } from "../src/messages.js";
import { RemoteError, ProtocolError, RelayInferError } from "../src/errors.js";
import { RequestTable } from "../src/requests.js";

const FP = "ab".repeat(32);

async function server(script: (ws: WS, hello: Message) => void): Promise<{ url: string; close: () => Promise<void>; got: Message[] }> {
  const wss = new WebSocketServer({ port: 0, host: "127.0.0.1" });
  await new Promise((r) => wss.once("listening", r));
  const got: Message[] = [];
  wss.on("connection", (ws) => {
    let first = true;
    ws.on("message", (d) => {
      const m = decode(new Uint8Array(d as Buffer));
      got.push(m);
      if (first) { first = false; script(ws, m); }
    });
  });
  const port = (wss.address() as { port: number }).port;
  return {
    url: `ws://127.0.0.1:${port}`, got,
    close: () => new Promise((r) => { for (const c of wss.clients) c.terminate(); wss.close(() => r()); }),
  };
}

const send = (ws: WS, m: Message) => ws.send(encode(m));

test("welcome: connected, hello carries version, fingerprint, token", async () => {
  const s = await server((ws) => send(ws, { type: "welcome", protocol_version: 1, model_fingerprint: FP, server: "fake", session_id: "0123456789abcdef", device_model_url: "http://127.0.0.1:9/v1/device-model" }));
  const c = await Connection.connect(s.url, { fingerprint: FP, token: "t0k" });
  assert.equal(c.welcome.server, "fake");
  const h = s.got[0] as { type: string; protocol_version: number; model_fingerprint: string; token: string };
  assert.deepEqual([h.type, h.protocol_version, h.model_fingerprint, h.token], ["hello", 1, FP, "t0k"]);
  await c.close();
  await s.close();
});

for (const [code, retry] of [["unauthorized", null], ["fingerprint_mismatch", null], ["overloaded", 5000], ["some_future_code", null]] as const) {
  test(`refused handshake: ${code} becomes a RemoteError naming the code`, async () => {
    const s = await server((ws) => { send(ws, { type: "error", code, message: "no", retry_after_ms: retry }); ws.close(1008); });
    await assert.rejects(Connection.connect(s.url, { fingerprint: FP }), (e: unknown) => {
      assert.ok(e instanceof RemoteError);
      assert.equal(e.code, code === "some_future_code" ? "internal" : code);
      assert.equal(e.rawCode, code);
      assert.equal(e.retryAfterMs, retry);
      return true;
    });
    await s.close();
  });
}

test("a welcome of another version / fingerprint is refused locally", async () => {
  for (const [w, code] of [[{ protocol_version: 2, model_fingerprint: FP }, "version_mismatch"], [{ protocol_version: 1, model_fingerprint: "cd".repeat(32) }, "fingerprint_mismatch"]] as const) {
    const s = await server((ws) => send(ws, { type: "welcome", ...w }));
    await assert.rejects(Connection.connect(s.url, { fingerprint: FP }), (e: unknown) => e instanceof ProtocolError && e.code === code);
    await s.close();
  }
});

test("a request: tokens in order, ping answered, done; a gap in the indices is a violation", async () => {
  const s = await server((ws) => {
    send(ws, { type: "welcome", protocol_version: 1, model_fingerprint: FP });
    ws.on("message", (d) => {
      const m = decode(new Uint8Array(d as Buffer));
      if (m.type !== "generate") return;
      if (m.request_id === "r1") {
        send(ws, { type: "token", request_id: "r1", token_id: 5, index: 0, t_cloud_ms: 1.5 });
        send(ws, { type: "ping", nonce: 7, t_ms: 3 });
        send(ws, { type: "token", request_id: "r1", token_id: 6, index: 1, t_cloud_ms: 2.5, finish_reason: "eos" });
        send(ws, { type: "done", request_id: "r1", reason: "eos", cloud_tokens: 2, prefill_ms: 1 });
      } else {
        send(ws, { type: "token", request_id: "r2", token_id: 5, index: 1, t_cloud_ms: 1.5 });
      }
    });
  });
  const c = await Connection.connect(s.url, { fingerprint: FP });
  c.start({ type: "generate", request_id: "r1", prompt_ids: [1, 2], max_new_tokens: 4 });
  const evs = [];
  for (let i = 0; i < 3; i++) evs.push(await c.next("r1", 2000));
  assert.deepEqual(evs.map((e) => (e.kind === "message" ? e.message.type : e.kind)), ["token", "token", "done"]);
  assert.equal(c.send({ type: "stop", request_id: "r1", handoff_index: 2 }), false); // crossed the done: ignored
  c.start({ type: "generate", request_id: "r2", prompt_ids: [1], max_new_tokens: 4 });
  const v = await c.next("r2", 2000);
  assert.equal(v.kind, "violation");
  await new Promise((r) => setTimeout(r, 50));
  assert.ok(s.got.some((m) => m.type === "pong" && m.nonce === 7));
  await c.close();
  await s.close();
});

test("a connection-level error ends every request with a RemoteError", async () => {
  const s = await server((ws) => {
    send(ws, { type: "welcome", protocol_version: 1, model_fingerprint: FP });
    setTimeout(() => send(ws, { type: "error", code: "internal", message: "boom" }), 20);
  });
  const c = await Connection.connect(s.url, { fingerprint: FP });
  c.start({ type: "generate", request_id: "r1", prompt_ids: [1], max_new_tokens: 4 });
  await assert.rejects(c.next("r1", 2000), (e: unknown) => e instanceof RelayInferError && e.code === "internal");
  await s.close();
});

test("request table: stop before any generate is a violation; done with a wrong count too", () => {
  const t = new RequestTable();
  assert.equal(t.apply("send", { type: "stop", request_id: "x", handoff_index: 0 }).ok, false);
  t.apply("send", { type: "generate", request_id: "x", prompt_ids: [1], max_new_tokens: 1 });
  assert.equal(t.apply("recv", { type: "done", request_id: "x", reason: "eos", cloud_tokens: 1, prefill_ms: 0 }).ok, false);
  assert.equal(t.apply("recv", { type: "done", request_id: "x", reason: "cancel", cloud_tokens: 0, prefill_ms: 0 }).ok, true);
  assert.equal(t.state("x"), "DONE");
});

test("device_model_url: a loopback host becomes the host dialled", () => {
  assert.equal(deviceModelBase("http://127.0.0.1:8080/v1/device-model", "ws://10.0.0.5:8765"), "http://10.0.0.5:8080");
  assert.equal(deviceModelBase("http://cloud.example:8080/v1/device-model", "ws://10.0.0.5:8765"), "http://cloud.example:8080");
  assert.equal(deviceModelBase("", "ws://x:1"), null);
});
