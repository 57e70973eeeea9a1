"""Prometheus metrics of the engine, served by Triton on its metrics port.

Our names (`eagle_*`, DESIGN.md) and, for the dashboards and benchmark tools built for vLLM
(aiperf's speculative-decoding report, vLLM's Grafana dashboard), the same quantities under
vLLM's names, types and labels: `vllm:*` counters carry the `_total` suffix that vLLM's
Prometheus client adds, the per-position counter is 0-based, finish reason "cancelled" is
vLLM's "abort", and every `vllm:*` metric has vLLM's `model_name` label (the target folder's
name, the OpenAI server's model id). A draft (vLLM's word) is one verify round of one request
that checked at least one draft token; the mean acceptance length is 1 + accepted / drafts over
every draft since the server started (vLLM's and SGLang's definition; a per-request acceptance
length counts every round, see requests.acceptance_length).
"""
from __future__ import annotations

import time

from eagle_serve.engine import Engine
from eagle_serve.spec.lookup import SOURCES

FLUSH_INTERVAL_S = 0.25  # counters lag the engine by at most this (Prometheus scrapes every few s)
LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
LENGTH_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000]
REQUEST_BUCKETS = [0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0]
FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}  # ours: vLLM's
ENGINE_COUNTERS = {  # EngineStats field: (our name, vLLM's name or None, description)
    "draft_tokens": ("eagle_spec_decode_draft_tokens_total", "vllm:spec_decode_num_draft_tokens_total",
                     "Draft tokens verified"),
    "accepted_tokens": ("eagle_spec_decode_accepted_tokens_total",
                        "vllm:spec_decode_num_accepted_tokens_total", "Draft tokens accepted"),
    "drafts": ("eagle_spec_decode_drafts_total", "vllm:spec_decode_num_drafts_total",
               "Verify rounds of a request that checked at least one draft token"),
    "rounds": ("eagle_spec_decode_rounds_total", None, "Verify rounds, counted per request"),
    "steps": ("eagle_engine_steps_total", None, "Batched engine rounds (target forwards)"),
    "preemptions": ("eagle_preemptions_total", "vllm:num_preemptions_total",
                    "Requests preempted for KV pages (recomputed later)"),
    "prefix_cache_queries": ("eagle_prefix_cache_queries_total", "vllm:prefix_cache_queries_total",
                             "Prompt tokens of admitted requests looked up in the prefix cache"),
    "prefix_cache_hits": ("eagle_prefix_cache_hits_total", "vllm:prefix_cache_hits_total",
                          "Prompt tokens found in the prefix cache"),
}


class _Each:
    """One quantity kept by several Triton metrics (ours and vLLM's): every update goes to all.
    A gauge set to the value it holds is not sent again (each call is a message to the Triton
    process, ~0.1 ms)."""

    def __init__(self, *metrics):
        self.metrics = [m for m in metrics if m is not None]
        self.value = None  # a gauge's last value

    def increment(self, value) -> None:
        for m in self.metrics:
            m.increment(value)

    def set(self, value) -> None:
        if value == self.value:
            return
        self.value = value
        for m in self.metrics:
            m.set(value)

    def observe(self, value) -> None:
        for m in self.metrics:
            m.observe(value)


