"""`python -m eagle_serve.server.health` (the container's health check) against a real tritonserver:
healthy while serving, unhealthy once a model's Python process is killed, although Triton
itself keeps /v2/health/ready at 200."""
from __future__ import annotations

import subprocess
import sys
import urllib.request

import psutil
import pytest
from triton_pool import wait_until

from eagle_serve import paths
from eagle_serve.server.launch import free_ports, launch
from eagle_serve.server.processes import model_processes
from eagle_serve.triton_backend.repo_config import copy_repository

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


def test_health_fails_once_a_model_process_is_dead(tmp_path, no_idle_servers):
    repo = copy_repository(paths.REPO_ROOT / "model_repository", tmp_path / "repo",
                           ["preprocess", "postprocess"], None)
    server = launch("health", repo, tmp_path / "server.log")
    try:
        healthy = health(server.http_port)
        assert healthy.returncode == 0, healthy.stderr
        model_processes(psutil.Process(server.process.pid))["postprocess"].kill()
        assert wait_until(lambda: health(server.http_port).returncode == 1, 60)
        assert "postprocess" in health(server.http_port).stderr
        print("/v2/health/ready after the stub died:", ready_status(server.http_port))
    finally:
        server.stop()


def test_health_fails_without_a_server():
    (port,) = free_ports(1)
    done = health(port)
    assert done.returncode == 1 and f"no tritonserver with HTTP port {port}" in done.stderr
