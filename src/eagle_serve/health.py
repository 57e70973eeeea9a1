"""Health check of a running tritonserver, for Docker / compose / Kubernetes probes.

    python -m eagle_serve.health --http-port 8000     # exit 0: healthy; 1: not (reason on stderr)

Healthy means /v2/health/ready answers 200 AND every Python model of the repository the server
serves has a live stub process. The second half matters: Triton 2.51 keeps /v2/health/ready at
200 after a model's stub died (see eagle_serve.supervisor). The server is found among this
machine's processes (a container's, when run inside one) as the tritonserver whose --http-port
is the given port; its --model-repository names the models to look for.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import psutil

from eagle_serve.processes import DEFAULT_HTTP_PORT, find_server, flag, missing_stubs, python_models
from eagle_serve.supervisor import ready


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--http-port", type=int,
                        default=int(os.environ.get("HTTP_PORT", DEFAULT_HTTP_PORT)))
    found = problems(parser.parse_args(argv).http_port)
    for problem in found:
        print(f"unhealthy: {problem}", file=sys.stderr)
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
