"""Model-process death and shutdown, through the supervised server `make serve` runs, with the
OpenAI server beside it: it stays the same process through each restart, its /health answers
503 while tritonserver is down, and SIGTERM ends both. And a tritonserver that crashes while it
starts (eagle_serve.server.launch) is started once more."""
from __future__ import annotations

import signal
import textwrap
import threading
import time
import warnings

import psutil
import pytest
from triton_pool import get, post_json, serve_tiny, wait_until

from eagle_serve.client import grpc_generate, http_generate
from eagle_serve.server.health import in_flight
from eagle_serve.server.launch import launch
from eagle_serve.server.processes import SHM_DIR, model_processes, shm_regions

pytestmark = pytest.mark.server
MODELS = ["spec_decode", "eagle_target", "eagle_drafter"]  # what the OpenAI server calls


@pytest.fixture(scope="module")
def supervised(tmp_path_factory, tiny_models, triton_server):
    """`python -m eagle_serve.server.serve` (what `make serve` runs) on the tiny float64 model
    (MODELS: each restart starts those alone), answering; one for the module: each kill test
    leaves it answering again, and the SIGTERM test, last, ends it."""
    triton_server.stop_idle()
    with serve_tiny(tmp_path_factory.mktemp("supervised"), tiny_models, openai=True, models=MODELS) as proc:
        assert wait_until(lambda: answers(proc), 240)
        assert wait_until(lambda: openai_chat(proc), 120), proc.log_path.read_text()[-3000:]
        proc.front = front_process(proc)
        yield proc


def answers(proc) -> bool:
    """tritonserver answers a short request."""
    return http_generate(proc.http, "Hi", model="spec_decode", max_tokens=2, timeout_s=10).error is None