class EngineMetrics:
    def __init__(self, pb, max_positions: int, model_name: str = ""):
        fam = pb.MetricFamily
        self._families = []  # a family must outlive its metrics: keep them all
        vllm = {"model_name": model_name}

        def family(name, description, kind):
            self._families.append(fam(name=name, description=description, kind=kind))
            return self._families[-1]

        def metric(name, description, kind, labels=None, **kw):
            return None if name is None else family(name, description, kind).Metric(labels=labels or {}, **kw)

        def both(ours, theirs, description, kind, labels=None, **kw):
            return _Each(metric(ours, description, kind, labels, **kw),
                         metric(theirs, description, kind, {**vllm, **(labels or {})}, **kw))

        self.counters = {key: both(ours, theirs, d, fam.COUNTER)
                         for key, (ours, theirs, d) in ENGINE_COUNTERS.items()}
        per_pos = family("eagle_spec_decode_accepted_tokens_per_position_total",
                         "Accepted draft tokens by draft position (1-based)", fam.COUNTER)
        per_pos_vllm = family("vllm:spec_decode_num_accepted_tokens_per_pos_total",
                              "Accepted draft tokens by draft position (0-based)", fam.COUNTER)
        self.per_position = [_Each(per_pos.Metric(labels={"position": str(j + 1)}),
                                   per_pos_vllm.Metric(labels={**vllm, "position": str(j)}))
                             for j in range(max_positions)]
        by_source = {name: family(name, description + " by draft source (eagle: the head; context, "
                                  "corpus: lookups)", fam.COUNTER)
                     for name, description in (
                         ("eagle_spec_decode_draft_tokens_by_source_total", "Draft tokens verified"),
                         ("eagle_spec_decode_accepted_tokens_by_source_total", "Draft tokens accepted"))}
        self.by_source = {
            (stat, source): family_.Metric(labels={"source": source})
            for stat, family_ in zip(("draft_tokens_by_source", "accepted_tokens_by_source"), by_source.values())
            for source in SOURCES}
        self.acceptance_length = _Each(metric(
            "eagle_spec_decode_mean_acceptance_length", "Mean acceptance length since start: "
            "1 + accepted draft tokens / drafts (0 before the first draft)", fam.GAUGE))
        self.running = both("eagle_requests_running", "vllm:num_requests_running",
                            "Requests in the running batch", fam.GAUGE)
        self.waiting = both("eagle_requests_waiting", "vllm:num_requests_waiting",
                            "Requests waiting for admission", fam.GAUGE)
        pages_free = family("eagle_kv_pages_free", "Free KV cache pages", fam.GAUGE)
        pages_total = family("eagle_kv_pages_total", "KV cache pages", fam.GAUGE)
        self.pages_free = {p: _Each(pages_free.Metric(labels={"pool": p})) for p in ("target", "drafter")}
        self.pages_total = {p: _Each(pages_total.Metric(labels={"pool": p})) for p in ("target", "drafter")}
        usage = ("Share of the target's KV pages mapped by requests (0-1; cached pages no request "
                 "maps count as free)")
        self.kv_usage = both("eagle_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc", usage, fam.GAUGE)
        # vLLM's name before v1, which its Grafana dashboard's "Cache Utilization" still reads
        self.kv_usage.metrics.append(metric("vllm:gpu_cache_usage_perc", usage, fam.GAUGE, vllm))
        self.slots_free = _Each(metric("eagle_draft_slots_free", "Free draft-token workspace slots", fam.GAUGE))
        finished = family("eagle_requests_finished_total", "Requests finished, by finish reason",
                          fam.COUNTER)
        success = family("vllm:request_success_total", "Requests finished, by finish reason", fam.COUNTER)
        self.finished = {ours: _Each(finished.Metric(labels={"finish_reason": ours}),
                                     success.Metric(labels={**vllm, "finished_reason": theirs}))
                         for ours, theirs in FINISH_REASONS.items()}
        self.prompt_tokens = both("eagle_prompt_tokens_total", "vllm:prompt_tokens_total",
                                  "Prompt tokens of the requests that got a first token", fam.COUNTER)
        self.generation_tokens = both("eagle_generation_tokens_total", "vllm:generation_tokens_total",
                                      "Output tokens sent", fam.COUNTER)
        self.ttft = both("eagle_time_to_first_token_seconds", "vllm:time_to_first_token_seconds",
                         "Time to first token", fam.HISTOGRAM, buckets=LATENCY_BUCKETS)
        tpot = "Time per output token after the first, per request"
        self.tpot = both("eagle_time_per_output_token_seconds", "vllm:time_per_output_token_seconds", tpot,
                         fam.HISTOGRAM, buckets=LATENCY_BUCKETS)
        self.tpot.metrics.append(metric("vllm:inter_token_latency_seconds", tpot, fam.HISTOGRAM, vllm,
                                        buckets=LATENCY_BUCKETS))  # vLLM v1's newer name
        self.request_prompt = both("eagle_request_prompt_tokens", "vllm:request_prompt_tokens",
                                   "Prompt tokens of each finished request", fam.HISTOGRAM,
                                   buckets=LENGTH_BUCKETS)
        generation = "Output tokens of each finished request"
        self.request_generation = both("eagle_request_generation_tokens", "vllm:request_generation_tokens",
                                       generation, fam.HISTOGRAM, buckets=LENGTH_BUCKETS)
        self.request_generation.metrics.append(metric(  # vLLM: the longest of a request's n sequences
            "vllm:request_max_num_generation_tokens", generation, fam.HISTOGRAM, vllm, buckets=LENGTH_BUCKETS))
        self.phases = {phase: both(f"eagle_request_{phase}_time_seconds", f"vllm:request_{phase}_time_seconds",
                                   description, fam.HISTOGRAM, buckets=REQUEST_BUCKETS)
                       for phase, description in (
                           ("prefill", "First admission to first token"),
                           ("decode", "First token to last response"),
                           ("inference", "First admission to last response"))}
        self.e2e = both("eagle_e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds",
                        "Arrival to last response of a request that did not fail", fam.HISTOGRAM,
                        buckets=REQUEST_BUCKETS)
        self.queue_time = both("eagle_request_queue_time_seconds", "vllm:request_queue_time_seconds",
                               "Arrival to first admission into the running batch", fam.HISTOGRAM,
                               buckets=REQUEST_BUCKETS)
        self._seen = dict.fromkeys(self.counters, 0)
        self._seen_positions = [0] * max_positions
        self._seen_by_source = dict.fromkeys(self.by_source, 0)
        self._pending: dict = {}  # counter -> increments not sent yet (`flush`)
        self._flushed_at = time.monotonic()

    def _add(self, counter, value) -> None:
        self._pending[counter] = self._pending.get(counter, 0) + value

    def flush(self) -> None:
        """Send the counters' pending increments (each is a message to the Triton process)."""
        for counter, value in self._pending.items():
            counter.increment(value)
        self._pending.clear()
        self._flushed_at = time.monotonic()

    def update(self, engine: Engine) -> None:
        """Counters and gauges from the engine's state (the engine thread, each round). Counter
        increments are sent every FLUSH_INTERVAL_S and whenever a request finishes
        (`observe_finished`), not every round."""
        s = engine.stats
        for key, total in ((key, getattr(s, key)) for key in self.counters):
            if total > self._seen[key]:
                self._add(self.counters[key], total - self._seen[key])
                self._seen[key] = total
        for j, total in enumerate(s.accepted_per_position[:len(self.per_position)]):
            if total > self._seen_positions[j]:
                self._add(self.per_position[j], total - self._seen_positions[j])
                self._seen_positions[j] = total
        for (stat, source), counter in self.by_source.items():
            total = getattr(s, stat)[source]
            if total > self._seen_by_source[stat, source]:
                self._add(counter, total - self._seen_by_source[stat, source])
                self._seen_by_source[stat, source] = total
        if time.monotonic() - self._flushed_at >= FLUSH_INTERVAL_S:
            self.flush()
        self.acceptance_length.set(1 + s.accepted_tokens / s.drafts if s.drafts else 0.0)
        while s.queue_times:
            self.queue_time.observe(s.queue_times.popleft())
        self.running.set(len(engine.running))
        self.waiting.set(len(engine.waiting))
        for pool in (engine.target_pool, engine.drafter_pool):
            self.pages_free[pool.name].set(pool.num_free)
            self.pages_total[pool.name].set(pool.num_pages)
        pool = engine.target_pool
        self.kv_usage.set(round(1 - pool.num_free / pool.num_pages, 4))
        self.slots_free.set(engine.workspace.num_free)

    def observe_first_token(self, seconds: float, prompt_tokens: int) -> None:
        self.ttft.observe(seconds)
        self.prompt_tokens.increment(prompt_tokens)

    def observe_generated(self, tokens: int) -> None:
        if tokens:
            self._add(self.generation_tokens, tokens)

    def observe_tpot(self, seconds: float) -> None:
        self.tpot.observe(seconds)

    def observe_finished(self, reason: str, e2e_seconds: float | None = None) -> None:
        """reason: "stop", "length", "cancelled" or "error"; e2e_seconds: None for a failure.
        Sends every pending counter increment: a client that saw its request finish reads
        settled counters."""
        self.flush()
        self.finished[reason].increment(1)
        if e2e_seconds is not None:
            self.e2e.observe(e2e_seconds)

    def observe_request(self, prompt_tokens: int, output_tokens: int, queued_s: float,
                        first_token_s: float | None, e2e_s: float) -> None:
        """A request that finished without error: its lengths, and its phases (seconds from
        arrival: to first admission, to first token (None: it had none), to the end)."""
        self.request_prompt.observe(prompt_tokens)
        self.request_generation.observe(output_tokens)
        if first_token_s is not None:
            self.phases["prefill"].observe(max(0.0, first_token_s - queued_s))
            self.phases["decode"].observe(max(0.0, e2e_s - first_token_s))
        self.phases["inference"].observe(max(0.0, e2e_s - queued_s))
