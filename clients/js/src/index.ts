export * from "./errors.js";
export * from "./messages.js";
export { RequestTable, TRANSITIONS, type RequestState } from "./requests.js";
export { Connection, deviceModelBase, TimeoutError, type ConnectOptions, type RequestEvent } from "./session.js";
export * from "./model.js";
export { Tokenizer, StreamDecoder, type ChatMessage } from "./tokenizer.js";
export { OnnxEngine, argmax, type KV, type Pace, type ModelConfig } from "./engine.js";
export { DeviceClient, releaseTime, sampleToken, type ClientOptions, type GenerateOptions, type GenerationResult, type TokenEvent, type Mode } from "./split.js";
