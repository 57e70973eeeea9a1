"""The real tritonserver for end-to-end tests (started by eagle_serve.server.launch).

`ServerPool(workdir)(name, models, overrides, model_config_name)` serves a copy of
model_repository/ (only `models`, parameters overridden through eagle_serve.triton_backend.repo_config) on
free ports and keeps one server per name until `close()`. Each server runs in its own process
group, so closing it also ends the Python backend stubs it spawned.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from eagle_serve import paths
from eagle_serve.server.launch import STOP_TIMEOUT_S, TritonServer, free_ports, launch, signal_group
from eagle_serve.server.serve import server_environment
from eagle_serve.triton_backend.repo_config import copy_repository


class ServerPool:
    """One server per name, started when first asked for; a failed start is remembered so later
    tests fail at once instead of waiting again. Each server is ~1.8 GB of model processes (the
    default model's ~3 GB) and `make test` runs a pool per worker: starting one stops those
    beyond `max_live - 1`, the one asked for longest ago first, but of those the running test
    module asked for (`module`, kept by conftest) only beyond `max_module - 1`, so that a module
    alternating between two servers starts each once; asked for again later, a server starts
    again. A module holding a server in a fixture asks for at most `max_module`. Servers named
    in `keep` (conftest: those every module of a run of modules asks for) are stopped last."""

    def __init__(self, workdir: Path, max_live: int = 1, max_module: int = 2):
        self.workdir = Path(workdir)
        self.max_live, self.max_module = max_live, max_module
        self.module = ""
        self.keep: set[str] = set()
        self.servers: dict[str, TritonServer] = {}  # live, least recently asked for first
        self._asked_by: dict[str, str] = {}  # name -> the module that last asked for it
        self._requests: dict[str, tuple] = {}
        self._failures: dict[str, BaseException] = {}
        self._starts = 0
        self._retiring: list[tuple[TritonServer, float]] = []  # SIGTERM sent, not reaped

    def __call__(self, name: str, models: list[str] | None = None,
                 overrides: dict[str, dict[str, str]] | None = None,
                 model_config_name: str | None = None) -> TritonServer:
        request = (sorted(models) if models else None, overrides or {}, model_config_name)
        if name in self._requests and self._requests[name] != request:
            raise ValueError(f"server '{name}' was already started with {self._requests[name]}, "
                             f"now asked for {request}: use another name")
        self._requests[name] = request
        self._asked_by[name] = self.module
        if name in self._failures:
            raise RuntimeError(f"server '{name}' failed to start earlier") from self._failures[name]
        if name in self.servers:
            self.servers[name] = self.servers.pop(name)  # most recently asked for: last
        else:
            self._make_room()
            self._reap()
            self._starts += 1
            folder = self.workdir / name / f"start{self._starts}"
            folder.mkdir(parents=True)
            repo = copy_repository(paths.REPO_ROOT / "model_repository", folder / "repo",
                                   models, overrides)
            try:
                self.servers[name] = launch(name, repo, folder / "server.log", model_config_name)
            except Exception as error:
                self._failures[name] = error
                raise
        return self.servers[name]

    def _make_room(self) -> None:
        idle = [name for name in self.servers if self._asked_by[name] != self.module and name not in self.keep]
        while len(self.servers) >= self.max_live and idle:
            self.retire(self.servers.pop(idle.pop(0)))
        while len(self.servers) >= self.max_module:
            oldest = sorted(self.servers, key=lambda name: name in self.keep)[0]
            self.retire(self.servers.pop(oldest))

    def discard(self, name: str) -> None:
        """Forget a server a test ended (a hung model stops it): asked for again, it starts anew."""
        server = self.servers.pop(name, None)
        if server is not None:
            self.retire(server)

    def stop_idle(self) -> None:
        """Stop the live servers the running module has not asked for: before a test starts
        servers of its own (`make serve`, replicas), beside which an idle one is only memory."""
        for name in [name for name in self.servers if self._asked_by[name] != self.module]:
            self.retire(self.servers.pop(name))

    def retire(self, server: TritonServer) -> None:
        """SIGTERM now, reaped at the next start or at close: tritonserver's unload is seconds of
        mostly waiting (it checks its models once a second), which no test needs to wait for
        (also for a server a test launched itself)."""
        if server.exit_code() is None:
            signal_group(server.process.pid, signal.SIGTERM)
        self._retiring.append((server, time.monotonic()))

    def _reap(self, wait: bool = False) -> None:
        """Finish stopping the retired servers that exited (all with `wait`), and those that
        outlived STOP_TIMEOUT_S (their process groups killed)."""
        for entry in list(self._retiring):
            server, since = entry
            if wait or server.exit_code() is not None or time.monotonic() - since > STOP_TIMEOUT_S:
                server.stop()
                self._retiring.remove(entry)

    def close(self) -> None:
        """Every server stopped, all at once (each may take seconds to drain)."""
        for server in self.servers.values():
            self.retire(server)
        self.servers.clear()
        self._reap(wait=True)


def prepost_server(pool: ServerPool) -> TritonServer:
    """preprocess and postprocess alone (the default model's tokenizer): their own tests, then
    test_health's, which kills postprocess's process (conftest's SHARED_SERVERS unit "prepost")."""
    return pool("prepost", models=["preprocess", "postprocess"])


def default_server(pool: ServerPool) -> TritonServer:
    """The shipped configuration on the default model, with the static draft costs: measured
    costs follow the machine's load (another test worker's too), and with them which drafts are
    made. tests/spec/test_measured_costs.py checks the measured ones."""
    return pool("default", overrides={"spec_decode": {"measured_draft_costs": "false"}})


def tiny_server(pool: ServerPool, tiny_models: dict[str, Path], head: str, name: str = "",
                **settings: str) -> TritonServer:
    """The float64 tiny Llama (conftest's `tiny_models`) behind the random `head` ("eagle3" or
    "eagle1"), k = 3 by default: the server of the exact-equality tests. Other spec_decode
    `settings` need a server of their own `name`. Behind "eagle1" the cache is SMALL_CACHE:
    its tests run with preemption too, and test_reliability's burst overflows it. HANGABLE."""
    name = name or f"tiny64-{head}"
    cache = SMALL_CACHE if head == "eagle1" else {"num_target_pages": "256", "num_drafter_pages": "256"}
    return pool(name, overrides={"spec_decode": {
        "target_model": str(tiny_models["target"]), "drafter_model": str(tiny_models[head]),
        "dtype": "float64", "num_speculative_tokens": "3", "page_size": "8", **cache,
        "model_call_timeout_s": "3", **CHAINS, **settings}, **hang_hooks(pool, name)})


# 24 pages of 8 = 192 positions a pool: a burst of requests overflows it many times
SMALL_CACHE = {"num_target_pages": "24", "num_drafter_pages": "24", "max_running": "8", "max_model_len": "160"}


def tight_server(pool: ServerPool, tiny_models: dict[str, Path]) -> TritonServer:
    """12 pages of 8 = 96 positions, one running request and one waiting: easy to overfill. The
    chat template is off by default, as Triton's OpenAI frontend needs (test_triton_clients):
    the limits' tests send raw text alike."""
    return pool("tiny64-tight", overrides={"spec_decode": {
        "target_model": str(tiny_models["target"]), "drafter_model": str(tiny_models["eagle3"]),
        "dtype": "float64", "num_speculative_tokens": "3", "page_size": "8",
        "num_target_pages": "12", "num_drafter_pages": "12", "max_running": "1",
        "max_waiting": "1", "max_model_len": "160", "apply_chat_template": "false", **CHAINS}})


# HANGABLE: a model call fails after 3 s (a tiny model's take milliseconds), and eagle_target
# or eagle_drafter stalls every call while its `hang_file` exists: test_hardening hangs one in
# each of the two kept in its xdist unit, as their last test, ending them.
def hang_hooks(pool: ServerPool, name: str) -> dict[str, dict[str, str]]:
    return {model: {"test_hang_file": str(hang_file(pool, name, model))} for model in ("eagle_target", "eagle_drafter")}


def hang_file(pool: ServerPool, name: str, model: str) -> Path:
    """While this file exists, `model` of the server `name` stalls every call (workers.py)."""
    return pool.workdir / f"{name}.hang-{model}"


# Requests that do not ask for a tree draft chains of k, and trees asked for are drafted in
# batches of any size (the shipped config drafts a pruned 8x4x3 tree while a request runs
# alone), unpruned and whatever their acceptance or the load: a random head's draft
# probabilities are near 1/V and its drafts rarely accepted, so the shipped confidence limits
# would leave one draft per round and the cost rule none.
CHAINS = {"draft_topk": "1", "draft_depth": "0", "max_tree_batch": "0",
          "draft_min_prob": "0", "draft_expand_prob": "0", "draft_call_cost": "0",
          "draft_step_cost": "0", "max_draft_batch": "0", "max_sampled_draft_batch": "0"}


def wait_until(predicate: Callable[[], bool], timeout_s: float, every_s: float = 0.5,
               ignore: tuple[type[BaseException], ...] = (OSError,)) -> bool:
    """Poll `predicate` until it holds (-> True) or `timeout_s` passes (-> False); the errors in
    `ignore` (a server not listening yet) count as not yet."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return True
        except ignore:
            pass
        time.sleep(every_s)
    return False


def get(url: str, timeout: float = 10) -> tuple[int, str]:
    """(status, text) of a GET, an HTTP error's too."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def post_json(url: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    """(status, JSON answer) of a JSON POST; an HTTP error's JSON body, else {"error": its text}."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        text = error.read().decode()
        try:
            return error.code, json.loads(text)
        except json.JSONDecodeError:
            return error.code, {"error": text}


@contextmanager
def serve_tiny(tmp_path: Path, tiny_models: dict[str, Path], openai: bool = False,
               models: list[str] | None = None):
    """`python -m eagle_serve.server.serve` (what `make serve` runs: the supervised tritonserver, and
    the OpenAI server if `openai`) on the float64 tiny model with k = 2 (`models` of the
    repository, all by default), not waited for -> its process, with .http, .grpc and .metrics
    (host:port), .openai_port and .log_path; its process group is killed at the end."""
    repo = copy_repository(paths.REPO_ROOT / "model_repository", tmp_path / "repo", models, {"spec_decode": {
        "target_model": str(tiny_models["target"]), "drafter_model": str(tiny_models["eagle3"]),
        "dtype": "float64", "num_speculative_tokens": "2", "page_size": "8",
        "num_target_pages": "256", "num_drafter_pages": "256"}})
    http, grpc, metrics_port, openai_port = free_ports(4)
    env = server_environment() | {"HTTP_PORT": str(http), "GRPC_PORT": str(grpc),
                                  "METRICS_PORT": str(metrics_port), "OPENAI_PORT": str(openai_port)}
    cmd = [sys.executable, "-m", "eagle_serve.server.serve", "--model-repository", str(repo)]
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd + ([] if openai else ["--no-openai"]), env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    proc.http, proc.grpc, proc.metrics = f"localhost:{http}", f"localhost:{grpc}", f"localhost:{metrics_port}"
    proc.openai_port, proc.log_path = openai_port, log_path
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
