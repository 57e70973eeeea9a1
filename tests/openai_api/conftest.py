"""The OpenAI server tests' shared servers: the tiny float64 eagle3 server of the pool, an
OpenAI server in front of it shared by the modules here, and the target's tokenizer."""
from __future__ import annotations

import pytest
from openai_front import launch_openai
from triton_pool import tiny_server

from eagle_serve.core.tokenization import load_tokenizer


@pytest.fixture(scope="module")
def tiny(triton_server, tiny_models):
    return tiny_server(triton_server, tiny_models, "eagle3")


@pytest.fixture(scope="session")
def _fronts():
    """OpenAI servers by the tritonserver they front: one for every module here (a launch
    imports the server's stack, seconds), another only where the pool started that again."""
    fronts = {}
    yield fronts
    for front in fronts.values():
        front.stop()


@pytest.fixture(scope="module")
def api(tiny, _fronts, tmp_path_factory):
    if tiny.grpc_url not in _fronts:
        _fronts[tiny.grpc_url] = launch_openai(tiny, tmp_path_factory.mktemp("openai") / "openai.log")
    return _fronts[tiny.grpc_url]


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    return load_tokenizer(tiny_models["target"])
