"""N replicas of the server behind vllm-router, on one machine: `make replicas N=2`.

Each replica is what `make serve` runs (tritonserver under its supervisor, the OpenAI server
beside it), on its own ports; the router (vllm-router, the Rust router of vLLM's production
stack, from PyPI) sits in front of the replicas' OpenAI endpoints with its cache-aware policy,
so requests that share a prefix go to the replica that served it before (and whose prefix
cache holds it). The router health-checks each replica's `/health` (spec_decode ready) and
retries a failed request on another replica; this launcher starts a replica again when its
process exits, and the router takes it back once it answers `/health`.

Ports: replica i serves HTTP_PORT + 10 i, GRPC_PORT + 10 i, METRICS_PORT + 10 i and
OPENAI_PORT + i; the router listens on ROUTER_PORT (9100) and serves its own metrics on
ROUTER_METRICS_PORT (29000). On one machine the replicas share its cores: each replica's
target gets cores / N threads. This topology is for trying the router and for the tests;
in production each replica is a pod with its own GPU (deploy/k8s, docs/deploy.md).
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from eagle_serve import paths
from eagle_serve.server.supervisor import log
from eagle_serve.settings import tokenizer_dir
from eagle_serve.triton_backend.repo_config import copy_repository

PORT_STEP = 10           # replica i's Triton ports are the base ports + PORT_STEP * i
RESTART_DELAY_S = 2.0    # after a replica exited, before it is started again
STOP_TIMEOUT_S = 30.0
ROUTER_POLICY = "cache_aware"


@dataclass(frozen=True)
class Ports:
    http: int
    grpc: int
    metrics: int
    openai: int

    @staticmethod
    def of_replica(index: int, env: dict[str, str] | None = None) -> "Ports":
        env = os.environ if env is None else env
        step = PORT_STEP * index
        return Ports(int(env.get("HTTP_PORT", 8000)) + step, int(env.get("GRPC_PORT", 8001)) + step,
                     int(env.get("METRICS_PORT", 8002)) + step, int(env.get("OPENAI_PORT", 9000)) + index)

    def environment(self, base: dict[str, str]) -> dict[str, str]:
        return dict(base, HTTP_PORT=str(self.http), GRPC_PORT=str(self.grpc),
                    METRICS_PORT=str(self.metrics), OPENAI_PORT=str(self.openai))

    @property
    def openai_url(self) -> str:
        return f"http://127.0.0.1:{self.openai}"


# How the router treats replicas (the same flags in deploy/k8s/base/router.yaml). A request
# whose replica is unreachable is retried (4 attempts in all); two failures in a row open that
# replica's circuit, so the retries go to another replica even before the next health check
# (every 2 s) takes it out; after 10 s a trial request may take it back, as does a health
# check once it answers. A 4xx is the client's error and counts as a success.
ROUTER_FLAGS = ["--policy", ROUTER_POLICY, "--health-check-endpoint", "/health",
                "--health-check-interval-secs", "2", "--health-failure-threshold", "1",
                "--health-success-threshold", "1", "--retry-max-retries", "4",
                "--cb-failure-threshold", "2", "--cb-timeout-duration-secs", "10"]


def router_command(worker_urls: list[str], port: int, metrics_port: int,
                   host: str = "127.0.0.1") -> list[str]:
    """vllm-router in front of `worker_urls` (OpenAI endpoints)."""
    router = Path(sys.executable).parent / "vllm-router"
    return [str(router), "--host", host, "--port", str(port), "--worker-urls", *worker_urls,
            *ROUTER_FLAGS, "--worker-startup-timeout-secs", "900",
            "--worker-startup-check-interval", "2",
            "--prometheus-host", host, "--prometheus-port", str(metrics_port)]


def router_environment(repo: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """The cache-aware policy matches token prefixes: the router renders each chat with the
    target's own template and tokenizer (VLLM_ROUTER_TOKENIZER, the target folder); without
    them it cannot tell prefixes apart and sends everything to one replica."""
    env = dict(os.environ if base is None else base)
    env.setdefault("VLLM_ROUTER_TOKENIZER", str(tokenizer_dir("target", repo)))
    return env


def replica_repository(repo: Path, replicas: int, workdir: Path) -> Path:
    """A copy of `repo` whose target uses this machine's cores / `replicas` threads (else N
    replicas' OpenMP workers spin on the same cores); `repo` itself where one replica runs."""
    if replicas == 1:
        return repo
    threads = max(1, (os.cpu_count() or 1) // replicas)
    return copy_repository(repo, workdir / "model_repository",
                           overrides={"spec_decode": {"target_threads": str(threads)}})


class Replica:
    """One `python -m eagle_serve.server.serve` in its own process group (so that killing the group
    kills tritonserver, its model processes and the OpenAI server with it)."""

    def __init__(self, index: int, repo: Path, ports: Ports, extra: list[str]):
        self.index, self.repo, self.ports, self.extra = index, repo, ports, extra
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        cmd = [sys.executable, "-m", "eagle_serve.server.serve", f"--model-repository={self.repo}", *self.extra]
        log(f"replica {self.index}: starting on {self.ports}")
        self.process = subprocess.Popen(cmd, env=self.ports.environment(dict(os.environ)),
                                        start_new_session=True)

    def exited(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # the supervisor drains and stops its server


def run(replicas: int, repo: Path, router_port: int, router_metrics_port: int,
        extra: list[str], router_host: str) -> int:
    stopping = False

    def on_signal(_signum, _frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with tempfile.TemporaryDirectory(prefix="eagle-replicas-") as workdir:
        served = replica_repository(repo, replicas, Path(workdir))
        group = [Replica(i, served, Ports.of_replica(i), extra) for i in range(replicas)]
        for replica in group:
            replica.start()
        urls = [r.ports.openai_url for r in group]
        router = subprocess.Popen(router_command(urls, router_port, router_metrics_port, router_host),
                                  env=router_environment(served))
        log(f"router (vllm-router, {ROUTER_POLICY}) on port {router_port} in front of {' '.join(urls)}")
        try:
            while not stopping and router.poll() is None:
                time.sleep(0.5)
                for replica in group:
                    code = replica.exited()
                    if code is not None and not stopping:
                        log(f"replica {replica.index} exited with code {code}; starting it again")
                        time.sleep(RESTART_DELAY_S)
                        replica.start()
        finally:
            _stop([*group], router)
    return 0 if stopping else (router.returncode or 1)


def _stop(group: list[Replica], router: subprocess.Popen) -> None:
    if router.poll() is None:
        router.send_signal(signal.SIGTERM)
    for replica in group:
        replica.stop()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for proc in [router, *(r.process for r in group if r.process is not None)]:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            if proc is router:
                proc.kill()
            else:  # the replica's whole group: tritonserver and its model processes too
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=int(os.environ.get("N", 2)))
    parser.add_argument("--model-repository", type=Path, default=paths.REPO_ROOT / "model_repository")
    parser.add_argument("--router-host", default=os.environ.get("ROUTER_HOST", "127.0.0.1"))
    args, extra = parser.parse_known_args(argv)
    if not 1 <= args.replicas <= 9:
        parser.error("--replicas must be 1-9 (replica i's OpenAI port is OPENAI_PORT + i)")
    sys.exit(run(args.replicas, args.model_repository.resolve(),
                 int(os.environ.get("ROUTER_PORT", 9100)),
                 int(os.environ.get("ROUTER_METRICS_PORT", 29000)), extra, args.router_host))


if __name__ == "__main__":
    main()
