"""Each Triton metric call is a message to the Triton process, so the engine's metrics send only
what changed: counters at most every FLUSH_INTERVAL_S and whenever a request finishes, gauges
when their value moves."""
from __future__ import annotations

from types import SimpleNamespace

from eagle_serve.core.requests import SamplingParams
from eagle_serve.testing import tiny_engine
from eagle_serve.triton_backend import metrics as metrics_module
from eagle_serve.triton_backend.metrics import EngineMetrics


class _Metric:
    def __init__(self, calls, name, labels, **_):
        self.calls, self.labels = calls, labels
        self.name = name + "".join(f"/{v}" for k, v in sorted(labels.items()) if k != "model_name")

    def increment(self, value):
        self.calls.append(("increment", self.name, value))

    def set(self, value):
        self.calls.append(("set", self.name, value))

    def observe(self, value):
        self.calls.append(("observe", self.name, value))


def _fake_pb(calls):
    class MetricFamily:
        COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

        def __init__(self, name, description, kind):
            self.name = name

        def Metric(self, labels, **kw):  # noqa: N802 (pb_utils' name)
            return _Metric(calls, self.name, labels, **kw)
    return SimpleNamespace(MetricFamily=MetricFamily)


def test_counters_go_out_every_interval_and_at_a_finish_and_unchanged_gauges_not_at_all(
        tiny_target, prompts, monkeypatch):
    calls = []
    engine = tiny_engine(tiny_target)
    m = EngineMetrics(_fake_pb(calls), max_positions=4)
    clock = [100.0]
    monkeypatch.setattr(metrics_module.time, "monotonic", lambda: clock[0])
    m._flushed_at = clock[0]
    engine.add_request(prompts[0], SamplingParams(max_tokens=4, num_speculative_tokens=0))
    engine.step()
    m.update(engine)
    m.observe_generated(1)
    sent = [c for c in calls if c[0] == "increment"]
    assert sent == []  # within the interval: nothing sent
    last = {c[1]: c[2] for c in calls if c[0] == "set"}
    assert len(last) == len([c for c in calls if c[0] == "set"])  # each gauge once
    calls.clear()
    engine.step()
    m.update(engine)
    for _, name, value in (c for c in calls if c[0] == "set"):  # only what moved
        assert last[name] != value
        last[name] = value
    clock[0] += metrics_module.FLUSH_INTERVAL_S
    calls.clear()
    m.update(engine)
    steps = [c[2] for c in calls if c[:2] == ("increment", "eagle_engine_steps_total")]
    assert steps == [2]  # both rounds in one message
    assert ("increment", "eagle_generation_tokens_total", 1) in calls
    calls.clear()
    engine.step()
    m.update(engine)
    m.observe_generated(2)
    m.observe_finished("length", 0.5)  # settles everything before the client's FINAL
    assert ("increment", "eagle_engine_steps_total", 1) in calls
    assert ("increment", "eagle_generation_tokens_total", 2) in calls
    assert ("increment", "eagle_requests_finished_total/length", 1) in calls
