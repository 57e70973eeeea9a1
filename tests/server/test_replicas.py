"""`make replicas N=2`: two real servers behind the real vllm-router, on the tiny float64 model
without a drafter (SERVE_ARGS=--model-repository=...): what is checked is the routing, the
replicas' metrics and their restarts, not the model, and the tiny one starts in half the
default one's time.

Which replica served a request is read from each replica's own Triton metrics (requests it
finished), not from the router's account of itself.
"""
from __future__ import annotations

import concurrent.futures as futures
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from grafana import dashboard_queries, metric_names
from triton_pool import get, post_json, wait_until

from eagle_serve import paths
from eagle_serve.server.launch import bound_ports, ephemeral_ports, free_ports
from eagle_serve.server.processes import find_server
from eagle_serve.server.replicas import PORT_STEP, Ports
from eagle_serve.triton_backend.repo_config import copy_repository

pytestmark = pytest.mark.server

READY_TIMEOUT_S = 300.0
MODEL = "tiny-llama"  # conftest's tiny_models
SYSTEM = ("You are the support assistant of the Northwind Trading Company. Answer briefly, "
          "politely and only about orders, shipping, invoices and returns. ") * 12


@dataclass
class Replicas:
    process: subprocess.Popen
    ports: list[Ports]
    router_port: int
    router_metrics_port: int
    log_path: Path

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]


def port_block() -> dict[str, int]:
    """Base ports such that replica i's ports (base + PORT_STEP i) and the router's are free,
    all below the ephemeral range (launch.free_ports says why)."""
    for _ in range(50):
        base = free_ports(1)[0]
        wanted = [base + d + PORT_STEP * i for i in range(2) for d in range(3)] + [base + d for d in range(5, 9)]
        if max(wanted) < ephemeral_ports().start and bound_ports(wanted):
            return {"HTTP_PORT": base, "GRPC_PORT": base + 1, "METRICS_PORT": base + 2,
                    "OPENAI_PORT": base + 5, "ROUTER_PORT": base + 7, "ROUTER_METRICS_PORT": base + 8}
    raise RuntimeError("no free block of ports")


def served(ports: Ports) -> int:
    """Requests this replica finished, by its own Triton metrics."""
    _, text = get(f"http://127.0.0.1:{ports.metrics}/metrics")
    return int(sum(float(v) for v in re.findall(r"^eagle_requests_finished_total\{[^}]*\} (\S+)", text, re.M)))


def chat(replicas: Replicas, question: str, system: str = SYSTEM, max_tokens: int = 8) -> tuple[int, dict]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return post_json(f"http://127.0.0.1:{replicas.router_port}/v1/chat/completions",
                {"model": MODEL, "messages": messages, "max_tokens": max_tokens})


FIRST_WORDS = iter(["Rivers", "Engines", "Bread", "Comets", "Violins", "Glaciers", "Lanterns", "Orchids",
                    "Tigers", "Maps", "Volcanoes", "Kites", "Clocks", "Deserts", "Owls", "Bridges", "Pianos",
                    "Coral", "Storms", "Candles", "Wolves", "Gardens", "Rockets", "Honey", "Castles"])


