// The Node entry (the browser build: web/src/).
export * from "./errors.js";
export * from "./messages.js";
export { RequestTable, TRANSITIONS, type RequestState } from "./requests.js";
export { Connection, deviceModelBase, TimeoutError, type ConnectOptions, type RequestEvent } from "./session.js";
export * from "./platform.js";
export { wsDial } from "./socket-node.js";
export * from "./model.js";
export * from "./model-node.js";
export { Tokenizer, StreamDecoder, type ChatMessage, type TokenizerMeta } from "./tokenizer.js";
export { OnnxEngine, argmax, type KV, type Pace, type ModelConfig } from "./engine.js";
export { loadEngine } from "./engine-node.js";
export { SplitClient, askDeviceModelBase, releaseTime, checkGenerateOptions, UNSUPPORTED_SAMPLING, type ClientOptions, type GenerateOptions, type GenerationResult, type TokenEvent, type Mode } from "./split.js";
export { sampleToken, samplingProbs, positionUniform, seedKey, seedSequenceState, seedSequenceState64, PCG64, pairwiseSum, topPKeep, drawIndex, SAMPLING_EPS, type SamplingOptions } from "./sampling.js";
export { DeviceClient, loadTokenizer } from "./node.js";
