/** The device's per-request state machine (docs/PROTOCOL.md "Per-request state at each end",
 * the Device table; reference: relayinfer.protocol.requests, Role.DEVICE). */
import type { Message } from "./messages.js";

export type RequestState = "IDLE" | "SENT" | "RECEIVING" | "STOP_SENT" | "CANCEL_SENT" | "DONE" | "ERRORED";
type Cell = RequestState | "ignored" | null; // null = violation

const LIVE: RequestState[] = ["SENT", "RECEIVING", "STOP_SENT", "CANCEL_SENT"];
function row(f: (s: RequestState) => Cell): Record<RequestState, Cell> {
  const out = {} as Record<RequestState, Cell>;
  for (const s of ["IDLE", "SENT", "RECEIVING", "STOP_SENT", "CANCEL_SENT", "DONE", "ERRORED"] as RequestState[]) out[s] = f(s);
  return out;
}
const ENDED = (s: RequestState) => s === "DONE" || s === "ERRORED";
const STOPPING = (s: RequestState) => s === "STOP_SENT" || s === "CANCEL_SENT";

/** TRANSITIONS[event][state] -> next state, "ignored" or null (a violation). */
export const TRANSITIONS: Record<string, Record<RequestState, Cell>> = {
  "send generate": row((s) => (s === "IDLE" || ENDED(s) ? "SENT" : null)),
  "send extend_budget": row((s) => (s === "SENT" || s === "RECEIVING" ? s : s === "IDLE" ? null : "ignored")),
  "send stop": row((s) => (s === "SENT" || s === "RECEIVING" ? "STOP_SENT" : s === "IDLE" ? null : "ignored")),
  "send cancel": row((s) => (s === "SENT" || s === "RECEIVING" ? "CANCEL_SENT" : s === "IDLE" ? null : "ignored")),
  "recv token": row((s) => (s === "SENT" ? "RECEIVING" : s === "RECEIVING" || STOPPING(s) ? s : null)),
  "recv refined_prompt": row((s) => (s === "RECEIVING" || STOPPING(s) ? s : null)),
  "recv kv_transfer": row((s) => (s === "RECEIVING" || STOPPING(s) ? s : null)),
  "recv done": row((s) => (LIVE.includes(s) ? "DONE" : null)),
  "recv error": row((s) => (LIVE.includes(s) ? "ERRORED" : null)),
};

export type Verdict = { ok: true; ignored: boolean } | { ok: false; reason: string };

interface Entry { state: RequestState; streamed: number; refine: boolean; kvFrom: boolean; refined: boolean }

/** The states of one connection's requests, device side. */
export class RequestTable {
  private entries = new Map<string, Entry>();

  state(id: string): RequestState { return this.entries.get(id)?.state ?? "IDLE"; }
  streamed(id: string): number { return this.entries.get(id)?.streamed ?? 0; }

  /** Check and apply one message the device sends (`send`) or receives (`recv`). */
  apply(dir: "send" | "recv", msg: Message): Verdict {
    const id = (msg as { request_id?: string | null }).request_id;
    if (typeof id !== "string") return { ok: true, ignored: false };
    const cells = TRANSITIONS[`${dir} ${msg.type}`];
    if (!cells) return { ok: false, reason: `the device does not ${dir} ${msg.type} messages` };
    const e = this.entries.get(id) ?? { state: "IDLE" as RequestState, streamed: 0, refine: false, kvFrom: false, refined: false };
    const next = cells[e.state];
    if (next === null) return { ok: false, reason: `request ${id} in state ${e.state} cannot ${dir} ${msg.type}` };
    if (next === "ignored") return { ok: true, ignored: true };
    if (msg.type === "generate") {
      Object.assign(e, { streamed: 0, refine: msg.refine != null, kvFrom: msg.kv_from != null, refined: false });
    } else if (msg.type === "token") {
      if (msg.index !== e.streamed) return { ok: false, reason: `request ${id}: token index ${msg.index}, expected ${e.streamed}` };
      e.streamed++;
    } else if (msg.type === "done") {
      if (msg.cloud_tokens !== e.streamed) return { ok: false, reason: `request ${id}: done.cloud_tokens ${msg.cloud_tokens} != ${e.streamed} streamed` };
    } else if (msg.type === "refined_prompt") {
      if (!e.refine || e.refined) return { ok: false, reason: `request ${id}: refined_prompt without refine, or twice` };
      e.refined = true;
    } else if (msg.type === "kv_transfer") {
      if (!e.kvFrom) return { ok: false, reason: `request ${id}: kv_transfer without kv_from` };
    }
    e.state = next;
    this.entries.set(id, e);
    if (this.entries.size > 1024) { // bounded history: forget the oldest ended requests
      for (const [k, v] of this.entries) { if (ENDED(v.state)) { this.entries.delete(k); break; } }
    }
    return { ok: true, ignored: false };
  }
}
