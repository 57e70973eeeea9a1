"""Tiny float64 models shared by the engine tests (built once per run, no downloads)."""
from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from eagle_serve import testing
from eagle_serve.testing import make_random_head, make_tiny_llama


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "target")


@pytest.fixture(scope="session")
def eagle1_head(tmp_path_factory, tiny_target):
    return make_random_head(tmp_path_factory.mktemp("h1") / "eagle1", tiny_target, 1, fc_bias=True)


@pytest.fixture(scope="session")
def eagle3_head(tmp_path_factory, tiny_target):
    return make_random_head(tmp_path_factory.mktemp("h3") / "eagle3", tiny_target, 3,
                            draft_vocab_size=4096)


@pytest.fixture(scope="session")
def prompts():
    """8 prompts of mixed lengths (3 .. 45 tokens)."""
    rng = random.Random(1234)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in (3, 45, 17, 8, 30, 5, 22, 11)]


@pytest.fixture(scope="session")
def hf_greedy(tiny_target):
    """HF transformers `generate`, greedy, on the same float64 weights."""
    model = AutoModelForCausalLM.from_pretrained(str(tiny_target), dtype=torch.float64).eval()
    cache: dict[tuple, list[int]] = {}

    def run(prompt: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt), max_new_tokens)
        if key not in cache:
            cache[key] = testing.hf_generate_greedy(model, prompt, max_new_tokens)
        return cache[key]
    return run
