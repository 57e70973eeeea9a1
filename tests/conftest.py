"""Shared fixtures. `triton_server(name, models=None, overrides=None, model_config_name=None)`
starts (once per name and session) the real tritonserver on a copy of model_repository/ and
returns a `server.TritonServer` (http_url, grpc_url, metrics_url, log_path, repo). A failing
test that used one gets the tail of its log in the report.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton: kernel tests

import pytest  # noqa: E402

from server import ServerPool, TritonServer  # noqa: E402


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