def openai_chat(proc) -> bool:
    """The OpenAI server answers a short chat."""
    status, answer = post_json(f"http://127.0.0.1:{proc.openai_port}/v1/chat/completions", {
        "model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}, timeout=30)
    return status == 200 and answer["usage"]["completion_tokens"] > 0


def front_process(proc) -> psutil.Process:
    return next(p for p in psutil.Process(proc.pid).children(recursive=True)
                if "eagle_serve.openai_api" in " ".join(p.cmdline()))


def long_stream(proc, out: dict) -> threading.Thread:
    """A long greedy stream that calls the drafter every round (a fixed draft depth: the draft
    policy would otherwise stop calling a random tiny head whose drafts do not pay)."""
    def run():
        out["result"] = grpc_generate(proc.grpc, "Tell me a long story.", model="spec_decode",
                                      max_tokens=1500, ignore_eos=True, stream=True, timeout_s=120,
                                      num_speculative_tokens=2, draft_topk=1, draft_depth=2)
        out["at"] = time.monotonic()
    thread = threading.Thread(target=run)
    thread.start()
    assert wait_until(lambda: in_flight(proc.metrics) > 0, 30, 0.05), "the stream never ran"
    time.sleep(0.5)  # a few rounds in: the drafter is being called
    return thread


def kill_during_stream(proc, model: str) -> tuple[object, float, str]:
    """Kill `model`'s process during a long stream -> (the stream's Generation, seconds from
    the kill to the stream's end, the server log written since the stream started), once the
    server answers again."""
    out: dict = {}
    start = len(proc.log_path.read_text(errors="replace"))
    thread = long_stream(proc, out)
    regions = shm_regions(model_processes(psutil.Process(proc.pid)).values())
    killed_at = time.monotonic()
    model_processes(psutil.Process(proc.pid))[model].kill()
    front_down = wait_until(lambda: get(f"http://127.0.0.1:{proc.openai_port}/health")[0] == 503, 60, 0.2)
    thread.join(60)
    recovered = wait_until(lambda: answers(proc), 180)
    log = proc.log_path.read_text(errors="replace")[start:]
    assert recovered, log[-3000:]
    assert front_down, "the OpenAI server's /health did not answer 503 while tritonserver was down"
    assert wait_until(lambda: openai_chat(proc), 60), log[-3000:]
    assert front_process(proc).pid == proc.front.pid  # the same OpenAI server throughout
    # the stopped server's shared memory, the killed stub's included, was removed
    assert len(regions) == len(MODELS) and not [r for r in regions if (SHM_DIR / r).exists()]
    print(f"recovered {time.monotonic() - killed_at:.1f} s after {model} was killed")
    return out["result"], out["at"] - killed_at, log


def transport_error(error: str | None) -> bool:
    """The connection itself went (tritonserver's process ended before the stream's answer)."""
    return error is not None and error.startswith("[StatusCode.UNAVAILABLE]") and "healthy" not in error


@pytest.mark.parametrize("model", ["eagle_target", "eagle_drafter"])
def test_a_dead_model_process_fails_requests_fast_and_the_server_comes_back(supervised, model):
    result, ended_s, log = kill_during_stream(supervised, model)
    if transport_error(result.error):
        # Seen once in CI: the stream's connection closed with no answer within 10 s
        # of the kill, and the server came back. The run kept no server log, and 22 kills here
        # (10 beside three busy processes) all ended the stream with the reason, so the cause
        # is open; the log goes to pytest's warnings summary (shown even when the test passes),
        # and the next kill must end the stream with the reason.
        warnings.warn(f"the stream lost its connection ({result.error}); the server log:\n{log[-6000:]}")
        result, ended_s, log = kill_during_stream(supervised, model)
    assert ended_s < 10
    assert result.error is not None and "not healthy" in result.error, (result.error, log[-3000:])
    # spec_decode stops the server, or the supervisor sees it
    assert (f"model process(es) ['{model}'] died; restarting tritonserver" in log
            or "stopping tritonserver" in log and "tritonserver exited with code" in log), log[-3000:]


def test_sigterm_ends_open_streams_with_an_error_and_nothing_hangs(supervised):  # last: ends it
    out: dict = {}
    thread = long_stream(supervised, out)
    term_at = time.monotonic()
    supervised.send_signal(signal.SIGTERM)
    thread.join(60)
    assert not thread.is_alive() and out["at"] - term_at < 30
    assert out["result"].error is not None or out["result"].finish_reason
    assert supervised.wait(60) is not None
    front = supervised.front
    assert wait_until(lambda: not front.is_running() or front.status() == psutil.STATUS_ZOMBIE, 30)


CRASH_ONCE = """
import os
import signal
from pathlib import Path


class TritonPythonModel:
    def initialize(self, args):  # the first start: abort tritonserver (the stub's parent)
        marker = Path(args["model_repository"]) / "crashed"
        if not marker.exists():
            marker.touch()
            os.kill(os.getppid(), signal.SIGABRT)

    def execute(self, requests):
        return []
"""


def processes_of(model) -> set[int]:
    """Live processes whose command line names the model's folder (its Python backend stubs)."""
    return {p.pid for p in psutil.process_iter(["cmdline", "status"])
            if p.info["status"] != psutil.STATUS_ZOMBIE and str(model) in " ".join(p.info["cmdline"] or ())}


def test_a_tritonserver_that_crashes_before_it_is_ready_is_started_once_more(tmp_path):
    model = tmp_path / "repo" / "crash_once"
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.py").write_text(CRASH_ONCE)
    (model / "config.pbtxt").write_text(textwrap.dedent("""\
        backend: "python"
        input [{ name: "X", data_type: TYPE_FP32, dims: [1] }]
        output [{ name: "Y", data_type: TYPE_FP32, dims: [1] }]
        instance_group [{ kind: KIND_CPU, count: 1 }]
        """))
    with pytest.warns(UserWarning, match="exited with code -6 before it was ready"):
        server = launch("crash-once", model.parent, tmp_path / "server.log")
    try:
        assert server.exit_code() is None and (model / "crashed").exists()
        assert "crash_once" in (tmp_path / "server.crashed.log").read_text()
        # the crashed start's model process was ended with it: only the live server's is left
        live = {p.pid for p in psutil.Process(server.process.pid).children(recursive=True)}
        assert wait_until(lambda: processes_of(model) <= live, 10, 0.1), (processes_of(model), live)
    finally:
        server.stop()
