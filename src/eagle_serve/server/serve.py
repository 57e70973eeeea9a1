"""Start the real tritonserver (from the nvidia-pytriton wheel) on a model repository.

`server_command` and `server_environment` are shared by `make serve` and the test fixtures, so
the tests start the server exactly as users do.

Safe by default: Triton's admin APIs (model repository, model config, shared memory,
statistics, trace, logging) answer only requests with the header `eagle-admin-key: <key>` on
HTTP, `triton-grpc-protocol-eagle-admin-key: <key>` on gRPC (Triton's prefix); the key comes
from `EAGLE_ADMIN_KEY` or is generated and printed at start.
Health, metadata and inference stay open; eagle_target and eagle_drafter refuse every caller
but spec_decode (eagle_serve.triton_backend.internal_key).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import secrets
import sys
import sysconfig
from pathlib import Path

from eagle_serve import paths
from eagle_serve.settings import CONFIG_NAME_ENV


def server_environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """The stub embeds libpython and finds packages through `python3` on PATH: put the venv
    first, and the base interpreter's LIBDIR on LD_LIBRARY_PATH (else Debian's libpython).
    The binary's own libraries stay in the wheel's `nvidia_pytriton.libs` (its RPATH is
    relative to the wheel, not to our copy of the tree)."""
    env = dict(os.environ if base is None else base)
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")
    wheel_libs = _wheel_libs()
    if wheel_libs is not None:  # the NVIDIA container's tree finds its libraries itself
        libdirs = [sysconfig.get_config_var("LIBDIR"), str(wheel_libs), env.get("LD_LIBRARY_PATH")]
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in libdirs if p)
    env.setdefault("EAGLE_CACHE", str(paths.cache_dir()))
    # The models run one after another in separate processes: libgomp's default (spin ~300k
    # rounds, ~10 ms here) keeps the target's OpenMP workers spinning on a core through the
    # drafter's call and the responses that follow each forward; 20000 rounds still bridge the
    # gaps between ops inside a forward (the target's decode step runs as fast).
    env.setdefault("GOMP_SPINCOUNT", "20000")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _wheel_libs() -> Path | None:
    """The libraries of the nvidia-pytriton wheel's tree; None where it is not installed."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None:
        return None
    return Path(spec.submodule_search_locations[0]).parent / "nvidia_pytriton.libs"


CONTAINER_TREE = Path("/opt/tritonserver")  # where the NVIDIA Triton container has it
ADMIN_APIS = "model-repository,model-config,shared-memory,statistics,trace,logging"
ADMIN_HEADER = "eagle-admin-key"


def admin_key() -> str:
    """`EAGLE_ADMIN_KEY`, else a new random key."""
    return os.environ.get("EAGLE_ADMIN_KEY") or secrets.token_urlsafe(24)


def tritonserver_tree() -> Path:
    """The tritonserver tree to run: $TRITONSERVER_DIR, else the one `make setup` copied into
    the cache, else the NVIDIA container's."""
    if os.environ.get("TRITONSERVER_DIR"):
        return Path(os.environ["TRITONSERVER_DIR"])
    cached = paths.tritonserver_dir()
    return cached if cached.exists() or not CONTAINER_TREE.exists() else CONTAINER_TREE


def server_command(model_repository: Path, http_port: int, grpc_port: int, metrics_port: int,
                   extra: list[str] = (), model_config_name: str | None = None,
                   admin: str | None = None) -> list[str]:
    """admin: the key of the admin APIs (None = a new random one: nobody can use them)."""
    tree = tritonserver_tree()
    binary = tree / "bin" / "tritonserver"
    if not binary.exists():
        raise SystemExit(f"{binary} is missing: run `make setup`")
    cmd = [str(binary), f"--model-repository={Path(model_repository).resolve()}",
           f"--backend-directory={tree / 'backends'}",
           f"--http-port={http_port}", f"--grpc-port={grpc_port}",
           f"--metrics-port={metrics_port}", "--allow-metrics=true",
           "--model-control-mode=none", "--exit-on-error=true",
           "--log-verbose=0"]
    restricted = f"{ADMIN_APIS}:{ADMIN_HEADER}={admin or secrets.token_urlsafe(24)}"
    cmd += [f"--http-restricted-api={restricted}", f"--grpc-restricted-protocol={restricted}"]
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
    if args.model_config_name:  # the models read their settings from the same config (settings_file)
        os.environ[CONFIG_NAME_ENV] = args.model_config_name
    key = admin_key()
    cmd = server_command(Path(args.model_repository), http_port, grpc_port, metrics_port,
                         ["--exit-timeout-secs=10", *extra], args.model_config_name, admin=key)
    print(" ".join(c.replace(key, "<admin key>") for c in cmd), flush=True)
    if not os.environ.get("EAGLE_ADMIN_KEY"):
        print(f"admin APIs ({ADMIN_APIS}) need the header '{ADMIN_HEADER}: {key}' (gRPC: "
              f"'triton-grpc-protocol-{ADMIN_HEADER}'); set EAGLE_ADMIN_KEY to choose the key",
              flush=True)
    if args.no_supervise:
        os.execve(cmd[0], cmd, server_environment())  # signals go straight to tritonserver
    from eagle_serve.server.supervisor import beside, supervise
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
