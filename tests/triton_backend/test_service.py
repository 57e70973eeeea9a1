"""spec_decode's service in-process (fake pb_utils, tiny float64 models): every request gets
FINAL exactly once on every path, and a failing request fails alone."""
from __future__ import annotations

import time

import fake_pb
import numpy as np
import pytest
from fake_pb import ids_request, text_request, wait_final

from eagle_serve.core.interfaces import ModelUnavailable
from eagle_serve.testing import TINY_VOCAB, tiny_engine
from eagle_serve.triton_backend.service import SpecDecodeService

POISON = 13  # a token id the failing model wrappers refuse


@pytest.fixture
def pb(monkeypatch):
    return fake_pb.install(monkeypatch)


class FailingModel:
    """Wraps a target or drafter: a call whose batch holds POISON raises, as does every call
    once `stuck` (raising ModelUnavailable, as the BLS runner does); `delay_s` slows every call."""

    def __init__(self, model, method: str):
        self.model, self.method = model, method
        self.stuck, self.delay_s, self.calls = False, 0.0, 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def _call(self, batch, *args, **kwargs):
        self.calls += 1
        time.sleep(self.delay_s)
        if self.stuck:
            raise ModelUnavailable("the model did not answer within 1 s")
        if bool((batch.input_ids == POISON).any()):
            raise RuntimeError("boom: a secret internal detail")
        return getattr(self.model, self.method)(batch, *args, **kwargs)

    def forward(self, batch, *args, **kwargs):
        return self._call(batch, *args, **kwargs)

    def propose(self, batch, *args, **kwargs):
        return self._call(batch, *args, **kwargs)


def make_service(pb, tiny_models, **overrides):
    engine = tiny_engine(tiny_models["target"], tiny_models["eagle3"],
                         **{"num_speculative_tokens": 2, **overrides})
    engine.target = FailingModel(engine.target, "forward")
    engine.drafter = FailingModel(engine.drafter, "propose")
    broken: list[str] = []
    return SpecDecodeService(pb, engine, None, on_broken=broken.append), broken


PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [7, 7, 7, 7, 7, 7], [1000, 42]]


def solo_outputs(pb, tiny_models, prompts, **kw):
    service, _ = make_service(pb, tiny_models)
    reqs = [ids_request(p, **kw) for p in prompts]
    for r in reqs:
        service.submit(r)
        wait_final([r])
    service.shutdown()
    return [r.sender.output_ids() for r in reqs]


def test_streamed_and_whole_answers_end_with_exactly_one_final(pb, tiny_models):
    service, _ = make_service(pb, tiny_models)
    streamed, whole = text_request("Hello there", stream=True), text_request("Hello there")
    for r in (streamed, whole):
        service.submit(r)
    wait_final([streamed, whole])
    service.shutdown()
    assert streamed.sender.finals == whole.sender.finals == 1
    assert len(streamed.sender.sent) > 1 and len(whole.sender.sent) == 1
    assert streamed.sender.output_ids() == whole.sender.output_ids()
    assert len(whole.sender.output_ids()) == 12


@pytest.mark.parametrize("inputs, message", [
    (dict(input_ids=np.array([[5, -1, 6]], np.int32)), f"token ids must be in [0, {TINY_VOCAB})"),
    (dict(input_ids=np.array([[5, TINY_VOCAB]], np.int32)), f"token ids must be in [0, {TINY_VOCAB})"),
    (dict(text_input=np.array([[b"hi"]], object), temperature=np.array([[np.nan]], np.float32)),
     "temperature must be a finite number"),
    (dict(text_input=np.array([[b"hi"]], object), temperature=np.array([[np.inf]], np.float32)),
     "temperature must be a finite number"),
    (dict(text_input=np.array([[b"hi"]], object), top_p=np.array([[np.nan]], np.float32)),
     "top_p must be in (0, 1]"),
    (dict(text_input=np.array([[b"hi"]], object), stop=np.array([[b"x"] * 33], object)),
     "at most 32 stop strings"),
    (dict(text_input=np.array([[b"hi"]], object), stop=np.array([[b"x" * 3000, b"y" * 3000]], object)),
     "at most 4096 bytes"),
    (dict(max_tokens=np.array([[4]], np.int32)), "send text_input (or input_ids)"),
    (dict(text_input=np.array([[b""]], object)), "input 'text_input' is empty"),  # as preprocess says
])
def test_a_bad_request_gets_one_error_final_and_the_next_one_is_served(pb, tiny_models, inputs, message):
    service, _ = make_service(pb, tiny_models)
    bad = fake_pb.Request(**inputs)
    service.submit(bad)
    assert bad.sender.finals == 1 and message in bad.sender.error, bad.sender.error
    good = ids_request(PROMPTS[0])
    service.submit(good)
    wait_final([good])
    service.shutdown()
    assert good.sender.finals == 1 and good.sender.error is None


