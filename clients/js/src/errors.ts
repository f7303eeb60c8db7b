/** Error codes of the wire protocol (docs/PROTOCOL.md section 6) and the errors this client raises. */

export const ERROR_CODES = [
  "bad_frame", "frame_too_large", "unknown_message", "version_mismatch", "fingerprint_mismatch",
  "unauthorized", "handshake_required", "prompt_too_long", "bad_request", "overloaded",
  "unknown_request", "internal", "connection_closed",
] as const;
export type ErrorCode = (typeof ERROR_CODES)[number];

/** Close code a sender uses after a connection-level Error with this code (1008 for any other). */
export const CLOSE_CODES: Partial<Record<ErrorCode, number>> = {
  bad_frame: 1002, frame_too_large: 1009, unknown_message: 1002, version_mismatch: 1008,
  fingerprint_mismatch: 1008, unauthorized: 1008, handshake_required: 1002, bad_request: 1008,
  overloaded: 1013, internal: 1011,
};

export function knownCode(code: string): ErrorCode {
  return (ERROR_CODES as readonly string[]).includes(code) ? (code as ErrorCode) : "internal";
}

/** Base of every error of this package; `code` names the protocol error code. */
export class RelayInferError extends Error {
  readonly code: ErrorCode;
  constructor(code: ErrorCode, message: string) {
    super(`[${code}] ${message}`);
    this.name = "RelayInferError";
    this.code = code;
  }
}

/** We (or a check of ours) found the peer's frame or message invalid. */
export class ProtocolError extends RelayInferError {
  constructor(code: ErrorCode, message: string) {
    super(code, message);
    this.name = "ProtocolError";
  }
}

/** The peer sent an Error frame. `code` is mapped to a known code (unknown ones become `internal`;
 * the raw string stays in `rawCode`); `requestId` null = connection-level. */
export class RemoteError extends RelayInferError {
  readonly rawCode: string;
  readonly requestId: string | null;
  readonly retryAfterMs: number | null;
  constructor(code: string, message: string, requestId: string | null = null, retryAfterMs: number | null = null) {
    super(knownCode(code), message);
    this.name = "RemoteError";
    this.rawCode = code;
    this.requestId = requestId;
    this.retryAfterMs = retryAfterMs;
  }
}

/** The transport closed (local only, never sent). */
export class ChannelClosed extends RelayInferError {
  readonly closeCode: number | null;
  constructor(message: string, closeCode: number | null = null) {
    super("connection_closed", message);
    this.name = "ChannelClosed";
    this.closeCode = closeCode;
  }
}
