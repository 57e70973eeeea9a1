"""Finding a tritonserver and its models' processes on this machine (psutil).

Triton runs each Python-backend model instance as a child process, the backend stub, whose
command line names the model's `<repository>/<model>/<version>/model.py`. The supervisor, the
health check, the soak test and the failure tests look processes up here and nowhere else.
"""
from __future__ import annotations

import re
from pathlib import Path

import psutil

DEFAULT_HTTP_PORT = 8000  # tritonserver's, when its command line names none
MODEL_FILE = re.compile(r"([^/\s]+)/\d+/model\.py\b")  # <model>/<version>/model.py


def python_models(repo: Path) -> list[str]:
    """The models of a repository that run in Python-backend stubs."""
    return sorted(p.parent.parent.name for p in Path(repo).glob("*/1/model.py"))


def model_processes(server: psutil.Process) -> dict[str, psutil.Process]:
    """{model name: its live stub process} among the descendants of `server` (which may be
    tritonserver or a process above it)."""
    found = {}
    for child in server.children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            match = MODEL_FILE.search(" ".join(child.cmdline()))
        except psutil.Error:  # exited while we looked
            continue
        if match:
            found[match.group(1)] = child
    return found


def missing_stubs(server: psutil.Process, models: list[str]) -> list[str]:
    """Those of `models` without a live stub process under the server."""
    alive = model_processes(server)
    return [m for m in models if m not in alive]


def flag(cmdline: list[str], name: str) -> str | None:
    """The value of `--name=value` or `--name value` in a command line."""
    for i, arg in enumerate(cmdline):
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
        if arg == name and i + 1 < len(cmdline):
            return cmdline[i + 1]
    return None


def find_server(http_port: int) -> psutil.Process | None:
    """The tritonserver serving HTTP on `http_port`, None if there is none."""
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if not cmdline or Path(cmdline[0]).name != "tritonserver":
            continue
        if int(flag(cmdline, "--http-port") or DEFAULT_HTTP_PORT) == http_port:
            return proc
    return None