def test_a_cancelled_stream_ends_with_one_final_and_frees_everything(pb, tiny_models):
    service, _ = make_service(pb, tiny_models)
    idle = service.engine.idle_counts()
    r = ids_request(PROMPTS[1], max_tokens=200, stream=True)
    service.submit(r)
    deadline = time.monotonic() + 60
    while not r.sender.sent and time.monotonic() < deadline:
        time.sleep(0.01)
    r.sender.cancelled = True
    wait_final([r])
    last = r.sender.sent[-1][0]
    assert r.sender.finals == 1 and last.output("finish_reason").reshape(-1)[0] == b"cancelled"
    deadline = time.monotonic() + 10
    while service.engine.idle_counts() != idle and time.monotonic() < deadline:
        time.sleep(0.01)
    service.shutdown()
    assert service.engine.idle_counts() == idle


@pytest.mark.parametrize("model", ["target", "drafter"])
def test_a_request_that_breaks_a_model_call_fails_alone_and_the_others_are_exact(
        pb, tiny_models, model):
    solo = solo_outputs(pb, tiny_models, PROMPTS)
    service, broken = make_service(pb, tiny_models)
    idle = service.engine.idle_counts()
    poisoned = ids_request([5, 6, POISON, 8])
    reqs = [ids_request(p) for p in PROMPTS[:2]] + [poisoned] + [ids_request(p) for p in PROMPTS[2:]]
    engine = service.engine
    if model == "drafter":  # only the drafter refuses POISON
        engine.target = engine.target.model
    else:
        engine.drafter = engine.drafter.model
    for r in reqs:
        service.submit(r)
    wait_final(reqs)
    deadline = time.monotonic() + 10
    while service.engine.idle_counts() != idle and time.monotonic() < deadline:
        time.sleep(0.01)
    service.shutdown()
    assert all(r.sender.finals == 1 for r in reqs)
    error = poisoned.sender.error
    assert error is not None and "internal error" in error and "error id" in error
    assert "secret internal detail" not in error
    assert [r.sender.output_ids() for r in reqs if r is not poisoned] == solo
    assert not broken and service.engine.idle_counts() == idle


def test_a_stuck_model_fails_every_open_request_once_and_breaks_the_service(pb, tiny_models):
    service, broken = make_service(pb, tiny_models)
    reqs = [ids_request(p, max_tokens=400, stream=True) for p in PROMPTS]
    for r in reqs:
        service.submit(r)
    deadline = time.monotonic() + 60
    while not all(r.sender.sent for r in reqs) and time.monotonic() < deadline:
        time.sleep(0.01)
    service.engine.target.stuck = True
    wait_final(reqs)
    assert all(r.sender.finals == 1 and "restarting" in r.sender.error for r in reqs)
    assert len(broken) == 1 and "did not answer" in broken[0]
    late = ids_request(PROMPTS[0])
    service.submit(late)
    service.shutdown()
    assert late.sender.finals == 1 and "restarting" in late.sender.error


def test_shutdown_ends_every_open_request_with_one_final(pb, tiny_models):
    service, _ = make_service(pb, tiny_models)
    service.engine.target.delay_s = 0.05
    reqs = [ids_request(p, max_tokens=400, stream=True) for p in PROMPTS]
    for r in reqs:
        service.submit(r)
    time.sleep(0.3)
    service.shutdown()
    assert all(r.sender.finals == 1 for r in reqs)
    assert all("shutting down" in r.sender.error for r in reqs)


def test_requests_past_the_queue_limit_or_the_deadline_fail_with_unavailable(pb, tiny_models):
    service, _ = make_service(pb, tiny_models, max_running=1, max_queue_time_s=0.5,
                              request_timeout_s=2.0)
    service.engine.target.delay_s = 0.05
    first, queued = ids_request(PROMPTS[0], max_tokens=400), ids_request(PROMPTS[1], max_tokens=4)
    service.submit(first)
    service.submit(queued)
    wait_final([first, queued])
    service.shutdown()
    assert queued.sender.finals == 1 and "waited" in queued.sender.error
    assert first.sender.finals == 1 and "deadline of 2 s" in first.sender.error


def test_a_client_that_is_gone_does_not_disturb_the_others(pb, tiny_models):
    solo = solo_outputs(pb, tiny_models, PROMPTS[:2], stream=True)
    service, _ = make_service(pb, tiny_models)
    gone, other = ids_request(PROMPTS[2], stream=True), ids_request(PROMPTS[0], stream=True)
    gone.sender.fail_sends = True
    reqs = [other, gone, ids_request(PROMPTS[1], stream=True)]
    for r in reqs:
        service.submit(r)
    wait_final([reqs[0], reqs[2]])
    deadline = time.monotonic() + 30
    while service.open and time.monotonic() < deadline:
        time.sleep(0.01)
    service.shutdown()
    assert not service.open and gone.sender.sent == []
    assert [reqs[0].sender.output_ids(), reqs[2].sender.output_ids()] == solo
