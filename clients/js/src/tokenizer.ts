/**
 * The served tokenizer (tokenizer.json + tokenizer_meta.json's chat template), as
 * relayinfer.protocol.model.tokenizer.Tokenizer: the chat template rendered by @huggingface/jinja
 * (trim_blocks, lstrip_blocks), only the template's own markup matched as added tokens, message
 * contents encoded as plain text, BPE by @huggingface/tokenizers.
 */
import { Tokenizer as HFTokenizer } from "@huggingface/tokenizers";
import { Template } from "@huggingface/jinja";

export interface ChatMessage { role: string; content: string }

export interface TokenizerMeta { chat_template?: string | null; bos_id: number; eos_id: number; add_bos?: boolean; add_eos?: boolean }

interface AddedToken { id: number; content: string; special: boolean }

function byteDecoder(): Map<string, number> {
  const bs: number[] = [];
  for (let i = 33; i <= 126; i++) bs.push(i);
  for (let i = 161; i <= 172; i++) bs.push(i);
  for (let i = 174; i <= 255; i++) bs.push(i);
  const cs = bs.slice();
  let n = 0;
  for (let b = 0; b < 256; b++) if (!bs.includes(b)) { bs.push(b); cs.push(256 + n); n++; }
  const m = new Map<string, number>();
  bs.forEach((b, i) => m.set(String.fromCodePoint(cs[i]), b));
  return m;
}

function escapeRe(s: string): string { return s.replace(/[.*+?^${}()|[\]\\]/g, "\\$&"); }

export class Tokenizer {
  readonly bosId: number;
  readonly eosId: number;
  readonly addBos: boolean;
  readonly addEos: boolean;
  readonly chatTemplate: string | null;
  private tok: HFTokenizer;
  private plain: HFTokenizer;
  private template: Template;
  private added: AddedToken[];
  private addedRe: RegExp | null;
  private addedId = new Map<string, number>();
  private table: Uint8Array[] | null = null;
  private json: Record<string, unknown>;

  /** From what `relayinfer export` wrote: tokenizer.json and tokenizer_meta.json, parsed (Node: loadTokenizer(dir)). */
  constructor(tokenizerJson: Record<string, unknown>, meta: TokenizerMeta) {
    this.json = tokenizerJson;
    this.tok = new HFTokenizer(tokenizerJson as never, {} as never);
    this.plain = new HFTokenizer({ ...tokenizerJson, added_tokens: [] } as never, {} as never);
    this.bosId = meta.bos_id;
    this.eosId = meta.eos_id;
    this.addBos = !!meta.add_bos;
    this.addEos = !!meta.add_eos;
    this.chatTemplate = meta.chat_template ?? null;
    if (!this.chatTemplate) throw new Error("this client needs a chat template (tokenizer_meta.json has none)");
    this.template = new Template(this.chatTemplate);
    this.added = ((tokenizerJson.added_tokens ?? []) as AddedToken[]).map((t) => ({ id: t.id, content: t.content, special: !!t.special }));
    for (const t of this.added) this.addedId.set(t.content, t.id);
    const names = this.added.map((t) => t.content).sort((a, b) => b.length - a.length);
    this.addedRe = names.length ? new RegExp(names.map(escapeRe).join("|"), "g") : null;
  }

  get vocabSize(): number {
    const v = ((this.json.model as { vocab?: Record<string, number> }).vocab) ?? {};
    let n = Object.keys(v).length;
    for (const t of this.added) n = Math.max(n, t.id + 1);
    return n;
  }

  /** Token ids of `text`, no BOS/EOS; `special`: added tokens written in the text are matched. */
  encode(text: string, special = true): number[] {
    return (special ? this.tok : this.plain).encode(text, { add_special_tokens: false }).ids;
  }

  private bosEos(ids: number[]): number[] {
    if (this.addBos && ids[0] !== this.bosId) ids = [this.bosId, ...ids];
    if (this.addEos && ids[ids.length - 1] !== this.eosId) ids = [...ids, this.eosId];
    return ids;
  }

