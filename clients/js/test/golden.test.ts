// Every golden frame of docs/golden decodes to its JSON and its JSON encodes to the exact bytes.
import { test } from "node:test";
import assert from "node:assert/strict";
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { decode, encode, fromJSON, FrameBuffer, packFrame, type Message } from "../src/messages.js";
import { ProtocolError } from "../src/errors.js";

const here = path.dirname(fileURLToPath(import.meta.url));
const GOLDEN = path.resolve(here, "../../../../docs/golden");
const index = JSON.parse(fs.readFileSync(path.join(GOLDEN, "index.json"), "utf8"));

test("golden index lists every example and protocol version 1", () => {
  assert.equal(index.protocol_version, 1);
  assert.ok(index.examples.length >= 30);
});

for (const ex of index.examples) {
  test(`golden ${ex.name}: decode == json, encode == bytes`, () => {
    const bytes = new Uint8Array(fs.readFileSync(path.join(GOLDEN, ex.bytes)));
    const json = JSON.parse(fs.readFileSync(path.join(GOLDEN, ex.json), "utf8"));
    const want: Record<string, unknown>[] = ex.framing === "stream" ? json : [json];
    let bodies: Uint8Array[];
    if (ex.framing === "stream") {
      const fb = new FrameBuffer();
      bodies = fb.push(bytes);
      assert.equal(fb.pending, 0);
    } else {
      bodies = [bytes];
    }
    assert.equal(bodies.length, want.length);
    assert.deepEqual(bodies.map((b) => decode(b).type), ex.types);
    const encoded: Uint8Array[] = [];
    for (let i = 0; i < want.length; i++) {
      const msg: Message = fromJSON(want[i]);
      assert.deepEqual(decode(bodies[i]), msg);
      const enc = encode(msg);
      assert.deepEqual(Buffer.from(enc).toString("hex"), Buffer.from(bodies[i]).toString("hex"));
      encoded.push(ex.framing === "stream" ? packFrame(enc) : enc);
    }
    if (ex.framing === "stream") assert.deepEqual(Buffer.concat(encoded), Buffer.from(bytes));
  });
}

test("bad frames are bad_frame / unknown_message", () => {
  const code = (f: () => unknown) => { try { f(); } catch (e) { return (e as ProtocolError).code; } return "ok"; };
  assert.equal(code(() => decode(Uint8Array.of(0xc1))), "bad_frame");
  const tok = encode({ type: "token", request_id: "r", token_id: 1, index: 0, t_cloud_ms: 1 });
  assert.equal(code(() => decode(new Uint8Array([...tok, 0]))), "bad_frame"); // trailing byte
  assert.equal(code(() => decode(tok.slice(0, tok.length - 1))), "bad_frame"); // truncated
  assert.equal(code(() => decode(encode({ type: "cancel", request_id: "r" }).slice(0) && Uint8Array.of(0x81, 0xa4, 0x74, 0x79, 0x70, 0x65, 0xa3, 0x66, 0x6f, 0x6f))), "unknown_message");
  assert.equal(code(() => decode(Uint8Array.of(0x80))), "bad_frame"); // no type
  // a str where bin belongs
  assert.equal(code(() => fromJSON({ type: "scores", request_id: "r", prefix_source: "none", scores: { dtype: "float32", shape: [2], data: "AAAA" } })), "bad_frame");
  assert.equal(code(() => fromJSON({ type: "scores", request_id: "r", prefix_source: "none", scores: { dtype: "float64", shape: [0], data: "" } })), "bad_frame");
  // stream frame over the limit is refused from its header
  assert.equal(code(() => new FrameBuffer(10).push(Uint8Array.of(0, 0, 0, 11))), "frame_too_large");
});

test("floats are float64 even when integral, ints the smallest width, big seeds as uint64", () => {
  const b = encode({ type: "ping", nonce: 1, t_ms: 2 });
  assert.equal(Buffer.from(b).toString("hex"), "83a474797065a470696e67a56e6f6e636501a4745f6d73cb4000000000000000");
  const g = decode(encode({ type: "generate", request_id: "r", prompt_ids: [1], max_new_tokens: 1, seed: (1n << 64n) - 1n }));
  assert.equal((g as { seed: bigint }).seed, (1n << 64n) - 1n);
});
