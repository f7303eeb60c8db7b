"""Prometheus metrics of one batching engine, fed from outside its step.

The engine counts nothing itself: each `LLMEngine.step` leaves a `StepStats` (what the step ran,
its latencies, the requests that ended, the cache state after it) in `last_stats`, and whoever
drives the engine passes it with the step's `StepOutput`s to `EngineMetrics.observe`
(`AsyncLLMEngine` does after every step). Names follow Prometheus' rules (`promtool check metrics`
passes: base units, `_total` only on counters) and vLLM's where it has one
(`e2e_request_latency_seconds`, `request_prompt_tokens`, `request_generation_tokens`,
`request_success_total{finished_reason}`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Latency bucket edges (s), log-spaced from 5 ms to 30 min: past the longest request the limits allow
# (a whole 8,192-token context at CPU speed is minutes), so no observation lands in +Inf unseen.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
                   320.0, 640.0, 1200.0, 1800.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5)
"""Edges (s) of the time-between-tokens histograms (engine and P/D gateway)."""
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
# finish reason -> OpenAI finish_reason label (stop: EOS, stop id or stop string; length: max_tokens or budget)
_SUCCESS = {"eos": "stop", "stop": "stop", "length": "length", "budget": "length"}


class Finished(NamedTuple):
    """A request that ended: its finish reason ('eos', 'stop', 'length', 'budget', 'abort',
    'error'), arrival -> end (s), prompt tokens, generated tokens."""

    reason: str
    e2e_s: float
    num_prompt_tokens: int
    num_output_tokens: int


@dataclass
class StepStats:
    """What one `LLMEngine.step` did (`LLMEngine.last_stats`), for `EngineMetrics.observe`.
    Times in seconds, counts in tokens unless named.

    Attributes:
        batch_seqs / batch_tokens: sequences / tokens the step ran through the model (0: none).
        prefill_tokens: prompt tokens computed.
        queue_s: arrival -> first scheduling of the sequences first scheduled in the step.
        ttft_s: arrival -> first token; tpot_s: time since the previous token (other tokens).
        prefix_query_tokens / prefix_hit_tokens: tokens of the sequences admitted in the step,
            and those of them reused from the prefix cache.
        preemptions: sequences preempted.
        finished: a `Finished` per request that ended in the step.
        blocks_used / blocks_cached: KV blocks referenced / free but holding a cached prefix,
            running / waiting: sequences, all four after the step.
    """

    batch_seqs: int = 0
    batch_tokens: int = 0
    prefill_tokens: int = 0
    queue_s: Sequence[float] = ()
    ttft_s: Sequence[float] = ()
    tpot_s: Sequence[float] = ()
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    preemptions: int = 0
    finished: list[Finished] = field(default_factory=list)
    blocks_used: int = 0
    blocks_cached: int = 0
    running: int = 0
    waiting: int = 0


class _StepMetrics:
    """Per step: batch shape, tokens, latencies, prefix cache lookups, preemptions."""

    def __init__(self, r: CollectorRegistry):
        self.ttft = Histogram("relayinfer_engine_ttft_seconds", "Time to first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.tpot = Histogram("relayinfer_engine_tpot_seconds", "Time between consecutive output tokens of a request",
                              registry=r, buckets=TPOT_BUCKETS)
        self.queue = Histogram("relayinfer_engine_queue_seconds", "Arrival to first scheduling", registry=r,
                               buckets=LATENCY_BUCKETS)
        self.batch_seqs = Histogram("relayinfer_engine_batch_size", "Sequences per step", registry=r,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128))
        self.batch_tokens = Histogram("relayinfer_engine_batch_tokens", "Tokens per step", registry=r,
                                      buckets=(1, 4, 16, 64, 128, 256, 512, 1024, 2048))
        self.prompt_tokens = Counter("relayinfer_engine_prefill_tokens", "Tokens computed in prefill", registry=r)
        self.gen_tokens = Counter("relayinfer_engine_generation_tokens", "Tokens generated", registry=r)
        self.preemptions = Counter("relayinfer_engine_preemptions", "Sequences preempted (recompute)", registry=r)
        self.prefix_queries = Counter("relayinfer_engine_prefix_cache_query_tokens",
                                      "Prompt tokens looked up in the prefix cache", registry=r)
        self.prefix_hits = Counter("relayinfer_engine_prefix_cache_hit_tokens",
                                   "Prompt tokens reused from the prefix cache", registry=r)
        self.prefix_hit_rate = Gauge("relayinfer_engine_prefix_cache_hit_rate",
                                     "hit tokens / query tokens since start", registry=r)
        self._queries = self._hits = 0  # since start, for the hit rate

    def observe(self, outputs: Sequence, st: StepStats) -> None:
        for h, values in ((self.queue, st.queue_s), (self.ttft, st.ttft_s), (self.tpot, st.tpot_s)):
            for v in values:
                h.observe(v)
        if st.batch_seqs:
            self.batch_seqs.observe(st.batch_seqs)
            self.batch_tokens.observe(st.batch_tokens)
        self.prompt_tokens.inc(st.prefill_tokens)
        self.gen_tokens.inc(len(outputs))
        self.preemptions.inc(st.preemptions)
        if st.prefix_query_tokens:
            self._queries += st.prefix_query_tokens
            self._hits += st.prefix_hit_tokens
            self.prefix_queries.inc(st.prefix_query_tokens)
            self.prefix_hits.inc(st.prefix_hit_tokens)
            self.prefix_hit_rate.set(self._hits / self._queries)


class _RequestMetrics:
    """Per finished request: latency, sizes, finish reason."""

    def __init__(self, r: CollectorRegistry):
        self.e2e = Histogram("relayinfer_engine_e2e_request_latency_seconds",
                             "Arrival to the last token (or abort) of a request", registry=r, buckets=LATENCY_BUCKETS)
        self.prompt_tokens = Histogram("relayinfer_engine_request_prompt_tokens", "Prompt tokens per request",
                                       registry=r, buckets=TOKEN_BUCKETS)
        self.gen_tokens = Histogram("relayinfer_engine_request_generation_tokens",
                                    "Generated tokens per finished request", registry=r, buckets=TOKEN_BUCKETS)
        self.success = Counter("relayinfer_engine_request_success", "Finished requests by OpenAI finish reason "
                               "(stop: EOS, stop id or stop string; length: max_tokens or budget; abort)",
                               ["finished_reason"], registry=r)
        self.finished = Counter("relayinfer_engine_requests", "Finished requests by reason", ["reason"], registry=r)

    def observe(self, st: StepStats) -> None:
        for f in st.finished:
            self.finished.labels(f.reason).inc()
            self.success.labels(_SUCCESS.get(f.reason, "abort")).inc()
            self.e2e.observe(f.e2e_s)
            self.prompt_tokens.observe(f.num_prompt_tokens)
            self.gen_tokens.observe(f.num_output_tokens)


class _CacheMetrics:
    """The KV cache and the queues: sizes (set once) and their state after the last step."""

    def __init__(self, r: CollectorRegistry):
        self.blocks_total = Gauge("relayinfer_engine_kv_blocks", "KV blocks in the cache", registry=r)
        self.kv_bytes_per_token = Gauge("relayinfer_engine_kv_bytes_per_token",
                                        "K+V bytes of one token over all layers", registry=r)
        self.kv_cache_bytes = Gauge("relayinfer_engine_kv_cache_bytes", "KV cache memory (bytes)", registry=r)
        self.blocks_used = Gauge("relayinfer_engine_kv_blocks_used", "KV blocks referenced", registry=r)
        self.blocks_cached = Gauge("relayinfer_engine_kv_blocks_cached", "Free KV blocks holding a cached prefix",
                                   registry=r)
        self.running = Gauge("relayinfer_engine_running", "Running sequences", registry=r)
        self.waiting = Gauge("relayinfer_engine_waiting", "Waiting sequences", registry=r)

    def observe(self, st: StepStats) -> None:
        self.blocks_used.set(st.blocks_used)
        self.blocks_cached.set(st.blocks_cached)
        self.running.set(st.running)
        self.waiting.set(st.waiting)


class EngineMetrics:
    """The `relayinfer_engine_*` series of one engine, in `registry` (a new `CollectorRegistry`
    unless one is passed). `engine` (optional, an `llm_engine.LLMEngine`) sets the size gauges:
    KV blocks, K+V bytes per token, KV cache bytes. Thread-safe as prometheus-client is:
    `observe` may run on the engine thread while another thread renders `registry`."""

    def __init__(self, engine=None, registry: CollectorRegistry | None = None):
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.step, self.requests, self.cache = _StepMetrics(r), _RequestMetrics(r), _CacheMetrics(r)
        if engine is not None:
            self.cache.blocks_total.set(engine.num_blocks)
            self.cache.kv_bytes_per_token.set(engine.kv_bytes_per_token)
            self.cache.kv_cache_bytes.set(engine.runner.nbytes)

    def observe(self, outputs: Sequence, stats: StepStats) -> None:
        """Count one engine step: its outputs (`llm_engine.StepOutput`s, one generated token
        each) and its `StepStats` (`LLMEngine.last_stats` right after the step)."""
        self.step.observe(outputs, stats)
        self.requests.observe(stats)
        self.cache.observe(stats)
