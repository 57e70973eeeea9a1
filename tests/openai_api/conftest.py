"""The OpenAI server tests' shared servers: the tiny float64 eagle3 server of the pool and an
OpenAI server in front of it, one per module, and the target's tokenizer."""
from __future__ import annotations

import pytest
from openai_front import launch_openai
from triton_pool import tiny_server

from eagle_serve.core.tokenization import load_tokenizer


@pytest.fixture(scope="module")
def tiny(triton_server, tiny_models):
    return tiny_server(triton_server, tiny_models, "eagle3")


@pytest.fixture(scope="module")
def api(tiny, tmp_path_factory):
    server = launch_openai(tiny, tmp_path_factory.mktemp("openai") / "openai.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    return load_tokenizer(tiny_models["target"])