def until_both_served(replicas: Replicas, before: list[int], timeout_s: float = 120) -> bool:
    """Send pairs of overlapping requests through the router until each replica served one
    more than `before`. Each prompt starts with a new word (a prefix no replica holds), and on
    a miss the router picks the less loaded replica: the one not busy with the pair's first."""
    def pair() -> bool:
        prompts = [f"{next(FIRST_WORDS)} are remarkable because", f"{next(FIRST_WORDS)} matter since"]
        body = {"model": MODEL, "max_tokens": 150, "ignore_eos": True}  # ~1 s: the first still runs
        with futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(post_json, f"http://127.0.0.1:{replicas.router_port}/v1/completions",
                                body | {"prompt": prompts[0]})
            time.sleep(0.2)
            second = pool.submit(post_json, f"http://127.0.0.1:{replicas.router_port}/v1/completions",
                                 body | {"prompt": prompts[1]})
            answers = [first.result(), second.result()]
        assert all(status == 200 for status, _ in answers), answers
        return all(served(p) > b for p, b in zip(replicas.ports, before))

    return wait_until(pair, timeout_s, 0.0)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, triton_server, tiny_models):
    triton_server.stop_idle()  # two servers of its own
    ports = port_block()
    folder = tmp_path_factory.mktemp("replicas")
    log_path = folder / "replicas.log"
    # the models the OpenAI servers call: spec_decode and the target (no ensemble; no drafter:
    # routing and restarts are checked here, speculation through a server in test_server_e2e)
    repo = copy_repository(paths.REPO_ROOT / "model_repository", folder / "repo",
                           ["spec_decode", "eagle_target"], {"spec_decode": {
        "target_model": str(tiny_models["target"]), "drafter_model": "none",
        "dtype": "float64", "page_size": "8", "num_target_pages": "512"}})
    env = {**os.environ, **{k: str(v) for k, v in ports.items()}, "SERVE_ARGS": f"--model-repository={repo}"}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(["make", "-s", "replicas", "N=2"], cwd=paths.REPO_ROOT, env=env,
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    group = Replicas(process, [Ports.of_replica(i, env) for i in range(2)], ports["ROUTER_PORT"],
                     ports["ROUTER_METRICS_PORT"], log_path)
    try:
        ready = wait_until(lambda: process.poll() is None and all(
            get(f"{p.openai_url}/health")[0] == 200 for p in group.ports)
            and get(f"http://127.0.0.1:{group.router_port}/health")[0] == 200, READY_TIMEOUT_S, 1.0)
        assert ready, f"the replicas or the router did not get ready:\n{group.log_tail()}"
        yield group
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)  # the launcher stops the replicas and the router
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def test_both_replicas_serve_and_the_router_sends_concurrent_distinct_prompts_to_both(replicas):
    for ports in replicas.ports:
        status, body = post_json(f"{ports.openai_url}/v1/completions",
                            {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4})
        assert status == 200 and body["choices"][0]["text"], body
    before = [served(p) for p in replicas.ports]
    assert until_both_served(replicas, before), "the router never sent a request to one replica"


def test_requests_sharing_a_prefix_stick_to_one_replica(replicas):
    before = [served(p) for p in replicas.ports]
    for i in range(6):
        status, body = chat(replicas, f"Where is my order number {1000 + i}?")
        assert status == 200, body
    gained = [served(p) - b for p, b in zip(replicas.ports, before)]
    assert sorted(gained) == [0, 6], gained


def exported_metrics(url: str) -> set[str]:
    """Metric names a /metrics page exports (a histogram's with its _bucket/_sum/_count)."""
    _, text = get(url)
    families = re.findall(r"^# TYPE (\S+) (\S+)", text, re.M)
    return {name + suffix for name, kind in families
            for suffix in (("_bucket", "_sum", "_count") if kind == "histogram" else ("",))}


def test_every_dashboard_query_names_a_metric_the_servers_or_the_router_export(replicas):
    exported = exported_metrics(f"http://127.0.0.1:{replicas.ports[0].metrics}/metrics") | \
        exported_metrics(f"http://127.0.0.1:{replicas.router_metrics_port}/metrics")
    for query in dashboard_queries():
        assert metric_names(query) <= exported, query


def test_drain_waits_until_the_running_request_ends(replicas):
    from eagle_serve.server.health import drain, in_flight
    ports = replicas.ports[0]
    metrics_url = f"127.0.0.1:{ports.metrics}"
    assert drain(metrics_url, 5.0)  # idle
    with futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(post_json, f"{ports.openai_url}/v1/completions",
                             {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True})
        assert wait_until(lambda: in_flight(metrics_url) > 0 or answer.done(), 60, 0.05)
        assert not answer.done(), "the request ended before it was seen running"
        assert not drain(metrics_url, 0.2)  # still running: the timeout ends the wait
        assert drain(metrics_url, 120.0) and in_flight(metrics_url) == 0
        status, body = answer.result()
    assert status == 200 and body["usage"]["completion_tokens"] == 200


def test_after_a_replica_is_killed_new_requests_succeed_and_it_is_taken_back(replicas):
    # the replica holding the shared prefix: the router would send these requests to it
    before = [served(p) for p in replicas.ports]
    assert chat(replicas, "Can I return a parcel?")[0] == 200
    sticky = next(i for i, p in enumerate(replicas.ports) if served(p) > before[i])
    other = replicas.ports[1 - sticky]
    server = find_server(replicas.ports[sticky].http)
    os.killpg(os.getpgid(server.pid), signal.SIGKILL)  # tritonserver, its models, its OpenAI server

    before_other = served(other)
    answers = [chat(replicas, f"Where is my invoice number {i}?") for i in range(10)]
    assert [status for status, _ in answers] == [200] * 10, answers
    assert served(other) - before_other == 10

    back = replicas.ports[sticky]
    assert wait_until(lambda: get(f"{back.openai_url}/health")[0] == 200, READY_TIMEOUT_S, 1.0), \
        f"the killed replica was not started again:\n{replicas.log_tail()}"
    before = [served(p) for p in replicas.ports]
    assert until_both_served(replicas, before), "the router did not take the replica back"
