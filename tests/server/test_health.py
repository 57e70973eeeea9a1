"""`python -m eagle_serve.server.health` (the container's health check) against a real tritonserver:
healthy while serving, unhealthy once a model's Python process is killed, although Triton
itself keeps /v2/health/ready at 200. The server is the pool's preprocess + postprocess one,
after test_preprocess_postprocess_server's tests (conftest's unit "prepost"); the kill ends it."""
from __future__ import annotations

import subprocess
import sys
import urllib.request

import psutil
import pytest
from triton_pool import prepost_server, wait_until

from eagle_serve.server.launch import free_ports
from eagle_serve.server.processes import model_processes

pytestmark = pytest.mark.server


def health(http_port: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eagle_serve.server.health", "--http-port", str(http_port)],
                          capture_output=True, text=True, timeout=60)


def ready_status(http_port: int) -> int | None:
    try:
        with urllib.request.urlopen(f"http://localhost:{http_port}/v2/health/ready", timeout=2) as r:
            return r.status
    except OSError:
        return None


def test_health_fails_once_a_model_process_is_dead(triton_server):
    server = prepost_server(triton_server)
    try:
        healthy = health(server.http_port)
        assert healthy.returncode == 0, healthy.stderr
        model_processes(psutil.Process(server.process.pid))["postprocess"].kill()
        assert wait_until(lambda: health(server.http_port).returncode == 1, 60)
        assert "postprocess" in health(server.http_port).stderr
        print("/v2/health/ready after the stub died:", ready_status(server.http_port))
    finally:
        triton_server.discard("prepost")


def test_health_fails_without_a_server():
    (port,) = free_ports(1)
    done = health(port)
    assert done.returncode == 1 and f"no tritonserver with HTTP port {port}" in done.stderr