  renderChat(messages: ChatMessage[], addGenerationPrompt = true): string {
    const tokOf = (id: number) => this.added.find((t) => t.id === id)?.content ?? "";
    return this.template.render({ messages, add_generation_prompt: addGenerationPrompt, bos_token: tokOf(this.bosId), eos_token: tokOf(this.eosId) });
  }

  /** Prompt ids of a user string (one user turn) or of chat messages, as the Python Tokenizer.encode_chat. */
  encodeChat(prompt: string | ChatMessage[], addGenerationPrompt = true): number[] {
    const messages = typeof prompt === "string" ? [{ role: "user", content: prompt }] : prompt;
    if (!this.addedRe) return this.bosEos(this.encode(this.renderChat(messages, addGenerationPrompt)));
    const nonce = Math.random().toString(16).slice(2) + Date.now().toString(16);
    const open = `\ue000${nonce}\ue001`, close = `\ue002${nonce}\ue003`;
    const marked = this.renderChat(messages.map((m) => ({ ...m, content: open + m.content + close })), addGenerationPrompt);
    const plain = this.renderChat(messages, addGenerationPrompt);
    if (marked.split(open).join("").split(close).join("") !== plain) {
      throw new Error("the chat template transforms message contents; cannot keep them apart from its markup");
    }
    const ids: number[] = [];
    let text: string[] = [];
    const flush = () => { const s = text.join(""); if (s) ids.push(...this.plain.encode(s, { add_special_tokens: false }).ids); text = []; };
    let pos = 0;
    while (pos < marked.length) {
      const start = marked.indexOf(open, pos);
      const tmpl = start < 0 ? marked.slice(pos) : marked.slice(pos, start);
      let last = 0;
      this.addedRe.lastIndex = 0;
      for (const hit of tmpl.matchAll(this.addedRe)) {
        text.push(tmpl.slice(last, hit.index));
        flush();
        ids.push(this.addedId.get(hit[0])!);
        last = hit.index! + hit[0].length;
      }
      text.push(tmpl.slice(last));
      if (start < 0) break;
      const end = marked.indexOf(close, start);
      text.push(marked.slice(start + open.length, end));
      pos = end + close.length;
    }
    flush();
    return this.bosEos(ids);
  }

  /** The UTF-8 bytes token `id` stands for (empty for a special token). */
  tokenBytes(id: number): Uint8Array {
    if (!this.table) {
      const bd = byteDecoder();
      const vocab = (this.json.model as { vocab: Record<string, number> }).vocab;
      const table: Uint8Array[] = new Array(this.vocabSize).fill(new Uint8Array(0));
      const enc = new TextEncoder();
      for (const [s, i] of Object.entries(vocab)) {
        const chars = Array.from(s);
        table[i] = chars.every((c) => bd.has(c)) ? Uint8Array.from(chars.map((c) => bd.get(c)!)) : enc.encode(s);
      }
      for (const t of this.added) table[t.id] = t.special ? new Uint8Array(0) : enc.encode(t.content);
      this.table = table;
    }
    return this.table[id] ?? new Uint8Array(0);
  }

  decode(ids: number[], skipSpecial = false): string {
    return this.tok.decode(ids, { skip_special_tokens: skipSpecial });
  }

  streamDecoder(): StreamDecoder { return new StreamDecoder(this); }
}

/** Incremental detokenizer: `push(id)` returns the text the token adds (an incomplete UTF-8
 * character is held back; one still incomplete at the end is dropped), as the Python StreamDecoder. */
export class StreamDecoder {
  private utf8 = new TextDecoder("utf-8", { fatal: false });
  private parts: string[] = [];
  constructor(private t: Tokenizer) {}
  push(id: number): string {
    const s = this.utf8.decode(this.t.tokenBytes(id), { stream: true });
    if (s) this.parts.push(s);
    return s;
  }
  get text(): string { return this.parts.join(""); }
}
