"""Start the real tritonserver (from the nvidia-pytriton wheel) on a model repository.

`server_command` and `server_environment` are shared by `make serve` and the test fixtures, so
the tests start the server exactly as users do.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import sysconfig
from pathlib import Path

from eagle_serve import paths


def server_environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """The stub embeds libpython and finds packages through `python3` on PATH: put the venv
    first, and the base interpreter's LIBDIR on LD_LIBRARY_PATH (else Debian's libpython).
    The binary's own libraries stay in the wheel's `nvidia_pytriton.libs` (its RPATH is
    relative to the wheel, not to our copy of the tree)."""
    env = dict(os.environ if base is None else base)
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")
    libdirs = [sysconfig.get_config_var("LIBDIR"), str(_wheel_libs()), env.get("LD_LIBRARY_PATH")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in libdirs if p)
    env.setdefault("EAGLE_CACHE", str(paths.cache_dir()))
    # The models run one after another in separate processes: libgomp's default (spin ~300k
    # rounds, ~10 ms here) keeps the target's OpenMP workers spinning on a core through the
    # drafter's call and the responses that follow each forward; 20000 rounds still bridge the
    # gaps between ops inside a forward (the target's decode step runs as fast).
    env.setdefault("GOMP_SPINCOUNT", "20000")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _wheel_libs() -> Path:
    spec = importlib.util.find_spec("pytriton")
    if spec is None:
        raise SystemExit("nvidia-pytriton is not installed: run `make setup`")
    return Path(spec.submodule_search_locations[0]).parent / "nvidia_pytriton.libs"


def server_command(model_repository: Path, http_port: int, grpc_port: int, metrics_port: int,
                   extra: list[str] = (), model_config_name: str | None = None) -> list[str]:
    tree = paths.tritonserver_dir()
    binary = tree / "bin" / "tritonserver"
    if not binary.exists():
        raise SystemExit(f"{binary} is missing: run `make setup`")
    cmd = [str(binary), f"--model-repository={Path(model_repository).resolve()}",
           f"--backend-directory={tree / 'backends'}",
           f"--http-port={http_port}", f"--grpc-port={grpc_port}",
           f"--metrics-port={metrics_port}", "--allow-metrics=true",
           "--model-control-mode=none", "--exit-on-error=true",
           "--log-verbose=0"]
    if model_config_name:
        cmd.append(f"--model-config-name={model_config_name}")
    return cmd + list(extra)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-repository", default=str(paths.REPO_ROOT / "model_repository"))
    parser.add_argument("--model-config-name", default=os.environ.get("MODEL_CONFIG_NAME"),
                        help="e.g. `gpu` to serve with configs/gpu.pbtxt")
    parser.add_argument("--no-supervise", action="store_true",
                        help="exec tritonserver directly (no restart when a model process dies, "
                             "no OpenAI-compatible server)")
    parser.add_argument("--no-openai", action="store_true",
                        help="do not start the OpenAI-compatible server (port OPENAI_PORT, default 9000)")
    args, extra = parser.parse_known_args(argv)
    http_port = int(os.environ.get("HTTP_PORT", 8000))
    grpc_port, metrics_port = int(os.environ.get("GRPC_PORT", 8001)), int(os.environ.get("METRICS_PORT", 8002))
    cmd = server_command(Path(args.model_repository), http_port, grpc_port, metrics_port,
                         ["--exit-timeout-secs=10", *extra], args.model_config_name)
    print(" ".join(cmd), flush=True)
    if args.no_supervise:
        os.execve(cmd[0], cmd, server_environment())  # signals go straight to tritonserver
    from eagle_serve.supervisor import beside, supervise
    openai = None if args.no_openai else openai_command(Path(args.model_repository), grpc_port, metrics_port)
    with beside(openai, dict(os.environ, PYTHONUNBUFFERED="1")):
        code = supervise(cmd, server_environment(), Path(args.model_repository), http_port)
    sys.exit(code)


def openai_command(repo: Path, grpc_port: int, metrics_port: int) -> list[str]:
    """The OpenAI-compatible server in front of this tritonserver (eagle_serve.openai_api)."""
    return [sys.executable, "-m", "eagle_serve.openai_api", f"--model-repository={repo}",
            f"--grpc-url=localhost:{grpc_port}", f"--metrics-url=localhost:{metrics_port}",
            f"--port={os.environ.get('OPENAI_PORT', 9000)}"]


if __name__ == "__main__":
    main()
