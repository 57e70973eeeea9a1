"""Health check of a running tritonserver, for Docker / compose / Kubernetes probes.

    python -m eagle_serve.server.health --http-port 8000     # exit 0: healthy; 1: not (reason on stderr)
    python -m eagle_serve.server.health --drain 120          # wait until no request runs or waits

`--drain` is the preStop hook of a Kubernetes pod (deploy/k8s): by then the pod has left the
router's and the Service's endpoints, so no new request arrives, and the streams it runs finish
before the container gets SIGTERM (which fails the requests still open after the timeout).

Healthy means /v2/health/ready answers 200 AND every Python model of the repository the server
serves has a live stub process. The second half matters: Triton 2.51 keeps /v2/health/ready at
200 after a model's stub died (see eagle_serve.server.supervisor). The server is found among this
machine's processes (a container's, when run inside one) as the tritonserver whose --http-port
is the given port; its --model-repository names the models to look for.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import psutil

from eagle_serve.server.processes import DEFAULT_HTTP_PORT, find_server, flag, missing_stubs, python_models
from eagle_serve.server.supervisor import ready


def problems(http_port: int) -> list[str]:
    """Why the server on this port is not healthy ([] when it is)."""
    server = find_server(http_port)
    if server is None:
        return [f"no tritonserver with HTTP port {http_port} is running"]
    if not ready(http_port):
        return [f"/v2/health/ready on port {http_port} is not 200"]
    try:
        repo = Path(flag(server.cmdline(), "--model-repository") or "")
    except psutil.NoSuchProcess:
        return ["tritonserver exited"]
    dead = missing_stubs(server, python_models(repo))
    return [f"model process(es) not running: {', '.join(dead)}"] if dead else []


DRAIN_POLL_S = 1.0


def in_flight(metrics_url: str) -> int:
    """Requests the engine runs or queues, by the server's metrics."""
    from eagle_serve.client import metrics  # the liveness probe (above) stays light without it
    values = metrics(metrics_url)
    return int(sum(v for k, v in values.items()
                   if k.startswith(("eagle_requests_running", "eagle_requests_waiting"))))


def drain(metrics_url: str, timeout_s: float) -> bool:
    """Wait until no request runs or waits (True), or `timeout_s` passed (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if in_flight(metrics_url) == 0:
                return True
        except OSError:  # the server is gone: nothing left to wait for
            return True
        time.sleep(DRAIN_POLL_S)
    return False


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--http-port", type=int,
                        default=int(os.environ.get("HTTP_PORT", DEFAULT_HTTP_PORT)))
    parser.add_argument("--metrics-port", type=int, default=int(os.environ.get("METRICS_PORT", 8002)))
    parser.add_argument("--drain", type=float, metavar="TIMEOUT_S",
                        help="wait (at most TIMEOUT_S) until no request runs or waits, then exit 0")
    args = parser.parse_args(argv)
    if args.drain is not None:
        drained = drain(f"localhost:{args.metrics_port}", args.drain)
        print("drained" if drained else f"still busy after {args.drain:g} s", file=sys.stderr)
        sys.exit(0)
    found = problems(args.http_port)
    for problem in found:
        print(f"unhealthy: {problem}", file=sys.stderr)
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
