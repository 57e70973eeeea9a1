"""Keep tritonserver serving: restart it when a model's Python process dies.

Triton 2.51 does not restart a dead Python-backend stub (measured: after `eagle_target`'s stub
was killed, every request failed with "Stub process ... is not healthy" while
/v2/health/ready stayed 200). The supervisor runs tritonserver as a child, watches that every
Python model of the repository has a live stub process, and on a death logs it, stops the
server (open streams get an error and FINAL from spec_decode's shutdown), removes the shared
memory the dead process left in /dev/shm, and starts it again.
SIGTERM / SIGINT are passed on to the server, and the supervisor exits with it. `beside`
runs a sibling process (the OpenAI-compatible server) for as long as the supervisor runs.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import psutil

from eagle_serve.server.processes import missing_stubs, model_processes, python_models, remove_shm_regions, shm_regions

POLL_S = 1.0
DEAD_GRACE_S = 5.0  # after a model process died, before stopping the server ourselves
STOP_TIMEOUT_S = 20.0
STUB_POLL_S = 0.1  # while a server with a dead model process stops


def log(message: str) -> None:
    print(f"[supervisor {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def ready(http_port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://localhost:{http_port}/v2/health/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@contextmanager
def beside(cmd: list[str] | None, env: dict[str, str]):
    """Run `cmd` (if any) as a sibling of tritonserver while the block runs: it is not
    restarted with tritonserver (the OpenAI server reconnects by itself) and gets SIGTERM
    when the block ends (Ctrl-C reaches it directly from the terminal)."""
    if cmd is None:
        yield None
        return
    log(f"starting {' '.join(cmd)}")
    sibling = subprocess.Popen(cmd, env=env)
    try:
        yield sibling
    finally:
        if sibling.poll() is None:
            sibling.send_signal(signal.SIGTERM)
        try:
            sibling.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            sibling.kill()
            sibling.wait()


def supervise(cmd: list[str], env: dict[str, str], repo: Path, http_port: int,
              max_fast_failures: int = 3) -> int:
    repo = Path(repo).resolve()
    models = python_models(repo)
    stopping = False
    child: subprocess.Popen | None = None

    def on_signal(signum, _frame):
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    fast_failures = 0
    while True:
        child = subprocess.Popen(cmd, env=env)
        regions: set[str] = set()
        died, was_ready = _watch(child, models, http_port, lambda: stopping, regions)
        if died:
            log(f"model process(es) {died} died; restarting tritonserver")
            code = _stop_after_death(child, models)
        else:
            try:
                code = child.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                child.kill()
                code = child.wait()
        # the shared memory of a killed model process (or server) outlives it: up to 16 MiB a
        # region in the images' configuration, which restarts would pile up in /dev/shm
        removed = remove_shm_regions(regions)
        if removed:
            log(f"removed {len(removed)} shared-memory region(s) the stopped server left")
        if stopping:
            return code
        # a server that never got ready will not get ready by trying again and again; one that
        # served and then stopped (spec_decode stops it when a model process is stuck) restarts
        fast_failures = 0 if was_ready else fast_failures + 1
        if fast_failures >= max_fast_failures:
            log(f"tritonserver exited {fast_failures} times before it was ready; giving up")
            return code or 1
        log(f"tritonserver exited with code {code}; restarting")


def _stop_after_death(child: subprocess.Popen, models: list[str]) -> int:
    """End a server one of whose model processes died -> its exit code. spec_decode fails the
    open requests with the reason and stops the server (if it has not within DEAD_GRACE_S, a
    SIGTERM does); once the live models have unloaded, the server is killed: it would otherwise
    wait out its whole exit timeout for the dead model, which never unloads."""
    term_at, kill_at = time.monotonic() + DEAD_GRACE_S, time.monotonic() + DEAD_GRACE_S + STOP_TIMEOUT_S
    while child.poll() is None:
        now = time.monotonic()
        try:
            unloaded = len(missing_stubs(psutil.Process(child.pid), models)) == len(models)
        except psutil.Error:  # it exited while we looked
            continue
        if unloaded or now > kill_at:
            log("the live models unloaded; ending tritonserver (the dead one never unloads)" if unloaded
                else f"tritonserver did not stop within {STOP_TIMEOUT_S:.0f} s; killing it")
            child.kill()
            break
        if term_at is not None and now > term_at:
            child.send_signal(signal.SIGTERM)
            term_at = None
        time.sleep(STUB_POLL_S)
    return child.wait()


def _watch(child: subprocess.Popen, models: list[str], http_port: int,
           stopping, regions: set[str]) -> tuple[list[str], bool]:
    """Until the child exits or a stub dies (after the server was ready) -> the dead models,
    and whether the server was ever ready; `regions` gathers the stubs' shared memory."""
    server = psutil.Process(child.pid)
    was_ready = False
    while child.poll() is None and not stopping():
        time.sleep(POLL_S)
        try:
            stubs = model_processes(server)
        except psutil.Error:  # the server exited while we looked
            continue
        regions |= shm_regions(stubs.values())
        was_ready = was_ready or ready(http_port)
        if was_ready:
            dead = [m for m in models if m not in stubs]
            if dead:
                time.sleep(POLL_S)  # confirm: not a stub in the middle of starting
                dead = missing_stubs(server, models)
                if dead:
                    return dead, True
    return [], was_ready
