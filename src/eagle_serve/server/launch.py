"""Starting the real tritonserver on a model repository, the way `make serve` starts it, and
waiting until it is ready: for tools that measure through the server (`eagle-serve gpu-check`)
and for the end-to-end tests. The server runs in its own process group, so stopping it also
ends the Python backend stubs it spawned.
"""
from __future__ import annotations

import os
import random
import secrets
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from eagle_serve.server.serve import server_command, server_environment
from eagle_serve.settings import CONFIG_NAME_ENV

READY_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 20.0
FIRST_PORT = 10000  # free_ports stays above the usual services' ports (make serve's 8000-8002, ...)


@dataclass
class TritonServer:
    name: str
    repo: Path
    log_path: Path
    http_port: int
    grpc_port: int
    metrics_port: int
    process: subprocess.Popen = field(repr=False)
    admin_key: str = field(default="", repr=False)  # the eagle-admin-key header of the admin APIs
    ready_after_s: float = 0.0  # seconds from launch to /v2/health/ready

    @property
    def http_url(self) -> str:
        return f"localhost:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"localhost:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"localhost:{self.metrics_port}"

    def log_tail(self, lines: int = 60) -> str:
        if not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def exit_code(self) -> int | None:
        """tritonserver's exit code (negative: the signal that ended it), None while it runs.
        Read without reaping it: until `stop` reaps it, its pid, its process group's id, cannot
        be another's (pids wrap at 32,768 here, and a test run starts thousands of processes,
        process group leaders among them)."""
        if self.process.returncode is not None:
            return self.process.returncode
        try:
            info = os.waitid(os.P_PID, self.process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped by another waiter
            return self.process.poll()
        if info is None:
            return None
        return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status

    def stop(self) -> None:
        """SIGTERM to the whole process group, then SIGKILL to whatever is left in it (the
        model processes of a server that crashed too), then reap tritonserver."""
        if self.process.returncode is not None:
            return  # reaped already: its group's id may be another's now
        if self.exit_code() is None:
            signal_group(self.process.pid, signal.SIGTERM)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while self.exit_code() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        signal_group(self.process.pid, signal.SIGKILL)
        self.process.wait()


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def ephemeral_ports() -> range:
    """The ports the kernel hands out as the local end of outgoing connections."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return range(low, high + 1)


def free_ports(count: int) -> list[int]:
    """Distinct ports free right now, below the ephemeral range: a server binds its ports only
    once its models are loaded, seconds after they were chosen, and meanwhile any connection on
    the machine may be given an ephemeral port (which bind(0) would pick) as its local end."""
    top = ephemeral_ports().start
    if top - FIRST_PORT < 1000:  # no room below it: the OS's choice
        return bound_ports([0] * count)
    ports: list[int] = []
    while len(ports) < count:
        port = random.randrange(FIRST_PORT, top)
        if port not in ports and bound_ports([port]):
            ports.append(port)
    return ports


def bound_ports(ports: list[int]) -> list[int]:
    """Bind each port (0: one the OS picks) at once, then release them -> the ports bound, or []
    where one was taken."""
    sockets = [socket.socket() for _ in ports]
    try:
        for s, port in zip(sockets, ports):
            s.bind(("localhost", port))
        return [s.getsockname()[1] for s in sockets]
    except OSError:
        return []
    finally:
        for s in sockets:
            s.close()


class CrashedBeforeReady(RuntimeError):
    """tritonserver was ended by a signal before it was ready."""


def launch(name: str, repo: Path, log_path: Path, model_config_name: str | None = None,
           timeout_s: float = READY_TIMEOUT_S) -> TritonServer:
    """Start tritonserver on `repo` and wait until it is ready; on failure stop it and raise
    with the tail of its log. A start that a signal ends before it is ready is made once more,
    as the supervisor of `make serve` restarts it, with a warning carrying the crash's log:
    tritonserver 2.51 has been seen to abort while its Python backend started the model
    processes (boost::interprocess::lock_exception), a crash of Triton's, not of a model's."""
    try:
        return _start(name, repo, log_path, model_config_name, timeout_s)
    except CrashedBeforeReady as crash:
        crashed = log_path.with_name(f"{log_path.stem}.crashed{log_path.suffix}")
        log_path.replace(crashed)
        warnings.warn(f"{crash}\n(started once more; that start's log is {crashed})", stacklevel=2)
    return _start(name, repo, log_path, model_config_name, timeout_s)


def _start(name: str, repo: Path, log_path: Path, model_config_name: str | None,
           timeout_s: float) -> TritonServer:
    http, grpc, metrics = free_ports(3)
    admin = secrets.token_urlsafe(16)
    cmd = server_command(repo, http, grpc, metrics, ["--exit-timeout-secs=3"],
                         model_config_name, admin=admin)
    with open(log_path, "wb") as log:
        env = server_environment() | ({CONFIG_NAME_ENV: model_config_name} if model_config_name else {})
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
    server = TritonServer(name, repo, log_path, http, grpc, metrics, process, admin)
    started = time.monotonic()
    try:
        wait_ready(server, started + timeout_s)
    except BaseException:
        server.stop()
        raise
    server.ready_after_s = time.monotonic() - started
    return server


def wait_ready(server: TritonServer, deadline: float) -> None:
    url = f"http://{server.http_url}/v2/health/ready"
    while time.monotonic() < deadline:
        code = server.exit_code()
        if code is not None:
            error = CrashedBeforeReady if code < 0 else RuntimeError
            raise error(f"tritonserver '{server.name}' exited with code {code} before it was ready; log "
                        f"{server.log_path}:\n{server.log_tail()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.25)
    raise RuntimeError(f"tritonserver '{server.name}' was not ready within the deadline; log "
                       f"{server.log_path}:\n{server.log_tail()}")
