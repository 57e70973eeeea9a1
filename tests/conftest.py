"""Shared fixtures. `triton_server(name, models=None, overrides=None, model_config_name=None)`
starts (once per name and session) the real tritonserver on a copy of model_repository/ and
returns a `server.TritonServer` (http_url, grpc_url, metrics_url, log_path, repo). A failing
test that used one gets the tail of its log in the report. `tiny_models` are the float64 tiny
Llama (with the default model's tokenizer) and its random heads that `server.tiny_server`
serves (exact greedy equality holds). `kernels_on_cpu` sends every kernel dispatcher down its
GPU path (the Triton kernel, through the interpreter).
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton: kernel tests

import pytest  # noqa: E402
from server import ServerPool, TritonServer  # noqa: E402


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    from eagle_serve import paths
    from eagle_serve.testing import make_random_head, make_tiny_llama

    root = tmp_path_factory.mktemp("served-models")
    target = make_tiny_llama(root / "tiny-llama", tokenizer_from=paths.default_target_dir())
    return {"target": target,
            "eagle3": make_random_head(root / "eagle3", target, 3, draft_vocab_size=8192),
            "eagle1": make_random_head(root / "eagle1", target, 1, fc_bias=True, fmt="bin")}


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """Every dispatcher runs its Triton kernel (the GPU path), on CPU tensors too, through the
    interpreter (impl "ref" still the ref)."""
    from eagle_serve.kernels import paged_attention, rejection, sampling, workspace

    for module in (paged_attention, rejection, sampling, workspace):
        monkeypatch.setattr(module, "use_kernel", lambda impl, tensor: impl != "ref")


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory):
    pool = ServerPool(tmp_path_factory.mktemp("tritonserver"))
    yield pool
    pool.close()


def servers_used(item) -> list[TritonServer]:
    """Servers a test received directly, else every server of the pool it had access to."""
    values = list(getattr(item, "funcargs", {}).values())
    direct = [v for v in values if isinstance(v, TritonServer)]
    pools = [v for v in values if isinstance(v, ServerPool)]
    return direct or [s for pool in pools for s in pool.servers.values()]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        for server in servers_used(item):
            report.sections.append((f"tritonserver '{server.name}' log tail ({server.log_path})",
                                    server.log_tail()))
    return report
