"""Prometheus metrics of the engine, served by Triton on its metrics port (names in DESIGN.md)."""
from __future__ import annotations

from eagle_serve.engine import Engine

LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]


class EngineMetrics:
    def __init__(self, pb, max_positions: int):
        fam = pb.MetricFamily
        self._families = []  # a family must outlive its metrics: keep them all

        def family(name, description, kind):
            self._families.append(fam(name=name, description=description, kind=kind))
            return self._families[-1]

        counters = {
            "draft": ("eagle_spec_decode_draft_tokens_total", "Draft tokens verified"),
            "accepted": ("eagle_spec_decode_accepted_tokens_total", "Draft tokens accepted"),
            "rounds": ("eagle_spec_decode_rounds_total", "Verify rounds, counted per request"),
            "steps": ("eagle_engine_steps_total", "Batched engine rounds (target forwards)"),
            "preemptions": ("eagle_preemptions_total", "Requests preempted for KV pages (recomputed later)"),
        }
        self.counters = {k: family(n, d, fam.COUNTER).Metric(labels={}) for k, (n, d) in counters.items()}
        per_pos = family("eagle_spec_decode_accepted_tokens_per_position_total",
                         "Accepted draft tokens by draft position (1-based)", fam.COUNTER)
        self.per_position = [per_pos.Metric(labels={"position": str(j + 1)}) for j in range(max_positions)]
        running = family("eagle_requests_running", "Requests in the running batch", fam.GAUGE)
        waiting = family("eagle_requests_waiting", "Requests waiting for admission", fam.GAUGE)
        pages_free = family("eagle_kv_pages_free", "Free KV cache pages", fam.GAUGE)
        pages_total = family("eagle_kv_pages_total", "KV cache pages", fam.GAUGE)
        slots = family("eagle_draft_slots_free", "Free draft-token workspace slots", fam.GAUGE)
        self.running, self.waiting = running.Metric(labels={}), waiting.Metric(labels={})
        self.pages_free = {p: pages_free.Metric(labels={"pool": p}) for p in ("target", "drafter")}
        self.pages_total = {p: pages_total.Metric(labels={"pool": p}) for p in ("target", "drafter")}
        self.slots_free = slots.Metric(labels={})
        ttft = family("eagle_time_to_first_token_seconds", "Time to first token", fam.HISTOGRAM)
        tpot = family("eagle_time_per_output_token_seconds", "Time per output token after the first",
                      fam.HISTOGRAM)
        self.ttft = ttft.Metric(labels={}, buckets=LATENCY_BUCKETS)
        self.tpot = tpot.Metric(labels={}, buckets=LATENCY_BUCKETS)
        self._seen = dict.fromkeys(self.counters, 0)
        self._seen_positions = [0] * max_positions

    def update(self, engine: Engine) -> None:
        s = engine.stats
        totals = {"draft": s.draft_tokens, "accepted": s.accepted_tokens, "rounds": s.rounds,
                  "steps": s.steps, "preemptions": s.preemptions}
        for key, total in totals.items():
            if total > self._seen[key]:
                self.counters[key].increment(total - self._seen[key])
                self._seen[key] = total
        for j, total in enumerate(s.accepted_per_position[:len(self.per_position)]):
            if total > self._seen_positions[j]:
                self.per_position[j].increment(total - self._seen_positions[j])
                self._seen_positions[j] = total
        self.running.set(len(engine.running))
        self.waiting.set(len(engine.waiting))
        for pool in (engine.target_pool, engine.drafter_pool):
            self.pages_free[pool.name].set(pool.num_free)
            self.pages_total[pool.name].set(pool.num_pages)
        self.slots_free.set(engine.workspace.num_free)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_tpot(self, seconds: float) -> None:
        self.tpot.observe(seconds)
