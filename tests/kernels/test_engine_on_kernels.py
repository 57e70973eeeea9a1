"""The engine on its GPU path: every dispatcher runs its Triton kernel (through the interpreter,
on CPU tensors) and greedy output stays that of the reference path, for two requests of
different lengths batched, in plain decoding, chains and draft trees; so does a sampled chain
with top_k = 1 (the sampled path's kernels on a one-hot distribution: probabilities,
sampling, rejection and recovery must all pick the argmax). Kernel tests check each kernel
alone on the shapes they build; this checks them on what the target and the drafter actually
pass (views of wider rows, real page tables)."""
from __future__ import annotations

import pytest
import torch

from eagle_serve.core.requests import SamplingParams
from eagle_serve.local import build_local_engine
from eagle_serve.testing import force_gpu_kernels, make_random_head, make_tiny_llama


@pytest.fixture(scope="module")
def small_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-path-models")
    target = make_tiny_llama(root / "target", vocab_size=4096, num_layers=3)  # the interpreter's cost
    return target, make_random_head(root / "eagle3", target, 3, draft_vocab_size=1024)


PROMPTS = [list(range(5, 25)), list(range(100, 103))]  # 20 tokens: three pages of 8 (the 8
# generated cross into a fourth), and 3
SHAPES = {"plain": dict(num_speculative_tokens=0),
          "chain": dict(num_speculative_tokens=3, draft_topk=1),
          "tree": dict(num_speculative_tokens=6, draft_topk=2, draft_depth=3)}


def generate(engine, shape: dict, **sampling) -> list[list[int]]:
    params = SamplingParams(max_tokens=8, ignore_eos=True, **shape, **sampling)
    return [r.token_ids for r in engine.generate(PROMPTS, params)]


@pytest.mark.slow
def test_greedy_output_on_the_kernels_is_the_reference_paths(small_models, monkeypatch):
    target, head = small_models
    engine = build_local_engine(target, head, dtype=torch.float32, page_size=8, num_target_pages=256)
    expected = generate(engine, SHAPES["plain"])
    force_gpu_kernels(monkeypatch)
    engine = build_local_engine(target, head, dtype=torch.float32, page_size=8, num_target_pages=256)
    for name, shape in SHAPES.items():
        assert generate(engine, shape) == expected, name
    assert generate(engine, SHAPES["chain"], temperature=0.8, top_k=1, seed=5) == expected
