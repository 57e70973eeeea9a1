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
SHM_DIR = Path("/dev/shm")


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


def shm_regions(stubs) -> set[str]:
    """The shared-memory regions (files of /dev/shm) of stub processes (model_processes'
    values): a stub's second argument names its region. tritonserver removes a region when its
    model unloads; that of a stub or server that was killed stays until removed
    (remove_shm_regions)."""
    regions = set()
    for stub in stubs:
        try:
            args = stub.cmdline()
        except psutil.Error:  # exited since it was found
            continue
        if len(args) > 2 and "/" not in args[2]:
            regions.add(args[2])
    return regions


def remove_shm_regions(regions: set[str]) -> list[str]:
    """Remove those of `regions` still in /dev/shm (those of a server that has exited) -> them."""
    removed = []
    for name in sorted(regions):
        try:
            (SHM_DIR / name).unlink()
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed
