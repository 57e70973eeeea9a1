"""A stand-in for `triton_python_backend_utils`, so the code behind the Python-backend models
runs in-process: `install(monkeypatch)` puts it into sys.modules. Requests carry numpy inputs;
a sender records every response it is given (with its flags) and can be told that the client
cancelled or that sending fails. `ids_request` and `text_request` build spec_decode's requests;
`wait_final` waits for their last responses."""
from __future__ import annotations

import sys
import time
import types

import numpy as np

FINAL = 1


class Tensor:
    def __init__(self, name, array):
        self.name, self.array = name, array

    def as_numpy(self):
        return self.array


class TritonError:
    INVALID_ARG, INTERNAL, UNAVAILABLE = "INVALID_ARG", "INTERNAL", "UNAVAILABLE"

    def __init__(self, message, code=None):
        self._message, self.code = message, code

    def message(self):
        return self._message


class InferenceResponse:
    def __init__(self, output_tensors, error=None):
        self.output_tensors, self.error = output_tensors, error

    def output(self, name):
        return next(t.as_numpy() for t in self.output_tensors if t.name == name)


class Sender:
    def __init__(self):
        self.sent: list[tuple[InferenceResponse | None, int]] = []
        self.cancelled = False
        self.fail_sends = False  # the client went away: send() raises

    def send(self, response=None, flags=0):
        if self.fail_sends:
            raise RuntimeError("the client is gone")
        self.sent.append((response, flags))

    def is_cancelled(self):
        return self.cancelled

    @property
    def finals(self) -> int:
        return sum(1 for _, flags in self.sent if flags & FINAL)

    @property
    def error(self) -> str | None:
        errors = [r.error for r, _ in self.sent if r is not None and r.error is not None]
        return errors[-1].message() if errors else None

    def output_ids(self) -> list[int]:
        return [int(i) for r, _ in self.sent if r is not None and r.error is None
                for i in r.output("output_ids").reshape(-1)]


class Request:
    _ids = 0

    def __init__(self, **inputs):
        Request._ids += 1
        self.id = f"fake-{Request._ids}"
        self.inputs = {name: Tensor(name, np.asarray(a)) for name, a in inputs.items()}
        self.sender = Sender()

    def request_id(self):
        return self.id

    def get_response_sender(self):
        return self.sender


def module() -> types.SimpleNamespace:
    logged: list[str] = []
    return types.SimpleNamespace(
        Tensor=Tensor, TritonError=TritonError, InferenceResponse=InferenceResponse,
        TRITONSERVER_RESPONSE_COMPLETE_FINAL=FINAL,
        get_input_tensor_by_name=lambda request, name: (request.inputs if isinstance(request, Request)
                                                        else request).get(name),
        Logger=types.SimpleNamespace(log_error=logged.append, log_warn=logged.append,
                                     log_info=logged.append),
        logged=logged)


def install(monkeypatch) -> types.SimpleNamespace:
    fake = module()
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake)
    return fake


def ids_request(ids, max_tokens=12, stream=False, **extra):
    inputs = dict(input_ids=np.array([ids], np.int32), max_tokens=np.array([[max_tokens]], np.int32),
                  ignore_eos=np.array([[True]]), stream=np.array([[stream]]))
    return Request(**inputs, **extra)


def text_request(text, max_tokens=12, stream=False, **extra):
    return Request(text_input=np.array([[text.encode()]], object),
                           max_tokens=np.array([[max_tokens]], np.int32),
                           ignore_eos=np.array([[True]]), stream=np.array([[stream]]), **extra)


def wait_final(requests, deadline_s: float = 120.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if all(r.sender.finals for r in requests):
            return
        time.sleep(0.02)
    raise AssertionError(f"no FINAL within {deadline_s} s: {[r.sender.sent for r in requests]}")
