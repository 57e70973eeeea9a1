"""Through the real tritonserver: a repository copy pointed at a model that is not a Llama (a
tiny random Qwen3) behind a head in the vLLM speculators format serves, in float32, the same
greedy output with and without drafts, and HF's."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from triton_pool import CHAINS

from eagle_serve import paths
from eagle_serve.client import grpc_generate
from eagle_serve.core.tokenization import encode_prompt
from eagle_serve.models.heads import random_head
from eagle_serve.models.target import load_target_config
from eagle_serve.testing import hf_generate_greedy, make_tiny_target, write_head_layout

pytestmark = pytest.mark.server

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]


@pytest.fixture(scope="module")
def qwen3_server(triton_server, tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3")
    target = make_tiny_target(root / "tiny-qwen3", "qwen3", dtype=torch.float32,
                              tokenizer_from=paths.default_target_dir())
    head = random_head(load_target_config(target), 3, 8192, d2t=torch.arange(8192), num_layers=2,
                       qk_norm=True, norm_before_residual=True)
    head_dir = write_head_layout(head, root / "speculator.eagle3", "speculators", target)
    server = triton_server("tiny-qwen3-speculators", overrides={"spec_decode": {
        "target_model": str(target), "drafter_model": str(head_dir), "dtype": "float32",
        "num_speculative_tokens": "3", "page_size": "8", "num_target_pages": "256",
        "num_drafter_pages": "256", **CHAINS}})
    return server, target


def test_a_qwen3_target_with_a_speculators_head_serves_hf_greedy_output_with_and_without_drafts(qwen3_server):
    server, target = qwen3_server
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    hf = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    for prompt in PROMPTS:
        expected = hf_generate_greedy(hf, encode_prompt(tokenizer, prompt), 20)
        outputs = {}
        for k, shape in ((0, {}), (3, {}), (6, dict(draft_topk=2, draft_depth=3))):
            got = grpc_generate(server.grpc_url, prompt, max_tokens=20, stream=True, ignore_eos=True,
                                num_speculative_tokens=k, **shape)
            assert got.error is None
            if k:
                assert got.counters["num_draft_tokens"] > 0
            outputs[k] = got.output_ids
        assert outputs[0] == outputs[3] == outputs[6] == expected


def test_an_edit_to_the_gpu_config_alone_reaches_every_model(tmp_path, tiny_models, no_idle_servers):
    """Served with --model-config-name=gpu (its instances made CPU ones to run here), every model
    reads spec_decode's configs/gpu.pbtxt: there alone it names the tiny float64 model, while
    config.pbtxt still names the default one, and the output is the tiny model's; its input
    limit holds in preprocess (the ensemble) and on spec_decode's direct path."""
    import re

    from eagle_serve.core.requests import SamplingParams
    from eagle_serve.server.launch import launch
    from eagle_serve.testing import tiny_engine
    from eagle_serve.triton_backend.repo_config import copy_repository, set_parameter

    repo = copy_repository(paths.REPO_ROOT / "model_repository", tmp_path / "repo")
    for config in repo.glob("*/configs/gpu.pbtxt"):
        text = re.sub(r"kind: KIND_GPU gpus: \[ 0 \]", "kind: KIND_CPU", config.read_text())
        if config.parent.parent.name == "spec_decode":
            for key, value in {"target_model": str(tiny_models["target"]), "drafter_model": str(tiny_models["eagle3"]),
                               "dtype": "float64", "num_speculative_tokens": "3", "page_size": "8",
                               "num_target_pages": "256", "num_drafter_pages": "256", "max_input_bytes": "1000",
                               **CHAINS}.items():
                text = set_parameter(text, key, value)
        config.write_text(text)
    server = launch("gpu-config-on-cpu", repo, tmp_path / "server.log", model_config_name="gpu")
    try:
        log = server.log_path.read_text()
        for model in ("eagle_target", "eagle_drafter"):
            assert f"{model}: settings from {repo / 'spec_decode' / 'configs' / 'gpu.pbtxt'}" in log
        tokenizer = AutoTokenizer.from_pretrained(str(tiny_models["target"]))
        engine = tiny_engine(tiny_models["target"])
        for prompt in PROMPTS[:2]:
            got = grpc_generate(server.grpc_url, prompt, max_tokens=12, ignore_eos=True)
            assert got.error is None and got.counters["num_draft_tokens"] > 0
            plain = engine.generate([encode_prompt(tokenizer, prompt)],
                                    SamplingParams(max_tokens=12, ignore_eos=True, num_speculative_tokens=0))
            assert got.output_ids == plain[0].token_ids
        for model in ("ensemble", "spec_decode"):
            refused = grpc_generate(server.grpc_url, "x" * 1001, model=model, max_tokens=2)
            assert "1001 bytes, more than the limit of 1000" in str(refused.error), model
    finally:
        server.stop()
